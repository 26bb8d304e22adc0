#!/usr/bin/env bash
# Issue 50's multi-turn measurement: ShareGPT conversations replayed turn by turn (conveyor bench
# serve --dataset multi-turn), ACTIVE of them interleaved by CONCURRENCY clients, against a daemon
# without and with the KV host tier, in ABBA order, one fresh daemon per run (the prefix cache
# starts empty each time).
#
#   bash ops/bench/kv_tiers_race.sh OUT_DIR MODEL -- SERVE_OPTIONS...
#   e.g. bash ops/bench/kv_tiers_race.sh /tmp/tiers tiny -- --device cpu --num-kv-blocks 256
#        ACTIVE=60 CONCURRENCY=8 bash ops/bench/kv_tiers_race.sh /tmp/tiers-h100 /tmp/l3e -- --device emulated --num-kv-blocks 256
#
# Writes OUT_DIR/{none,host}-{1,2}.json (bench serve's result), its log, each daemon's log and its
# /metrics at the end.
# Environment: TIER (the host tier's GiB, default 2), CONCURRENCY (clients: turns in flight at
# most, default 28), ACTIVE (conversations interleaved, the working set: default CONCURRENCY,
# each client a closed loop; ~60 is ~5x a 256-block pool of 16 tokens at ShareGPT's mean
# context), THINK_TIME (seconds between a conversation's turns, default 0), NUM_PROMPTS
# (conversations, 96), MAX_OUTPUT (32), CONTEXT_LEN (tokens of each conversation's own opening,
# default 0), MAX_CONTEXT (a turn's prompt + output at most, default 2000), PORT (8061), SHAREGPT.
set -euo pipefail
out=$1; model=$2; shift 2
[[ ${1:-} == -- ]] && shift
here=$(cd "$(dirname "$0")/../.." && pwd)
port=${PORT:-8061}; url=http://127.0.0.1:$port
concurrency=${CONCURRENCY:-28}
sharegpt=${SHAREGPT:-$here/../shared/workloads/sharegpt_sample.json}
mkdir -p "$out"
run() {  # run NAME ROUND SERVE_EXTRA...
  local name=$1 round=$2; shift 2
  python -m conveyor serve --model "$model" --port "$port" "$@" > "$out/$name-$round.daemon.log" 2>&1 &
  local daemon=$!
  for _ in $(seq 180); do curl -sf "$url/health" >/dev/null && break; sleep 1; done
  python -m conveyor bench serve --base-url "$url" --dataset multi-turn --dataset-path "$sharegpt" \
    --num-prompts "${NUM_PROMPTS:-96}" --multi-turn-concurrency "$concurrency" --multi-turn-active "${ACTIVE:-$concurrency}" \
    --multi-turn-think-time "${THINK_TIME:-0}" --multi-turn-context-len "${CONTEXT_LEN:-0}" --multi-turn-max-context "${MAX_CONTEXT:-2000}" \
    --multi-turn-max-output "${MAX_OUTPUT:-32}" --disable-tqdm --result-json "$out/$name-$round.json" > "$out/$name-$round.log" 2>&1
  curl -sf "$url/metrics" > "$out/$name-$round.metrics" || true  # the KV tier's counters, for the why
  kill -TERM $daemon; wait $daemon 2>/dev/null || true
  echo "$name round $round: $(grep -m1 -i 'ttft' "$out/$name-$round.log" || true)"
}
run none 1 "$@"
run host 1 "$@" --kv-offloading-size "${TIER:-2}"
run host 2 "$@" --kv-offloading-size "${TIER:-2}"
run none 2 "$@"
