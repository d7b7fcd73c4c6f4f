"""`specdec bench serve`: a load generator for the public gRPC API (specdec.v1.GenerationService).

- `metrics.py`: one request's record and the pure math over records (latency percentiles, ITL, TPOT, goodput).
- `client.py`: the asyncio side: one streamed request, closed-loop (concurrency) and open-loop (request rate) load.
- `cli.py`: the command's flags, the run over load points and modes, the JSON report.
- `plot.py`: the PNG of throughput and TPOT against load.
"""
