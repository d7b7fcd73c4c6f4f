#!/usr/bin/env bash
# The offline benchmarks behind docs/benchmarks.md, one after another (never in parallel: they share the CPU).
# Usage: benchmarks/offline/bench_offline_all.sh [OUT_DIR]   (models are pulled first if missing)
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-docs/bench}
specdec=.venv/bin/specdec
target=qwen2.5-coder-1.5b-instruct
draft=qwen2.5-coder-0.5b-instruct
$specdec models pull $target >/dev/null
$specdec models pull $draft >/dev/null
common=(--target $target --dtype bfloat16 --num-speculative-tokens auto)

# Greedy, code prompts, int8-stored draft, against transformers' assisted generation.
$specdec bench offline "${common[@]}" --draft $draft --draft-quantization int8 --compare-hf \
  --prompts benchmarks/prompts/code.jsonl --max-new-tokens 96 --temperature 0 --json "$out/greedy_int8_draft.json"
# Prompt lookup (n-gram) on prompts that ask to edit given code, against transformers' prompt lookup.
$specdec bench offline "${common[@]}" --ngram --compare-hf --prompt-lookup-num-tokens 10 \
  --prompts benchmarks/prompts/edit.jsonl --max-new-tokens 128 --temperature 0 --json "$out/ngram_edit.json"
# Sampling at temperature 0.7, against transformers' assisted sampling.
$specdec bench offline "${common[@]}" --draft $draft --draft-quantization int8 --compare-hf \
  --prompts benchmarks/prompts/code.jsonl --max-new-tokens 96 --temperature 0.7 --seed 0 --json "$out/t07_int8_draft.json"
