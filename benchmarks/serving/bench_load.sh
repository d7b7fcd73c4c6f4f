#!/usr/bin/env bash
# The load sweep behind docs/benchmarks.md: the demo pair served from deployments/configs/demo_cpu.yaml, driven by
# `specdec bench serve` at concurrency 1, 4 and 8, speculation on (per request: `auto`, then a fixed k) vs off.
# Usage: benchmarks/serving/bench_load.sh [OUT_DIR] [K ...]   (K: auto and/or fixed k values, default "auto 3"; about 11 minutes
# per K on a 2-core CPU). Each K writes OUT_DIR/load_auto.json or OUT_DIR/load_k<K>.json and its plot.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-docs/bench}
shift $(( $# > 0 ? 1 : 0 ))
ks=("$@")
[ $# -eq 0 ] && ks=(auto 3)
specdec=.venv/bin/specdec
mkdir -p "$out"
$specdec models pull qwen2.5-coder-1.5b-instruct >/dev/null
$specdec models pull qwen2.5-coder-0.5b-instruct >/dev/null
$specdec serve deployments/configs/demo_cpu.yaml >"$out/load_server.log" 2>&1 &
server=$!
trap 'kill -INT $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 600); do  # the server is up once GetModelInfo answers
  $specdec generate --max-tokens 1 "hi" >/dev/null 2>&1 && break
  sleep 2
done
# Two blocks per mode, run A B B A: the machine's speed drifts by several percent over minutes (shared hosts), and the
# interleaving keeps that drift out of the ratio.
common=(--address 127.0.0.1:9000 --prompts benchmarks/prompts/code.jsonl --max-new-tokens 96 --concurrency 1,4,8
        --compare-off --warmup 2 --num-requests 16 --blocks 2)
# Adaptive speculation (`auto`, load-aware) and fixed k, each against off, every point in one run.
for k in "${ks[@]}"; do
  name=$([ "$k" = auto ] && echo load_auto || echo "load_k$k")
  $specdec bench serve "${common[@]}" --num-speculative-tokens "$k" --json "$out/$name.json"
done
