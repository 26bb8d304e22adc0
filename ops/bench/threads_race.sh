#!/usr/bin/env bash
# The CPU worker's OpenMP threads, raced (issue 52): the daemon on the default model (SmolLM2 Q4_1,
# packed) with its worker at THREADS_A and at THREADS_B OpenMP threads (OMP_NUM_THREADS; "default":
# unset, a thread per core), vLLM's client, random 128/128, at each of STREAMS (default "1 4 16")
# concurrent streams, 16 or 4 x STREAMS prompts, ABBA order (A, B, B, A), a fresh daemon per run:
#   ops/bench/threads_race.sh OUT          then: python ops/bench/race_table.py OUT
# Results: vLLM's --save-result JSON files t{A,B}-c{N}-r{1,2}.json and logs under OUT.
set -u
OUT=$(realpath -m "$1"); mkdir -p "$OUT"
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SHARED=$(realpath "${SHARED:-$ROOT/../shared}")
A=${THREADS_A:-default}; B=${THREADS_B:-1}
GGUF=$(python -c "from conveyor.default_model import default_gguf; print(default_gguf())")
PACKED=$(python -c "from conveyor.gpu.loading.gguf import ensure_checkpoint as e; print(e('$GGUF', 'float32'))")
cd /tmp
wait_health() { for _ in $(seq 1 600); do curl -sf "localhost:$1/health" >/dev/null && return 0; sleep 1; done; return 1; }
run() { # THREADS STREAMS ROUND
  local name=t$1-c$2-r$3 prompts=$(($2 < 4 ? 16 : $2 * 4))
  if [ "$1" = default ]; then
    PYTHONPATH=$ROOT python -m conveyor serve --model "$PACKED" --served-model-name smol --port 8000 > "$OUT/serve-$name.log" 2>&1 &
  else
    OMP_NUM_THREADS=$1 PYTHONPATH=$ROOT python -m conveyor serve --model "$PACKED" --served-model-name smol --port 8000 > "$OUT/serve-$name.log" 2>&1 &
  fi
  local pid=$!; wait_health 8000
  bash "$SHARED/peers/vllm-cpu.sh" bench --backend vllm --base-url http://127.0.0.1:8000 --model smol --tokenizer "$PACKED" \
    --request-rate inf --seed 0 --ignore-eos --disable-tqdm --save-result --result-dir "$OUT" --result-filename "$name.json" \
    --dataset-name random --random-input-len 128 --random-output-len 128 --random-range-ratio 0.0 --num-prompts $prompts \
    --max-concurrency "$2" > "$OUT/$name.log" 2>&1
  kill -TERM $pid; wait $pid; sleep 3
}
for n in ${STREAMS:-1 4 16}; do
  run "$A" "$n" 1; run "$B" "$n" 1; run "$B" "$n" 2; run "$A" "$n" 2
done
