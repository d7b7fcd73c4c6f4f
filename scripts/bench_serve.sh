#!/usr/bin/env bash
# The served-stack benchmark behind docs/benchmarks.md: the demo pair through client -> Serve's gRPC proxy ->
# router -> workers, speculation on vs off, then the same prompts in-process (`bench offline`) in the same run.
# Usage: scripts/bench_serve.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/bench}
specdec=.venv/bin/specdec
$specdec models pull qwen2.5-coder-1.5b-instruct >/dev/null
$specdec models pull qwen2.5-coder-0.5b-instruct >/dev/null
$specdec bench stack deployments/configs/demo_cpu.yaml --prompts benchmarks/prompts/code.jsonl \
  --max-new-tokens 96 --temperature 0 --compare-offline --json "$out/serve_greedy_int8_draft.json"
# Tensor parallelism on this CPU: the 1.5B target unsplit vs over 2 ranks (gloo), one forward, and the all-reduce time.
$specdec bench tp --model qwen2.5-coder-1.5b-instruct --tensor-parallel-size 2 --json "$out/tp2_cpu.json"
# Tracing's cost: every request traced and exported (OTLP to a local receiver) vs none, alternating, one deployment.
$specdec bench tracing deployments/configs/demo_cpu.yaml --prompts benchmarks/prompts/code.jsonl \
  --max-new-tokens 96 --json "$out/tracing_cost.json"
