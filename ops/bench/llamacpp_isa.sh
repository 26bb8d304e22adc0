#!/usr/bin/env bash
# llama.cpp's server built for one instruction-set variant, to race conveyor's kernels built for the
# same one (issue 52; CONVEYOR_CPU_ISA, gpu/backends/cpu/kernels/isa.py names the variants):
#   ops/bench/llamacpp_isa.sh build VARIANT                    build llama-server for VARIANT (once)
#   ops/bench/llamacpp_isa.sh serve VARIANT FILE.gguf [PORT] [SLOTS]   as ../shared/peers/llamacpp.sh serves
# VARIANT: native (GGML_NATIVE, as the shared script builds it), x86-64-v3 (AVX2, FMA, F16C, BMI2),
# x86-64-v3-vnni (+ AVX-VNNI), x86-64-v4 (+ AVX-512 F/CD/VL/DQ/BW), x86-64-v4-vnni-bf16 (+ AVX512-VNNI
# and -BF16): ggml's own switches, GGML_NATIVE off, so each build uses those instructions and no
# others, as conveyor's variant of the same name does. The sources are the llama.cpp vendored in
# the llama-cpp-python sdist the shared script uses; builds go to $LLAMACPP_DIR/build-VARIANT
# (about 10 minutes each on 2 cores).
set -euo pipefail
dir=${LLAMACPP_DIR:-$HOME/.cache/conveyor-peers/llamacpp-server}
version=0.3.36
src=$dir/llama_cpp_python-$version/vendor/llama.cpp
usage="usage: llamacpp_isa.sh build VARIANT | serve VARIANT FILE.gguf [PORT] [SLOTS]"
cmd=${1:?$usage}; variant=${2:?$usage}; shift 2
v3=(-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON)
case $variant in
  native) flags=(-DGGML_NATIVE=ON) ;;
  x86-64-v3) flags=(-DGGML_NATIVE=OFF "${v3[@]}") ;;
  x86-64-v3-vnni) flags=(-DGGML_NATIVE=OFF "${v3[@]}" -DGGML_AVX_VNNI=ON) ;;
  x86-64-v4) flags=(-DGGML_NATIVE=OFF "${v3[@]}" -DGGML_AVX512=ON) ;;
  x86-64-v4-vnni-bf16) flags=(-DGGML_NATIVE=OFF "${v3[@]}" -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON) ;;
  *) echo "unknown variant $variant (native, x86-64-v3, x86-64-v3-vnni, x86-64-v4, x86-64-v4-vnni-bf16)" >&2; exit 2 ;;
esac
build=$src/build-$variant
bin=$build/bin/llama-server
if [[ ! -x $bin ]]; then
  command -v cmake >/dev/null || { apt-get update -qq && apt-get install -y -qq cmake >/dev/null; }
  if [[ ! -d $src ]]; then
    mkdir -p "$dir"
    pip download -q --no-binary :all: --no-deps "llama-cpp-python==$version" -d "$dir"
    tar xzf "$dir/llama_cpp_python-$version.tar.gz" -C "$dir"
  fi
  cmake -S "$src" -B "$build" "${flags[@]}" -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF >/dev/null
  cmake --build "$build" --target llama-server -j"$(nproc)" >/dev/null
fi
case $cmd in
  build) echo "$bin" ;;
  serve)
    file=${1:?$usage}
    slots=${3:-16}
    exec "$bin" -m "$file" -t "$(nproc)" -np "$slots" -c $((slots * 2048)) --host 127.0.0.1 --port "${2:-8200}" ;;
  *) echo "$usage" >&2; exit 2 ;;
esac
