#!/usr/bin/env bash
# Here, with the package index: FlashInfer for ops/gpu/attention_bench.py, cut to what its paged
# decode and prefill kernels compile from, into .gpu-pack/flashinfer/ (run after pack.sh, which
# leaves this folder alone). flashinfer-python's wheel (62 MB, 420 MB unpacked) would not fit the
# device tool's 64 MiB beside the working tree; cut (every .py file, the headers under data/:
# include, cutlass, cccl, spdlog, and data/csrc's batch decode/prefill sources) it is about 11 MB
# of xz, plus apache-tvm-ffi's wheel (3.3 MB), its one import-time need the GPU image lacks.
# No prebuilt kernels travel: flashinfer-jit-cache is not on the package index (flashinfer.ai's
# own, 1.5-2.1 GB for cu130), flashinfer-cubin holds no FA2/FA3 kernels; they compile there (JIT).
set -euo pipefail
cd "$(dirname "$0")/../.."
VERSION=${FLASHINFER_VERSION:-0.7.2.post1}
OUTDIR=.gpu-pack/flashinfer
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps -d "$work" "flashinfer-python==$VERSION"
rm -rf "$OUTDIR" && mkdir -p "$OUTDIR"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 -d "$OUTDIR" "apache-tvm-ffi>=0.1.11,<0.2"
(cd "$work" && python3 -m zipfile -e flashinfer_python-*.whl site)
(
  cd "$work/site"
  find flashinfer -path flashinfer/data -prune -o -type f -print
  find flashinfer/data/include flashinfer/data/cutlass/include flashinfer/data/cutlass/tools/util/include \
    flashinfer/data/spdlog flashinfer/data/cccl/cub flashinfer/data/cccl/libcudacxx flashinfer/data/cccl/thrust -type f
  ls flashinfer/data/*.py
  find flashinfer/data/csrc -maxdepth 1 -type f \( -name 'batch_decode*' -o -name 'batch_prefill*' -o -name 'single_prefill*' \
    -o -name '*.h' -o -name '*_config.jinja' \)
  find flashinfer_python-*.dist-info -type f ! -name RECORD
) > "$work/files"
tar cf - -C "$work/site" -T "$work/files" | xz -9 -T2 > "$OUTDIR/flashinfer-slim.tar.xz"
echo "$VERSION" > "$OUTDIR/VERSION"
du -sh "$OUTDIR"/*
echo 'then carry [".gpu-pack"] and run: bash ops/gpu/run.sh setup && bash ops/gpu/attention_run.sh'
