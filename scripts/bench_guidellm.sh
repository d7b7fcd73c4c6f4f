#!/usr/bin/env bash
# An outside harness next to ours: guidellm (vLLM project's load generator) against the OpenAI-compatible HTTP API,
# speculation on and off, then `specdec bench serve --protocol openai` on the same prompts and lengths, one server,
# back to back. Prints a side-by-side table (and writes it as markdown) from the JSON reports.
#
# Usage: scripts/bench_guidellm.sh [CONFIG] [OUT_DIR]
#   CONFIG   a `specdec serve` config (default deployments/configs/demo_cpu.yaml); its http_port must be free
#   OUT_DIR  every report and log (default out/guidellm)
# Environment (defaults): REQUESTS=16 measured requests per harness and mode, CONCURRENCY=1, PROMPT_TOKENS=128
#   (synthetic prompt length, in the target's tokens, before the chat template), OUTPUT_TOKENS=96 (exact: ignore_eos),
#   WARMUP=2 requests per mode before each harness's runs, TOKENIZER (default: the target model's directory),
#   GUIDELLM=.venv-guidellm/bin/guidellm, SPECDEC=.venv/bin/specdec, READY_TIMEOUT_S=900.
#
# No hub: guidellm's synthetic_text data and a local tokenizer (the target's own directory), HF_HUB_OFFLINE=1.
# Speculation "on" is the server's setting (`auto` in the demo config); "off" sends num_speculative_tokens: 0 in
# every request's body (guidellm: the backend's extras.body). guidellm sends ignore_eos: true and
# max_completion_tokens itself when the data sets output_tokens; temperature 0 and ignore_eos go in extras.body too.
# `specdec bench serve` gets the exact prompts guidellm sent (read back from guidellm's report).
set -euo pipefail
cd "$(dirname "$0")/.."

config=${1:-deployments/configs/demo_cpu.yaml}
out=${2:-out/guidellm}
requests=${REQUESTS:-16}
concurrency=${CONCURRENCY:-1}
prompt_tokens=${PROMPT_TOKENS:-128}
output_tokens=${OUTPUT_TOKENS:-96}
warmup=${WARMUP:-2}
guidellm=${GUIDELLM:-.venv-guidellm/bin/guidellm}
specdec=${SPECDEC:-.venv/bin/specdec}
python=$(dirname "$specdec")/python
ready_timeout=${READY_TIMEOUT_S:-900}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1

exec 3>&2  # the script's own stderr, for messages from traps that run inside a redirected command
say() { echo "bench_guidellm: $*" >&3; }
die() { say "$*"; exit 1; }
[[ -f $config ]] || die "no config at $config"
[[ -x $guidellm ]] || die "$guidellm not found: make bench-guidellm creates .venv-guidellm (or set GUIDELLM)"
[[ -x $specdec ]] || die "$specdec not found: make setup (or set SPECDEC)"
mkdir -p "$out"

# The config's HTTP port and the target's directory (a path, or a `specdec models` name in the model store).
info=$("$python" - "$config" <<'EOF'
import sys
from pathlib import Path
from deployments.serve_config import load_config
from specdec_core.models import store
config = load_config(sys.argv[1])
model = Path(config.target.model).expanduser()
print(config.http_port, model if model.exists() else store.model_dir(config.target.model))
EOF
)
read -r http_port target_dir <<<"$info"
tokenizer=${TOKENIZER:-$target_dir}
[[ -f $tokenizer/tokenizer.json || -f $tokenizer/tokenizer_config.json ]] \
  || die "no tokenizer in $tokenizer (pull the target model, or set TOKENIZER to a local tokenizer directory)"
base=http://127.0.0.1:$http_port
if curl -s -o /dev/null --max-time 2 "$base/"; then
  die "something already answers on port $http_port: stop it first (the numbers would be another server's)"
fi

# -- the server (and a harness, if one is running), stopped with every process they started however this ends ------
server_pid="" harness_pid=""
descendants() {  # every process below $1, parents before children
  local child
  for child in $(ps -o pid= --ppid "$1" 2>/dev/null); do echo "$child"; descendants "$child"; done
}
stop_tree() {  # $1: pid, $2: seconds to wait after SIGTERM before SIGKILL
  local pids pid i
  pids=$(descendants "$1")  # before it exits: its orphans would be reparented out of reach
  if kill -0 "$1" 2>/dev/null; then
    kill -TERM "$1" 2>/dev/null || true
    for ((i = 0; i < $2 * 2; i++)); do kill -0 "$1" 2>/dev/null || break; sleep 0.5; done
    kill -KILL "$1" 2>/dev/null || true
  fi
  # The server's Ray processes (raylet, workers) are its descendants: whatever its shutdown left behind goes too.
  for pid in $pids; do kill -TERM "$pid" 2>/dev/null || true; done
  [[ -z $pids ]] || sleep 1
  for pid in $pids; do kill -KILL "$pid" 2>/dev/null || true; done
}
cleanup() {
  if [[ -n $harness_pid ]]; then stop_tree "$harness_pid" 10; harness_pid=""; fi
  if [[ -n $server_pid ]]; then
    say "stopping the server (pid $server_pid)"
    stop_tree "$server_pid" 60
    server_pid=""
  fi
}
harness() {  # run "$@" in the background and wait: a signal then interrupts the wait (and cleanup stops it)
  local rc=0
  "$@" &
  harness_pid=$!
  wait "$harness_pid" || rc=$?
  harness_pid=""
  return "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

say "serving $config (log: $out/serve.log)"
"$specdec" serve "$config" >"$out/serve.log" 2>&1 &
server_pid=$!
deadline=$((SECONDS + ready_timeout))
until curl -sf -o /dev/null --max-time 5 "$base/v1/models"; do
  kill -0 "$server_pid" 2>/dev/null || { tail -n 30 "$out/serve.log" >&2; die "the server exited"; }
  ((SECONDS < deadline)) || die "GET $base/v1/models did not answer within ${ready_timeout}s"
  sleep 2
done
model=$(curl -sf "$base/v1/models" | "$python" -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')
say "$base serves $model; tokenizer $tokenizer"

# Warm-up (first-call costs out of guidellm's figures; `specdec bench serve` runs its own --warmup).
warm() {  # $1: extra JSON members of the body
  local i
  for ((i = 0; i < warmup; i++)); do
    curl -sf -o /dev/null --max-time 600 "$base/v1/chat/completions" -H 'content-type: application/json' \
      -d "{\"model\": \"$model\", \"messages\": [{\"role\": \"user\", \"content\": \"Write a Python function that reverses a list.\"}], \"max_tokens\": $output_tokens, \"temperature\": 0, \"ignore_eos\": true$1}" \
      || die "a warm-up request failed (body extras: ${1:-none})"
  done
}
warm ""
warm ', "num_speculative_tokens": 0'

# -- guidellm, speculation on (the server's setting) then off ------------------------------------------------------
run_guidellm() {  # $1: mode name, $2: extra backend arguments
  say "guidellm, speculation $1"
  harness "$guidellm" run \
    --backend "kind=openai_http,target=$base,extras.body.temperature=0,extras.body.ignore_eos=true$2" \
    --profile "kind=concurrent,streams=$concurrency" \
    --data "kind=synthetic_text,prompt_tokens=$prompt_tokens,output_tokens=$output_tokens" \
    --tokenizer "kind=hf_auto,model=$tokenizer" \
    --constraint "kind=max_requests,count=$requests" \
    --output "kind=json,path=$out/guidellm_$1.json" \
    --disable-console-interactive >"$out/guidellm_$1.log" 2>&1 \
    || { tail -n 40 "$out/guidellm_$1.log" >&2; die "guidellm ($1) failed: $out/guidellm_$1.log"; }
}
run_guidellm on ""
run_guidellm off ",extras.body.num_speculative_tokens=0"

# The prompts guidellm sent (the same ones in both modes: its synthetic data is seeded), for our load generator.
"$python" - "$out/guidellm_on.json" "$out/prompts.jsonl" <<'EOF'
import json, sys
report = json.load(open(sys.argv[1]))
lines = []
for request in report["benchmarks"][0]["requests"]["successful"]:
    body = json.loads(request["request_args"])["body"]
    content = body["messages"][-1]["content"]
    text = content if isinstance(content, str) else "".join(part["text"] for part in content)
    lines.append(json.dumps({"prompt": text}))
if not lines:
    sys.exit("bench_guidellm: guidellm's report holds no completed request to take prompts from")
open(sys.argv[2], "w").write("\n".join(lines) + "\n")
EOF

# -- ours: the same prompts, lengths and concurrency, speculation on then off --------------------------------------
say "specdec bench serve --protocol openai"
harness "$specdec" bench serve --protocol openai --address "127.0.0.1:$http_port" --prompts "$out/prompts.jsonl" \
  --max-new-tokens "$output_tokens" --concurrency "$concurrency" --num-requests "$requests" --warmup "$warmup" \
  --temperature 0 --ignore-eos --compare-off --json "$out/specdec_bench_serve.json" >"$out/specdec_bench_serve.log" 2>&1 \
  || { tail -n 40 "$out/specdec_bench_serve.log" >&2; die "specdec bench serve failed: $out/specdec_bench_serve.log"; }

cleanup

# -- the table ------------------------------------------------------------------------------------------------------
"$python" - "$out" "$guidellm" <<'EOF'
import json, subprocess, sys
from pathlib import Path

out, guidellm = Path(sys.argv[1]), sys.argv[2]
version = subprocess.run([str(Path(guidellm).parent / "python"), "-c",
                          "import importlib.metadata as m; print(m.version('guidellm'))"],
                         capture_output=True, text=True).stdout.split() or ["?"]

def guidellm_row(mode):
    m = json.loads((out / f"guidellm_{mode}.json").read_text())["benchmarks"][0]["metrics"]
    ok = lambda key, stat: m[key]["successful"][stat]
    return {"done": m["request_totals"]["successful"], "failed": m["request_totals"]["errored"],
            "tok_req": ok("output_token_count", "mean"), "tok_s": ok("output_tokens_per_second", "mean"),
            "ttft": ok("time_to_first_token_ms", "median"), "itl": ok("inter_token_latency_ms", "median"),
            "tpot": None}

ours = json.loads((out / "specdec_bench_serve.json").read_text())["points"][0]
def specdec_row(mode):
    f = ours["speculative" if mode == "on" else "off"]
    return {"done": f["completed"], "failed": f["failed"], "tok_req": f["total_output_tokens"] / max(f["completed"], 1),
            "tok_s": f["output_tokens_per_s"], "ttft": f["median_ttft_ms"], "itl": f["median_itl_ms"],
            "tpot": f["median_tpot_ms"]}

rows = {(f"guidellm {version[0]}", mode): guidellm_row(mode) for mode in ("on", "off")}
rows |= {("specdec bench serve", mode): specdec_row(mode) for mode in ("on", "off")}
summary = {"rows": [{"harness": h, "speculation": mode, **r} for (h, mode), r in rows.items()],
           "on_off_ratio": {h: {k: rows[(h, "on")][k] / rows[(h, "off")][k]
                                for k in ("tok_s", "ttft", "itl", "tpot") if rows[(h, "off")][k]}
                            for h in dict.fromkeys(h for h, _ in rows)}}
(out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")

num = lambda v, fmt: "-" if v is None else format(v, fmt)
head = ("harness", "speculation", "done", "err", "tok/req", "out tok/s", "p50 TTFT ms", "p50 ITL ms", "p50 TPOT ms")
table = [head]
for (harness, mode), r in rows.items():
    table.append((harness, mode, str(r["done"]), str(r["failed"]), num(r["tok_req"], ".1f"), num(r["tok_s"], ".2f"),
                  num(r["ttft"], ".1f"), num(r["itl"], ".1f"), num(r["tpot"], ".1f")))
for harness, ratio in summary["on_off_ratio"].items():
    table.append((harness, "on/off", "", "", "", *(num(ratio.get(k), ".2f") + "x" if k in ratio else "-"
                                                   for k in ("tok_s", "ttft", "itl", "tpot"))))
widths = [max(len(row[i]) for row in table) for i in range(len(head))]
for row in table:
    print("  ".join(cell.rjust(w) if i > 1 else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))))
note = ("guidellm's ITL is each request's (last token chunk - first token chunk) / (tokens - 1), its median weighted by "
        "tokens: specdec's TPOT without the stream's tail. specdec's ITL spreads each chunk's gap over that chunk's "
        "tokens (median over tokens); TTFT: both from sending the request to the first chunk with text or tokens.")
print(note)
md = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(row) + " |" for row in table[1:]]
(out / "summary.md").write_text("\n".join(md) + "\n\n" + note + "\n")
print(f"reports: {out}/guidellm_on.json, guidellm_off.json, specdec_bench_serve.json; table: {out}/summary.md")
EOF
