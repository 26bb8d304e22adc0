#!/usr/bin/env bash
# One conveyor configuration on an emulated GPU, measured under both clients and every load of
# issue 27's measurement (docs/benchmarks.md): ShareGPT 500 all at once, then Poisson arrivals at
# 10, 20 and 40 req/s, each run inside `conveyor bench cpu` (CPU per stage per 1,000 output
# tokens, the client's, the bubble), first with conveyor's client, then with vLLM's
# (../shared/peers/vllm-cpu.sh bench). One fresh daemon per configuration, warmed by 50 requests.
#
#   bash ops/bench/emulated_race.sh OUT_DIR NAME MODEL_DIR -- SERVE_OPTIONS...
#   e.g. bash ops/bench/emulated_race.sh /tmp/race k8 /tmp/llama3-8b -- --num-scheduler-steps 8
#
# Writes OUT_DIR/NAME/{conveyor,vllm}-{inf,10,20,40}.{serve,cpu}.json and the daemon's log;
# ops/bench/race_table.py turns a directory of them into the tables. Environment: RATES (default
# "inf 10 20 40"), CLIENTS (default "conveyor vllm"), NUM_PROMPTS (500), PORT (8055), SHAREGPT,
# VLLM_CPU (the peer script).
set -euo pipefail
out=$1; name=$2; model=$3; shift 3
[[ ${1:-} == -- ]] && shift
here=$(cd "$(dirname "$0")/../.." && pwd)
port=${PORT:-8055}; url=http://127.0.0.1:$port; n=${NUM_PROMPTS:-500}
sharegpt=${SHAREGPT:-$here/../shared/workloads/sharegpt_sample.json}
vllm=${VLLM_CPU:-$here/../shared/peers/vllm-cpu.sh}
dir=$out/$name; mkdir -p "$dir"
python -m conveyor serve --model "$model" --device emulated --port "$port" "$@" > "$dir/daemon.log" 2>&1 &
daemon=$!
trap 'kill -TERM $daemon 2>/dev/null; wait $daemon 2>/dev/null || true' EXIT
for _ in $(seq 120); do curl -sf "$url/health" >/dev/null && break; sleep 1; done
served=$(curl -s "$url/v1/models" | python -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')
python -m conveyor bench serve --base-url "$url" --tokenizer "$model" --request-rate inf --ignore-eos --seed 1 \
  --disable-tqdm --dataset sharegpt --dataset-path "$sharegpt" --num-prompts 50 > /dev/null
for client in ${CLIENTS:-conveyor vllm}; do
  for rate in ${RATES:-inf 10 20 40}; do
    run=$dir/$client-$rate
    if [[ $client == conveyor ]]; then
      cmd=(python -m conveyor bench serve --base-url "$url" --tokenizer "$model" --request-rate "$rate" --ignore-eos
           --seed 0 --disable-tqdm --dataset sharegpt --dataset-path "$sharegpt" --num-prompts "$n" --result-json "$run.serve.json")
    else
      cmd=(bash "$vllm" bench --backend vllm --base-url "$url" --model "$served" --tokenizer "$model"
           --dataset-name sharegpt --dataset-path "$sharegpt" --num-prompts "$n" --request-rate "$rate" --ignore-eos
           --seed 0 --disable-tqdm --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99
           --save-result --result-dir "$dir" --result-filename "$client-$rate.serve.json")
    fi
    python -m conveyor bench cpu --base-url "$url" --json "$run.cpu.json" -- "${cmd[@]}" > "$run.log" 2>&1
    echo "$name $client rate=$rate: $(grep -m1 'output tokens in' "$run.log")"
  done
done
