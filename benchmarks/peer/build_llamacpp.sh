#!/usr/bin/env bash
# llama.cpp's llama-server (and llama-bench) and the demo pair in GGUF, for `specdec bench peer` and
# benchmarks/kernels/vs_llamacpp.py (docs/benchmarks.md).
# Usage: benchmarks/peer/build_llamacpp.sh [WORK_DIR]
#   WORK_DIR defaults to ${SPECDEC_HOME:-$HOME/.cache/specdec}/peers/llama.cpp. A step whose output is already there
#   is skipped, so a second run only prints the paths.
# No model hub and no git clone: llama.cpp is the source PyPI's llama-cpp-python ships (vendor/llama.cpp), and the
# models are the safetensors of the `specdec models` cache (`specdec models pull NAME` first), converted with that
# source's own convert_hf_to_gguf.py: the target in bf16 (as we serve it), the draft in Q8_0 and in Q4_0 (every tensor
# 4-bit, `llama-quantize --pure`: a 4-bit weight and an fp16 scale per 32, as `quantization: int4` stores the draft).
# The converter needs sentencepiece: where the Python used lacks it, it goes into WORK_DIR/pydeps, not into the venv.
set -euo pipefail
cd "$(dirname "$0")/../.."
version=0.3.36
home=${SPECDEC_HOME:-$HOME/.cache/specdec}
work=${1:-$home/peers/llama.cpp}
models=$home/models
python=${PYTHON:-.venv/bin/python}
[ -x "$python" ] || python=python3
src=$work/llama_cpp_python-$version
llama=$src/vendor/llama.cpp
server=$llama/build/bin/llama-server
quantize=$llama/build/bin/llama-quantize
bench=$llama/build/bin/llama-bench
target=$work/target-bf16.gguf
draft=$work/draft-q8_0.gguf
draft4=$work/draft-q4_0.gguf
mkdir -p "$work"

if [ ! -d "$llama" ]; then
  "$python" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$work"
  tar xzf "$work/llama_cpp_python-$version.tar.gz" -C "$work"
fi

if [ ! -x "$server" ] || [ ! -x "$quantize" ] || [ ! -x "$bench" ]; then
  (cd "$llama" \
    && cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
    && cmake --build build --target llama-server llama-quantize llama-bench -j"$(nproc)")
fi

# convert NAME OUTTYPE OUT: the cached model NAME to OUT, written under a temporary name until complete.
convert() {
  local name=$1 outtype=$2 out=$3
  [ -s "$out" ] && return 0
  if [ ! -f "$models/$name/config.json" ]; then
    echo "no $models/$name: pull it first (specdec models pull $name)" >&2
    exit 1
  fi
  local pythonpath=$llama/gguf-py
  if ! "$python" -c "import sentencepiece" 2>/dev/null; then
    [ -d "$work/pydeps/sentencepiece" ] || "$python" -m pip install --quiet --target "$work/pydeps" sentencepiece
    pythonpath=$pythonpath:$work/pydeps
  fi
  PYTHONPATH=$pythonpath "$python" "$llama/convert_hf_to_gguf.py" "$models/$name" --outtype "$outtype" \
    --outfile "$out.partial"
  mv "$out.partial" "$out"
}
convert qwen2.5-coder-1.5b-instruct bf16 "$target"
convert qwen2.5-coder-0.5b-instruct q8_0 "$draft"
if [ ! -s "$draft4" ]; then
  convert qwen2.5-coder-0.5b-instruct f16 "$work/draft-f16.gguf"
  "$quantize" --pure "$work/draft-f16.gguf" "$draft4.partial" Q4_0
  mv "$draft4.partial" "$draft4"
  rm "$work/draft-f16.gguf"
fi

echo "llama-server: $server"
echo "llama-bench:  $bench (benchmarks/kernels/vs_llamacpp.py)"
echo "target GGUF:  $target"
echo "draft GGUF:   $draft (Q8_0), $draft4 (Q4_0)"
