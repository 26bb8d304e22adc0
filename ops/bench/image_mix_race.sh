#!/usr/bin/env bash
# Issue 51's mixed text + image load on a vision checkpoint (the tiny LLaVA at 336 px), one fresh
# server per run (empty prefix and encoder caches), rounds in ABBA order:
#
#   bash ops/bench/image_mix_race.sh OUT_DIR MODEL_DIR PART...
#   mix    conveyor with 1 and 2 tokenizer processes (--tokenizer-workers), `conveyor bench serve`
#          at 0%, 50% and 100% image requests and 50% with half of them repeated, a new seed per
#          load so no load finds another's prompts or pictures cached
#   vllm   conveyor against vLLM CPU (../shared/peers/vllm-cpu.sh), each at its defaults, one at a
#          time, vLLM's own client on both: random-mm with one image a request, then with 0-2
#
# Every load: NUM_PROMPTS (default 200) random prompts of 64 text tokens, 16 output tokens (ignore
# EOS), CONCURRENCY (16) in flight, WxH (640x480) JPEGs of random pixels as data: URLs. Writes
# OUT_DIR/<server>-r<round>-<load>.json, .log and .loadavg (the 1-minute load average as the load
# began), and each server's log; image_mix_table.py makes the tables. PORT (default 18411), SHARED (default ../shared: peers/).
set -euo pipefail
out=$(realpath -m "$1"); model=$(realpath "$2"); shift 2
here=$(cd "$(dirname "$0")/../.." && pwd)
shared=$(realpath "${SHARED:-$here/../shared}")
port=${PORT:-18411}; url=http://127.0.0.1:$port
prompts=${NUM_PROMPTS:-200}; concurrency=${CONCURRENCY:-16}; size=${WXH:-640x480}
mkdir -p "$out"
server=""
trap '[[ -z $server ]] || kill -TERM "$server" 2>/dev/null || true' EXIT  # a failed load leaves no server behind

up() {  # up NAME: serve MODEL with conveyor (NAME conveyor-tN: N tokenizer processes) or vLLM CPU
  case $1 in
    conveyor-t*) cd "$here"; exec python -m conveyor serve --model "$model" --port "$port" --tokenizer-workers "${1#conveyor-t}" ;;
    vllm) exec bash "$shared/peers/vllm-cpu.sh" serve "$model" "$port" ;;
  esac > "$out/$1-r$round.server.log" 2>&1 &
  server=$!  # the server itself: each branch runs in this background subshell and execs it
  for _ in $(seq 600); do
    curl -sf "$url/health" >/dev/null && return 0
    kill -0 "$server" 2>/dev/null || break  # it exited: no use waiting
    sleep 1
  done
  echo "$1 did not come up: $out/$1-r$round.server.log" >&2; return 1
}

down() { kill -TERM "$server"; wait "$server" 2>/dev/null || true; server=""; sleep 3; }

mix() {  # mix NAME SEED FRACTION REPEAT: one load of conveyor's client
  cut -d' ' -f1 /proc/loadavg > "$out/$1.loadavg"  # the machine is shared: what else ran, as the table shows
  (cd "$here" && python -m conveyor bench serve --base-url "$url" --dataset random --input-len 64 --output-len 16 \
    --num-prompts "$prompts" --max-concurrency "$concurrency" --image-fraction "$3" --image-repeat-fraction "$4" \
    --image-size "$size" --seed "$2" --disable-tqdm --result-json "$out/$1.json") > "$out/$1.log" 2>&1
}

vbench() {  # vbench NAME SEED ITEMS RANGE: one load of vLLM's client (random-mm, ITEMS +- RANGE x ITEMS images)
  local h=${size#*x} w=${size%x*}
  cut -d' ' -f1 /proc/loadavg > "$out/$1.loadavg"
  bash "$shared/peers/vllm-cpu.sh" bench --backend openai-chat --endpoint /v1/chat/completions --base-url "$url" \
    --model "$(curl -sf "$url/v1/models" | python -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')" \
    --tokenizer "$model" --dataset-name random-mm --random-input-len 64 --random-output-len 16 --random-range-ratio 0 \
    --random-mm-base-items-per-request "$3" --random-mm-num-mm-items-range-ratio "$4" \
    --random-mm-bucket-config "{($h, $w, 1): 1.0}" --num-prompts "$prompts" --max-concurrency "$concurrency" \
    --ignore-eos --temperature 0 --seed "$2" --disable-tqdm --save-result --result-dir "$out" --result-filename "$1.json" \
    > "$out/$1.log" 2>&1
}

for part in "$@"; do
  case $part in
    mix)
      round=1
      for name in conveyor-t1 conveyor-t2 conveyor-t2 conveyor-t1; do  # ABBA
        up "$name"
        mix "$name-r$round-text" $((round * 10 + 1)) 0 0
        mix "$name-r$round-half" $((round * 10 + 2)) 0.5 0
        mix "$name-r$round-images" $((round * 10 + 3)) 1 0
        mix "$name-r$round-half-repeated" $((round * 10 + 4)) 0.5 0.5
        down
        if [[ $name == conveyor-t2 ]]; then round=2; fi
      done ;;
    vllm)
      round=1
      for name in conveyor-t1 vllm vllm conveyor-t1; do  # ABBA; conveyor at its defaults has 1 tokenizer process
        up "$name"
        vbench "$name-r$round-mm1" 1 1 0
        vbench "$name-r$round-mm0to2" 2 1 1
        down
        if [[ $name == vllm ]]; then round=2; fi
      done ;;
    *) echo "unknown part: $part (mix, vllm)" >&2; exit 2 ;;
  esac
done
