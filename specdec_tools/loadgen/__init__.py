"""`specdec bench serve`: a load generator for the public gRPC API (specdec.v1.GenerationService).

- `metrics.py`: one request's record and the pure math over records (latency percentiles, ITL, TPOT, goodput).
- `client.py`: the asyncio side: one streamed request, closed-loop (concurrency) and open-loop (request rate) load.
- `openai_http.py`: the same request over the OpenAI-compatible HTTP API.
- `transport.py`: either API behind one `connect` (`--protocol`); `bench sessions` uses it too.
- `command.py`: what `bench serve` and `bench sessions` share as commands: the server's flags, argparse types, the run.
- `cli.py`: the command's flags, the run over load points and modes, the JSON report.
- `plot.py`: the PNG of throughput and TPOT against load.
"""
