#!/usr/bin/env bash
# Issue 30's measurements: n-gram speculative decoding against none, on the default model
# (SmolLM2-135M-Instruct Q4_1 kept packed), vLLM's client at temperature 0 over the chat API:
#   ops/bench/spec_race.sh OUT PART...
#   grounded  the 64 prompts of ops/bench/grounded/prompts.json (answers that copy their prompt),
#             no speculation then n-gram k = each of KS (default "2 4 8"), at STREAMS (default
#             "1 4 16 64") concurrent streams, all 64 prompts at each
#   sharegpt  64 ShareGPT prompts the same way, no speculation then SHAREGPT_SPEC (default: k = 4)
#   repeat    the grounded and ShareGPT runs at one stream again, in the reverse order (none last)
#   abba      the grounded runs at one stream, ROUNDS (default 2) rounds of none, k, k, none for k
#             the first of KS: each speculative run beside a run without, so the machine's drift
#             over the minutes between runs falls on both sides of each pair
# One server per configuration, at its defaults otherwise. Results under OUT: vLLM's
# --save-result JSON per run (NAME.json), and the server's spec_decode counters before and after
# it (NAME.before, NAME.after); ops/bench/spec_table.py tabulates them. SHARED (default ../shared)
# holds peers/ and workloads/.
set -u
OUT=$(realpath -m "$1"); shift; mkdir -p "$OUT"
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SHARED=$(realpath "${SHARED:-$ROOT/../shared}")
GGUF=$(python -c "from conveyor.default_model import default_gguf; print(default_gguf())")
F32=$(python -c "from conveyor.gpu.loading.gguf import ensure_checkpoint as e; print(e('$GGUF', 'float32', packed=False))")
GROUNDED=(--dataset-name sharegpt --dataset-path "$ROOT/ops/bench/grounded/prompts.json" --num-prompts 64)
SHAREGPT=(--dataset-name sharegpt --dataset-path "$SHARED/workloads/sharegpt_sample.json" --num-prompts 64)
spec() { echo "{\"method\": \"ngram\", \"num_speculative_tokens\": $1}"; }
cd /tmp
wait_health() { for _ in $(seq 1 600); do curl -sf "localhost:$1/health" >/dev/null && return 0; sleep 1; done; return 1; }
counters() { curl -s localhost:8000/metrics | grep -E '^conveyor_spec_decode_[a-z_]+_total\{engine="0"\}' > "$OUT/$1"; }
bench() { # NAME STREAMS DATASET...
  counters "$1.before"
  bash "$SHARED/peers/vllm-cpu.sh" bench --backend openai-chat --endpoint /v1/chat/completions --base-url http://127.0.0.1:8000 \
    --model smol --tokenizer "$F32" --temperature 0 --request-rate inf --max-concurrency "$2" --seed 0 --disable-tqdm \
    --save-result --result-dir "$OUT" --result-filename "$1.json" "${@:3}" > "$OUT/$1.log" 2>&1
  counters "$1.after"
}
up() { # NAME [SPEC]
  PYTHONPATH=$ROOT python -m conveyor serve --served-model-name smol --port 8000 ${2:+--speculative-config "$2"} > "$OUT/serve-$1.log" 2>&1 &
  CPID=$!; wait_health 8000
}
down() { kill -TERM $CPID; wait $CPID; sleep 3; }
run() { # WORKLOAD NAME SPEC STREAMS...
  local workload=$1 name=$2 config=$3; shift 3
  up "$workload-$name" "$config"
  for n in "$@"; do
    if [ "$workload" = grounded ]; then bench "$workload-$name-c$n" "$n" "${GROUNDED[@]}"; else bench "$workload-$name-c$n" "$n" "${SHAREGPT[@]}"; fi
  done
  down
}
for part in "$@"; do
  case $part in
    grounded)
      run grounded none "" ${STREAMS:-1 4 16 64}
      for k in ${KS:-2 4 8}; do run grounded k$k "$(spec "$k")" ${STREAMS:-1 4 16 64}; done ;;
    sharegpt)
      run sharegpt none "" ${STREAMS:-1 4 16 64}
      run sharegpt spec "${SHAREGPT_SPEC:-$(spec 4)}" ${STREAMS:-1 4 16 64} ;;
    repeat)
      for k in ${KS:-2 4 8}; do run grounded k$k-again "$(spec "$k")" 1; done
      run grounded none-again "" 1
      run sharegpt spec-again "${SHAREGPT_SPEC:-$(spec 4)}" 1
      run sharegpt none-again "" 1 ;;
    abba)
      k=${KS:-8}; k=${k%% *}
      for r in $(seq 1 "${ROUNDS:-2}"); do
        run grounded "none-r${r}a" "" 1; run grounded "k$k-r${r}a" "$(spec "$k")" 1
        run grounded "k$k-r${r}b" "$(spec "$k")" 1; run grounded "none-r${r}b" "" 1
      done ;;
    *) echo "unknown part: $part (grounded, sharegpt, repeat, abba)" >&2; exit 2 ;;
  esac
done
