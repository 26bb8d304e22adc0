#!/usr/bin/env bash
# Packs into .gpu-pack/ (ignored by git, carried to the GPU machine with carry [".gpu-pack"]) what
# the GPU image lacks and cannot fetch there, having no network:
#   - wheels for CPython 3.12 manylinux x86_64, one version each: conveyor's own requirements that
#     the image does not hold (pyzmq, msgspec, gguf, xgrammar and its needs), and the test suite's
#     (openai, jsonschema and theirs; peft, the LoRA tests' reference), so that more than the GPU-marked tests can run there;
#   - the ShareGPT sample the races send (../shared does not travel);
#   - SmolLM2's tokenizer files (smollm2/): a real 49k-id BPE, which the runbook's checkpoint for
#     the sharegpt-500 workload takes (`conveyor.tiny.generate --tokenizer-from`), so that the
#     client picks the prompts vLLM's client picks (ops/gpu/workloads.py);
#   - with BASELINE=COMMIT, that commit's tree in baseline/ (git archive, about 1 MiB) and its
#     commit.txt: ops/gpu/ab_race.py races it against this checkout;
#   - commit.txt: the commit packed, which the runbook reports on the device (its copy of the tree
#     may have no .git, or an older commit's). Pack again after committing.
# Run it here, where PyPI answers: bash ops/gpu/pack.sh [NAME==VERSION ...] (extra wheels, e.g. a
# newer aiohttp if the setup step finds the image's too old). ops/gpu/README.md has the procedure.
set -euo pipefail
cd "$(dirname "$0")/../.."
PACK=.gpu-pack
export PIP_DISABLE_PIP_VERSION_CHECK=1

# The image's package list (/work/.library/device/KINDS.md, "Python packages already there") holds
# none of these; each is pinned to the version installed here, the one this machine's tests pass
# with (pydantic pins pydantic-core exactly, so the two must come as a pair).
RUNTIME="pyzmq msgspec gguf xgrammar apache-tvm-ffi pydantic pydantic-core annotated-types typing-inspection typing-extensions"
TESTS="openai jiter sniffio httpx2 httpcore2 truststore jsonschema jsonschema-specifications referencing rpds-py peft"
PLATFORMS="manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64"
# Tried only where none of the above matches: the image is Ubuntu 24.04's Python 3.12 (glibc 2.39).
MORE_PLATFORMS="manylinux_2_24_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux_2_35_x86_64"

mkdir -p "$PACK"
rm -f "$PACK"/*.whl  # one version of each: a second one stops the whole install there

download() {  # NAME[==VERSION]
  local platforms=$1 spec=$2 args=()
  for p in $platforms; do args+=(--platform "$p"); done
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${args[@]}" -d "$PACK" "$spec"
}

for name in $RUNTIME $TESTS; do
  version=$(python3 -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name" 2>/dev/null || true)
  spec=$name${version:+==$version}
  download "$PLATFORMS" "$spec" 2>/dev/null || download "$PLATFORMS $MORE_PLATFORMS" "$spec"
done
for spec in "$@"; do
  download "$PLATFORMS" "$spec" 2>/dev/null || download "$PLATFORMS $MORE_PLATFORMS" "$spec"
done

install -m 644 ../shared/workloads/sharegpt_sample.json "$PACK/"

cache=${CONVEYOR_CACHE_DIR:-$HOME/.cache/conveyor}
smollm2=$(ls -d "$cache"/gguf/SmolLM2-135M-Instruct.Q4_1-float32-*/ 2>/dev/null | head -n 1 || true)
if [ -z "$smollm2" ]; then  # fetch and convert the default model once (about 93 MB)
  smollm2=$(python3 -c "from conveyor.engine_config import resolve_model; print(resolve_model(None, 'cpu', 'auto')[0])")
fi
mkdir -p "$PACK/smollm2"
# config.json too (578 bytes): --tokenizer-from reads its bos/eos ids.
for f in tokenizer.json tokenizer_config.json chat_template.jinja generation_config.json config.json; do
  install -m 644 "$smollm2/$f" "$PACK/smollm2/"
done

rm -rf "$PACK/baseline"
if [ -n "${BASELINE:-}" ]; then
  mkdir -p "$PACK/baseline"
  git archive "$BASELINE" | tar -x -C "$PACK/baseline"
  git rev-parse "$BASELINE^{commit}" >"$PACK/baseline/commit.txt"
fi

echo "$(git rev-parse HEAD)$(git diff --quiet HEAD 2>/dev/null || echo ' (with uncommitted changes)')" >"$PACK/commit.txt"

echo "packed into $PACK/:"
ls -1 "$PACK"/*.whl | sed 's|.*/|  |'
bytes=$(du -sb "$PACK" | cut -f1)
echo "total $((bytes / 1024 / 1024)) MiB ($bytes bytes; the device takes 64 MiB with the working tree)"
echo 'carry: [".gpu-pack"]'
