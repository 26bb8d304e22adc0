#!/usr/bin/env bash
# Issue 29's races on the default model (SmolLM2-135M-Instruct Q4_1), vLLM's client against each
# server, one server at a time, each at its defaults:
#   ops/bench/peer_race.sh OUT PART...
#   single    float32 (the GGUF dequantized) against Q4_1 kept packed: worker RSS, 16 random 128/128 one at a time
#   llamacpp  packed conveyor, then llama.cpp's server on the same GGUF (64 slots), at STREAMS
#             (default "1 4 16 64") concurrent streams, 16 or 4 x STREAMS random 128/128 prompts
#   cstreams  the same, conveyor alone
#   abba      conveyor and llama.cpp at each of STREAMS in ABBA order (conveyor, llama.cpp,
#             llama.cpp, conveyor; results NAME-r1 and NAME-r2), with LLAMACPP_ISA (a variant of
#             ops/bench/llamacpp_isa.sh; default: the shared script's native build) and conveyor's
#             kernels at CONVEYOR_CPU_ISA (default native), so a pair of one ISA races
#   vllm      200 random 128/128 and 200 ShareGPT prompts: conveyor packed, conveyor float32, vLLM CPU
#             (float32); FORMS (default "packed f32") picks conveyor's, and VLLM=0 leaves vLLM out
# CONVEYOR_ARGS: more flags for every conveyor server (e.g. --float32-matmul-precision medium),
# and TAG a suffix for its result names, so a setting races its default in one OUT.
# Results: vLLM's --save-result JSON files and logs under OUT. SHARED (default ../shared) holds
# peers/ and workloads/.
set -u
OUT=$(realpath -m "$1"); shift; mkdir -p "$OUT"
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SHARED=$(realpath "${SHARED:-$ROOT/../shared}")
GGUF=$(python -c "from conveyor.default_model import default_gguf; print(default_gguf())")
F32=$(python -c "from conveyor.gpu.loading.gguf import ensure_checkpoint as e; print(e('$GGUF', 'float32', packed=False))")
PACKED=$(python -c "from conveyor.gpu.loading.gguf import ensure_checkpoint as e; print(e('$GGUF', 'float32'))")
SHARE=(--dataset-name sharegpt --dataset-path "$SHARED/workloads/sharegpt_sample.json" --num-prompts 200)
cd /tmp
rnd() { echo "--dataset-name random --random-input-len 128 --random-output-len 128 --random-range-ratio 0.0 --num-prompts $1"; }
wait_health() { for _ in $(seq 1 600); do curl -sf "localhost:$1/health" >/dev/null && return 0; sleep 1; done; return 1; }
bench() { # PORT NAME MODEL ARGS...
  bash "$SHARED/peers/vllm-cpu.sh" bench --backend vllm --base-url "http://127.0.0.1:$1" --model "$3" --tokenizer "$F32" \
    --request-rate inf --seed 0 --ignore-eos --disable-tqdm --save-result --result-dir "$OUT" --result-filename "$2.json" \
    "${@:4}" > "$OUT/$2.log" 2>&1
}
conveyor_up() { # NAME MODEL
  # shellcheck disable=SC2086  # CONVEYOR_ARGS: flags, split on purpose
  PYTHONPATH=$ROOT python -m conveyor serve --model "$2" --served-model-name smol --port 8000 ${CONVEYOR_ARGS:-} > "$OUT/serve-$1${TAG:-}.log" 2>&1 &
  CPID=$!; wait_health 8000
}
conveyor_down() { kill -TERM $CPID; wait $CPID; sleep 3; }
worker_rss() { for p in $(pgrep -f "conveyor.*worker"); do echo "$p $(ps -o rss= -p "$p") KiB"; done > "$OUT/rss-$1.txt"; }
streams() { # WITH_LLAMACPP
  for n in ${STREAMS:-1 4 16 64}; do
    prompts=$((n < 4 ? 16 : n * 4))
    conveyor_up packed-c$n "$PACKED"; bench 8000 cpacked-c$n smol $(rnd $prompts) --max-concurrency $n; conveyor_down
    [ "$1" = yes ] || continue
    bash "$SHARED/peers/llamacpp.sh" serve "$GGUF" 8200 64 > "$OUT/llamacpp-c$n-serve.log" 2>&1 & LPID=$!; wait_health 8200
    bench 8200 llamacpp-c$n any $(rnd $prompts) --max-concurrency $n; kill -TERM $LPID; wait $LPID; sleep 3
  done
}
llamacpp_up() { # NAME
  if [ -n "${LLAMACPP_ISA:-}" ]; then
    bash "$ROOT/ops/bench/llamacpp_isa.sh" serve "$LLAMACPP_ISA" "$GGUF" 8200 64 > "$OUT/$1-serve.log" 2>&1 &
  else
    bash "$SHARED/peers/llamacpp.sh" serve "$GGUF" 8200 64 > "$OUT/$1-serve.log" 2>&1 &
  fi
  LPID=$!; wait_health 8200
}
llamacpp_down() { kill -TERM $LPID; wait $LPID; sleep 3; }
abba() {
  for n in ${STREAMS:-1 4 16}; do
    prompts=$((n < 4 ? 16 : n * 4))
    conveyor_up packed-c$n-r1 "$PACKED"; bench 8000 cpacked-c$n-r1 smol $(rnd $prompts) --max-concurrency $n; conveyor_down
    for r in r1 r2; do
      llamacpp_up llamacpp-c$n-$r; bench 8200 llamacpp-c$n-$r any $(rnd $prompts) --max-concurrency $n; llamacpp_down
    done
    conveyor_up packed-c$n-r2 "$PACKED"; bench 8000 cpacked-c$n-r2 smol $(rnd $prompts) --max-concurrency $n; conveyor_down
  done
}
for part in "$@"; do
  case $part in
    single)
      for form in f32 packed; do
        model=$([ $form = f32 ] && echo "$F32" || echo "$PACKED")
        conveyor_up $form "$model"; bench 8000 single-$form smol $(rnd 16) --max-concurrency 1; worker_rss $form; conveyor_down
      done ;;
    llamacpp) streams yes ;;
    cstreams) streams no ;;
    abba) abba ;;
    vllm)
      for form in ${FORMS:-packed f32}; do
        model=$([ $form = f32 ] && echo "$F32" || echo "$PACKED")
        conveyor_up race-$form "$model"; bench 8000 c$form${TAG:-}-random smol $(rnd 200); bench 8000 c$form${TAG:-}-sharegpt smol "${SHARE[@]}"; conveyor_down
      done
      [ "${VLLM:-1}" = 0 ] && continue
      bash "$SHARED/peers/vllm-cpu.sh" serve "$F32" 8100 > "$OUT/vllm-serve.log" 2>&1 & VPID=$!; wait_health 8100
      bench 8100 vllm-random "$F32" $(rnd 200); bench 8100 vllm-sharegpt "$F32" "${SHARE[@]}"; kill -TERM $VPID; wait $VPID; sleep 3 ;;
    *) echo "unknown part: $part (single, llamacpp, cstreams, abba, vllm)" >&2; exit 2 ;;
  esac
done
