#!/usr/bin/env bash
# There (the GPU machine), after `bash ops/gpu/run.sh setup` in the same call (conveyor's wheels
# in /tmp/gpu-site): FlashInfer from .gpu-pack/flashinfer/ (flashinfer_pack.sh) when packed,
# then ops/gpu/attention_bench.py --json, its output in $OUT/attention.log. FlashInfer compiles
# its kernels at their first call (sm_90a only; cached under /tmp/fi-ws); the cache goes back as
# $OUT/flashinfer-jit-cache.tar.xz when under 16 MiB, and a later call that carries it as
# .gpu-pack/flashinfer/flashinfer-jit-cache.tar.xz unpacks it first (same paths, same mtimes:
# whether FlashInfer's ninja then skips the build shows in the bench's first_call_s).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp}
export PYTHONPATH=/tmp/gpu-site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
pack=.gpu-pack/flashinfer
if [ -f "$pack/flashinfer-slim.tar.xz" ]; then
  mkdir -p /tmp/fi-site /tmp/fi-ws
  tar xJf "$pack/flashinfer-slim.tar.xz" -C /tmp/fi-site
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fi-site "$pack"/apache_tvm_ffi-*.whl
  [ -f "$pack/flashinfer-jit-cache.tar.xz" ] && tar xJf "$pack/flashinfer-jit-cache.tar.xz" -C /tmp/fi-ws
  export PYTHONPATH=/tmp/fi-site:$PYTHONPATH FLASHINFER_WORKSPACE_BASE=/tmp/fi-ws FLASHINFER_CUDA_ARCH_LIST=9.0a
  nvcc=$(command -v nvcc || true)  # FlashInfer's JIT wants CUDA_HOME/bin/nvcc; unset, it tries /usr/local/cuda
  [ -z "${CUDA_HOME:-}" ] && [ -n "$nvcc" ] && export CUDA_HOME=$(dirname "$(dirname "$nvcc")")
fi
python3 ops/gpu/attention_bench.py --json "$@" 2>&1 | tee "$out/attention.log"
status=${PIPESTATUS[0]}
if [ -d /tmp/fi-ws/.cache/flashinfer ]; then
  tar cf - -C /tmp/fi-ws .cache/flashinfer | xz -T0 > "$out/flashinfer-jit-cache.tar.xz"
  du -sh /tmp/fi-ws/.cache/flashinfer "$out/flashinfer-jit-cache.tar.xz"
  [ "$(stat -c %s "$out/flashinfer-jit-cache.tar.xz")" -le $((16 * 2**20)) ] || rm -f "$out/flashinfer-jit-cache.tar.xz"
fi
exit "$status"
