#!/usr/bin/env bash
# The container, really run: build the image from docker/Dockerfile, start it, stream a chat
# completion, have a Prometheus container scrape /metrics, then stop it and check the drain.
#   docker/smoke.sh                    (as root, from anywhere; podman, no registry needed)
# Images come from a Debian base made with debootstrap from the host's apt mirror
# (docker/debian/base.sh), built once and reused, like the layer cache. Every container runs
# on the host network, on free ports, and is removed at exit. Each phase prints its time; the
# first failure prints one line starting "smoke: FAIL" and exits 1.
#
# Environment:
#   CONVEYOR_SMOKE_BASE     base image (default conveyor-base:bookworm, built when missing)
#   CONVEYOR_SMOKE_WHEELS   a folder of wheels holding torch (default: $PIP_FIND_LINKS when it
#                           is a folder); mounted into the build, torch's dependencies then
#                           come from $PIP_INDEX_URL or PyPI. Unset: download.pytorch.org.
#   CONVEYOR_SMOKE_KEEP=1   keep the containers (for a look at `podman logs`).
#   CONVEYOR_SMOKE_PODMAN   the podman command (default: podman --runtime runc
#                           --cgroup-manager cgroupfs, for hosts without systemd or crun).
# In a sandbox that refuses podman's default rlimits, put `default_ulimits = []` under
# [containers] in /etc/containers/containers.conf.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
base=${CONVEYOR_SMOKE_BASE:-localhost/conveyor-base:bookworm}
image=localhost/conveyor:smoke
prometheus_image=localhost/conveyor-prometheus:smoke
read -r -a podman <<<"${CONVEYOR_SMOKE_PODMAN:-podman --runtime runc --cgroup-manager cgroupfs}"
run_id=smoke-$$
work=$(mktemp -d /tmp/conveyor-smoke.XXXXXX)

started=$(date +%s.%N)
phase_started=$started

elapsed() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$1" "$(date +%s.%N)"; }
phase() { phase_started=$(date +%s.%N); echo "smoke: [$(elapsed "$started")s] $*"; }
done_phase() { echo "smoke:   ok in $(elapsed "$phase_started")s${1:+: $1}"; }
fail() {
    echo "smoke: FAIL after $(elapsed "$started")s: $*" >&2
    exit 1
}

cleanup() {
    local status=$?
    if [[ ${CONVEYOR_SMOKE_KEEP:-0} == 1 ]]; then
        echo "smoke: kept the containers conveyor-$run_id, prometheus-$run_id and $work" >&2
    else
        "${podman[@]}" rm --ignore -f -v -t 0 "conveyor-$run_id" "prometheus-$run_id" >/dev/null 2>&1 || true
        rm -rf "$work"
    fi
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# Print the last lines of a container's log, then fail with $2.
fail_with_logs() {
    echo "smoke: --- last lines of $1 ---" >&2
    "${podman[@]}" logs --tail 40 "$1" >&2 2>&1 || true
    fail "$2"
}

running() { [[ $("${podman[@]}" inspect -f '{{.State.Running}}' "$1" 2>/dev/null) == true ]]; }

# check_stream FILE: an SSE body with content, no error chunk, a last choice that finished
# ("stop" or "length"), then `data: [DONE]` (chat and text completions alike). Prints a summary.
check_stream() {
    python3 - "$1" <<'EOF'
import json, sys

lines = [line[len("data: "):] for line in open(sys.argv[1]).read().splitlines() if line.startswith("data: ")]
if not lines or lines[-1] != "[DONE]":
    sys.exit(f"it does not end with 'data: [DONE]' ({len(lines)} data lines)")
chunks = [json.loads(line) for line in lines[:-1]]
errors = [c["error"] for c in chunks if "error" in c]
if errors:
    sys.exit(f"an error chunk after {len(chunks) - 1} chunks: {errors[0]}")
choices = [c["choices"][0] for c in chunks if c.get("choices")]
texts = [choice.get("text") or choice.get("delta", {}).get("content") or "" for choice in choices]
if not any(texts):
    sys.exit(f"no content in {len(chunks)} chunks")
if choices[-1].get("finish_reason") not in ("stop", "length"):
    sys.exit(f"the last chunk's finish_reason is {choices[-1].get('finish_reason')!r}")
print(f"{sum(map(bool, texts))} content chunks, {sum(map(len, texts))} characters, then [DONE]")
EOF
}

[[ $(id -u) == 0 ]] || fail "run as root (podman builds and runs here as root)"
command -v "${podman[0]}" >/dev/null || fail "${podman[0]} not found (apt-get install podman runc)"

# --- images -------------------------------------------------------------------------------------
phase "base image $base"
if "${podman[@]}" image exists "$base"; then
    done_phase "present"
else
    "$repo/docker/debian/base.sh" "$base" >"$work/base.log" 2>&1 \
        || { tail -n 20 "$work/base.log" >&2; fail "the base image did not build (docker/debian/base.sh)"; }
    done_phase "built"
fi

build_args=(--build-arg "BASE=$base")
build_volumes=()
wheels=${CONVEYOR_SMOKE_WHEELS:-${PIP_FIND_LINKS:-}}
if [[ -n $wheels && -d $wheels ]]; then
    build_volumes=(--volume "$wheels:/wheels:ro")
    build_args+=(--build-arg TORCH_FIND_LINKS=/wheels --build-arg "TORCH_INDEX=${PIP_INDEX_URL:-https://pypi.org/simple}")
fi

phase "build $image from docker/Dockerfile${wheels:+ (torch wheels from $wheels)}"
"${podman[@]}" build --format docker --network host --layers \
    -f "$repo/docker/Dockerfile" --ignorefile "$repo/docker/Dockerfile.dockerignore" \
    "${build_volumes[@]}" "${build_args[@]}" -t "$image" "$repo" >"$work/build.log" 2>&1 \
    || { tail -n 30 "$work/build.log" >&2; fail "docker/Dockerfile did not build (log above)"; }
done_phase

phase "build $prometheus_image from docker/debian/prometheus.Dockerfile"
"${podman[@]}" build --format docker --network host --layers \
    -f "$repo/docker/debian/prometheus.Dockerfile" --build-arg "BASE=$base" \
    -t "$prometheus_image" "$repo/docker/debian" >"$work/prometheus-build.log" 2>&1 \
    || { tail -n 30 "$work/prometheus-build.log" >&2; fail "the Prometheus image did not build (log above)"; }
done_phase

# --- conveyor -----------------------------------------------------------------------------------
port=$(free_port)
conveyor_url=http://127.0.0.1:$port
# The drain phase streams 400 tokens: long enough to be in flight when SIGTERM lands, and
# inside this drain even when other work holds the cores (generation then slows twentyfold:
# 160 tokens took 1 s alone, 27 s beside a busy daemon). compose.yaml's 30 s drain is checked
# against its stop_grace_period in tests/ops/test_container.py.
drain_timeout=120
phase "start conveyor on $conveyor_url (--drain-timeout $drain_timeout)"
# The image's HEALTHCHECK probes port 8000 through systemd timers; this one polls instead.
"${podman[@]}" run -d --name "conveyor-$run_id" --network host --no-healthcheck \
    "$image" --port "$port" --drain-timeout "$drain_timeout" >/dev/null \
    || fail "podman run $image failed"
done_phase

phase "wait for /health 200 (first start: the model is converted, the CPU kernels compiled)"
for ((i = 0; ; i++)); do
    code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "$conveyor_url/health" || true)
    [[ $code == 200 ]] && break
    running "conveyor-$run_id" || fail_with_logs "conveyor-$run_id" "the conveyor container exited before /health was 200"
    ((i < 300)) || fail_with_logs "conveyor-$run_id" "/health not 200 after 300 s (last: $code)"
    sleep 1
done
# The image's HEALTHCHECK command, run inside the container against this port.
mapfile -d '' healthcheck < <("${podman[@]}" image inspect -f '{{json .Config.Healthcheck.Test}}' "$image" \
    | python3 -c 'import json, sys; test = json.load(sys.stdin); assert test[0] == "CMD"
print(*(a.replace(":8000/", f":{sys.argv[1]}/") for a in test[1:]), sep="\0", end="\0")' "$port")
((${#healthcheck[@]})) || fail "the image has no HEALTHCHECK CMD"
"${podman[@]}" exec "conveyor-$run_id" "${healthcheck[@]}" >/dev/null 2>&1 \
    || fail "the image's HEALTHCHECK fails while /health is 200: ${healthcheck[*]}"
done_phase "the image's HEALTHCHECK passes too"

phase "stream a chat completion"
curl -sN --fail-with-body --max-time 120 "$conveyor_url/v1/chat/completions" \
    -H 'Content-Type: application/json' \
    -d '{"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16, "temperature": 0, "stream": true}' \
    >"$work/stream.txt" || fail_with_logs "conveyor-$run_id" "the streaming chat completion failed: $(head -c 300 "$work/stream.txt")"
summary=$(check_stream "$work/stream.txt" 2>&1) || fail "chat stream: $summary"
done_phase "$summary"

# --- prometheus ---------------------------------------------------------------------------------
prometheus_port=$(free_port)
prometheus_url=http://127.0.0.1:$prometheus_port
phase "start Prometheus on $prometheus_url, scraping $conveyor_url/metrics"
mkdir -p "$work/prometheus"
cp "$repo/ops/prometheus/alerts.yml" "$work/prometheus/"
# compose.yaml reaches conveyor by its service name; here both share the host network.
sed "s/\"conveyor:8000\"/\"127.0.0.1:$port\"/" "$repo/ops/prometheus/prometheus.yml" >"$work/prometheus/prometheus.yml"
grep -q "127.0.0.1:$port" "$work/prometheus/prometheus.yml" \
    || fail "ops/prometheus/prometheus.yml no longer names the target conveyor:8000"
chmod -R a+rX "$work"
"${podman[@]}" run -d --name "prometheus-$run_id" --network host \
    -v "$work/prometheus:/etc/prometheus:ro" "$prometheus_image" \
    --config.file=/etc/prometheus/prometheus.yml --storage.tsdb.path=/tmp/prometheus \
    --web.listen-address="127.0.0.1:$prometheus_port" >/dev/null \
    || fail "podman run $prometheus_image failed"
done_phase

# query EXPR: the value of the first sample, or nothing.
query() {
    curl -s --max-time 5 "$prometheus_url/api/v1/query" --data-urlencode "query=$1" \
        | python3 -c 'import json, sys; r = json.load(sys.stdin)["data"]["result"]; print(r[0]["value"][1] if r else "")' \
        2>/dev/null || true
}

phase "wait for Prometheus to scrape conveyor (target up, conveyor_ metrics stored)"
for ((i = 0; ; i++)); do
    up=$(query 'up{job="conveyor"}')
    tokens=$(query 'conveyor_generation_tokens_total{job="conveyor"}')
    [[ $up == 1 && -n $tokens && $tokens != 0 ]] && break
    running "prometheus-$run_id" || fail_with_logs "prometheus-$run_id" "the Prometheus container exited"
    if ((i >= 60)); then
        curl -s --max-time 5 "$prometheus_url/api/v1/targets" >&2 || true
        fail "Prometheus has no healthy conveyor target after 60 s (up=${up:-none}, generation tokens=${tokens:-none})"
    fi
    sleep 1
done
series=$(query 'count({__name__=~"conveyor_.+", job="conveyor"})')
# The alert rules of ops/prometheus/alerts.yml: loaded, and none failing to evaluate.
rules=$(curl -s --max-time 5 "$prometheus_url/api/v1/rules" | python3 -c '
import json, sys
rules = [r for g in json.load(sys.stdin)["data"]["groups"] for r in g["rules"]]
print(len(rules), *[r["name"] for r in rules if r.get("health") == "err"])' 2>/dev/null || true)
[[ -n $rules && $rules != 0 ]] || fail_with_logs "prometheus-$run_id" "Prometheus loaded no alert rules from ops/prometheus/alerts.yml"
[[ $rules != *' '* ]] || fail "alert rules that fail to evaluate: ${rules#* }"
done_phase "up{job=\"conveyor\"} = 1, $series conveyor_ series, conveyor_generation_tokens_total = $tokens, $rules alert rules"

# --- drain --------------------------------------------------------------------------------------
phase "SIGTERM during a stream: /health 503, new requests 503, the stream finishes, exit 0"
curl -sN --max-time "$drain_timeout" "$conveyor_url/v1/completions" -H 'Content-Type: application/json' \
    -d '{"prompt": "The river", "max_tokens": 400, "temperature": 0, "ignore_eos": true, "stream": true}' \
    >"$work/drain.txt" &
client=$!
for ((i = 0; ; i++)); do  # the first chunk: the request is in flight
    grep -q '^data: ' "$work/drain.txt" 2>/dev/null && break
    ((i < 300)) || fail "no chunk of the long stream after 30 s"
    sleep 0.1
done
"${podman[@]}" kill --signal TERM "conveyor-$run_id" >/dev/null || fail "podman kill --signal TERM failed"
signalled=$(date +%s.%N)
for ((i = 0; ; i++)); do
    health=$(curl -s --max-time 1 -w ' %{http_code}' "$conveyor_url/health" || true)
    [[ $health == *draining*' 503' ]] && break
    ((i < 50)) || fail_with_logs "conveyor-$run_id" "/health is not 503 draining 5 s after SIGTERM (last: $health)"
    sleep 0.1
done
! grep -q '^data: \[DONE\]' "$work/drain.txt" \
    || fail "the stream was over before the drain began (give it more tokens)"
refused=$(curl -s -o /dev/null -w '%{http_code}' --max-time 5 "$conveyor_url/v1/completions" \
    -H 'Content-Type: application/json' -d '{"prompt": "late", "max_tokens": 1}' || true)
[[ $refused == 503 ]] || fail "a new request during the drain got $refused, not 503"
wait "$client" || fail "the stream in flight broke off during the drain"
finished=$(elapsed "$signalled")
summary=$(check_stream "$work/drain.txt" 2>&1) || fail "the stream in flight at SIGTERM: $summary"
# Drained once nothing is in flight, then up to 5 s for the stages to stop (stages/launcher.py).
status=$(timeout $((drain_timeout + 10)) "${podman[@]}" wait "conveyor-$run_id" || true)
took=$(elapsed "$signalled")
[[ $status == 0 ]] || fail_with_logs "conveyor-$run_id" "conveyor exited ${status:-not at all} after SIGTERM, not 0"
python3 -c "import sys; sys.exit(float(sys.argv[1]) - float(sys.argv[2]) > 10)" "$took" "$finished" \
    || fail "conveyor exited ${took}s after SIGTERM, more than 10 s after its last stream ended"
done_phase "the stream in flight finished ${finished}s after SIGTERM ($summary), exit 0 after ${took}s"

echo "smoke: ok in $(elapsed "$started")s"
