#!/usr/bin/env bash
# The GPU runbook's entry point: bash ops/gpu/run.sh STEP [--emulated] [runbook options]
# (steps: setup tests kernels checkpoint race-k1 race-k8 race-defaults report all; ops/gpu/runbook.py --help lists the options).
# On the GPU machine, in the repository root, with carry [".gpu-pack"] (made here by ops/gpu/pack.sh):
# installs the packed wheels into /tmp/gpu-site (the image has no network and lacks them) and
# conveyor itself, editable and offline (a path entry for the checkout: its `conveyor` console
# script and metadata come with it), then runs the step. With --emulated it
# installs nothing: this machine has everything already.
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ $# -lt 1 ]; then
  echo "usage: bash ops/gpu/run.sh STEP [--emulated] [options of ops/gpu/runbook.py]" >&2
  exit 2
fi
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
site=()
if [[ " $* " != *" --emulated "* ]]; then
  if ! ls .gpu-pack/*.whl >/dev/null 2>&1; then
    echo "no wheels in .gpu-pack/: run bash ops/gpu/pack.sh on the machine with network, then carry [\".gpu-pack\"]" >&2
    exit 2
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/gpu-site .gpu-pack/*.whl
  export PYTHONPATH=/tmp/gpu-site${PYTHONPATH:+:$PYTHONPATH}
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e .
  site=(--site /tmp/gpu-site)
fi
exec python3 ops/gpu/runbook.py "$@" "${site[@]}"
