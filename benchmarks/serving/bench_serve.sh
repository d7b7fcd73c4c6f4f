#!/usr/bin/env bash
# The served-stack benchmarks behind docs/benchmarks.md: the demo pair through client -> Serve's gRPC proxy ->
# router -> workers, speculation on vs off, for the demo config and for a config naming only the two models; then
# tensor parallelism and tracing's cost. One after another (never in parallel: they share the CPU).
# Usage: benchmarks/serving/bench_serve.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-docs/bench}
specdec=.venv/bin/specdec
$specdec models pull qwen2.5-coder-1.5b-instruct >/dev/null
$specdec models pull qwen2.5-coder-0.5b-instruct >/dev/null
for config in demo models_only; do
  $specdec bench stack deployments/configs/${config}_cpu.yaml --prompts benchmarks/prompts/code.jsonl \
    --max-new-tokens 96 --json "$out/stack_$config.json"
done
# Tensor parallelism on this CPU: the 1.5B target unsplit vs over 2 ranks (gloo), one forward, the all-reduce time;
# the ranks on one Ray node, then each on a node of its own.
$specdec bench tp --model qwen2.5-coder-1.5b-instruct --tensor-parallel-size 2 --across-nodes \
  --json "$out/tp_across_nodes.json"
# Tracing's cost: every request traced and exported (OTLP to a local receiver) vs none, alternating, one deployment.
$specdec bench tracing deployments/configs/demo_cpu.yaml --prompts benchmarks/prompts/code.jsonl \
  --max-new-tokens 96 --json "$out/tracing_cost.json"
