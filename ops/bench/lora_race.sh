#!/usr/bin/env bash
# Issue 32's race: SmolLM2 (Q4_1 kept packed) served with 4 random rank-16 adapters on all seven
# projections (conveyor/tiny/lora.py), vLLM's client sending 200 random 128/128 requests at once,
# all on the base model, then spread over the 4 adapters (the client picks one per request), the
# pair ROUNDS times (default 2) alternating on the same server, so its drift falls on both.
#   ops/bench/lora_race.sh OUT [ROUNDS]
# Results: vLLM's --save-result JSON files under OUT; `python ops/bench/lora_table.py OUT` tabulates.
set -u
OUT=$(realpath -m "$1"); mkdir -p "$OUT"; ROUNDS=${2:-2}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SHARED=$(realpath "${SHARED:-$ROOT/../shared}")
GGUF=$(python -c "from conveyor.default_model import default_gguf; print(default_gguf())")
F32=$(python -c "from conveyor.gpu.loading.gguf import ensure_checkpoint as e; print(e('$GGUF', 'float32', packed=False))")
PACKED=$(python -c "from conveyor.gpu.loading.gguf import ensure_checkpoint as e; print(e('$GGUF', 'float32'))")
MODULES=()
for i in 0 1 2 3; do
  python -m conveyor.tiny.lora "$PACKED" "$OUT/adapters/a$i" --rank 16 --seed "$i" > /dev/null
  MODULES+=("a$i=$OUT/adapters/a$i")
done
cd /tmp
wait_health() { for _ in $(seq 1 600); do curl -sf "localhost:$1/health" >/dev/null && return 0; sleep 1; done; return 1; }
PYTHONPATH=$ROOT python -m conveyor serve --model "$PACKED" --served-model-name smol --port 8000 \
  --enable-lora --lora-modules "${MODULES[@]}" --max-loras 4 --max-lora-rank 16 > "$OUT/serve.log" 2>&1 &
CPID=$!; wait_health 8000
bench() { # NAME ARGS...
  bash "$SHARED/peers/vllm-cpu.sh" bench --backend vllm --base-url "http://127.0.0.1:8000" --model smol --tokenizer "$F32" \
    --dataset-name random --random-input-len 128 --random-output-len 128 --random-range-ratio 0.0 --num-prompts 200 \
    --request-rate inf --seed 0 --ignore-eos --disable-tqdm --save-result --result-dir "$OUT" --result-filename "$1.json" \
    "${@:2}" > "$OUT/$1.log" 2>&1
}
for round in $(seq 1 "$ROUNDS"); do
  bench "base-$round"
  bench "lora-$round" --lora-modules a0 a1 a2 a3
done
kill -TERM $CPID; wait $CPID
