"""ensure_checkpoint: a GGUF file converted once into a checkpoint directory in the cache.

By default the quantized tensors stay packed (their blocks, read by gpu/quant/formats/gguf.py,
config.json saying `quant_method: gguf`); `packed=False` dequantizes every tensor into `dtype`,
the float reference the tests and benchmarks compare with. The directory is
`<cache>/gguf/<file stem>-<dtype>[-packed]-<key>`, the key a hash of the file's path,
size and modification time and of CONVERTER_VERSION: a changed file or converter gets a new
directory, an unchanged one is read as it is, with no GGUF parsing. The directory is built beside
its final place and renamed into it, so a reader sees no checkpoint or a whole one, whichever of
two processes converting at once wins.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from conveyor.config.cached_dir import build_cached
from conveyor.config.env import cache_dir
from conveyor.config.errors import ConfigError

# Bump when the conversion's output changes: older directories are then simply not used.
CONVERTER_VERSION = "v2"

log = logging.getLogger(__name__)


def ensure_checkpoint(gguf_file: str | Path, dtype: str, packed: bool = True) -> Path:
    """The checkpoint directory for `gguf_file`, its float weights in `dtype` ("float32",
    "bfloat16", ...) and its quantized ones packed, or dequantized too (`packed=False`)."""
    source = Path(gguf_file).expanduser()
    if not source.is_file():
        raise ConfigError(f"GGUF file {str(gguf_file)!r} does not exist")
    source = source.resolve()
    stat = source.stat()
    form = f"{dtype}-packed" if packed else dtype
    key = hashlib.sha256(f"{source}\0{stat.st_size}\0{stat.st_mtime_ns}\0{form}\0{CONVERTER_VERSION}".encode()).hexdigest()
    target = cache_dir() / "gguf" / f"{source.stem}-{form}-{key[:12]}"
    return build_cached(target, lambda scratch: write_checkpoint(source, scratch, dtype, packed))


def write_checkpoint(source: Path, out_dir: Path, dtype: str, packed: bool = True) -> None:
    """config.json, generation_config.json, model.safetensors and the tokenizer files, in `out_dir`."""
    from gguf import GGUFReader
    from safetensors.torch import save_file

    from conveyor.gpu.loading.gguf.config import generation_config, hf_config
    from conveyor.gpu.loading.gguf.tokenizer import write_tokenizer
    from conveyor.gpu.loading.gguf.weights import read_weights

    try:
        reader = GGUFReader(source)
    except (ValueError, OSError) as e:  # not a GGUF file, or a truncated one
        raise ConfigError(f"cannot read GGUF file {str(source)!r}: {short_of(source) or e}") from None
    config = hf_config(reader, dtype)  # first: an architecture we cannot serve is refused before any work
    log.info(
        "converting %s (%s) to a %s checkpoint in %s, once",
        source.name,
        config["architectures"][0],
        form_name(dtype, packed),
        out_dir.parent,
    )
    tensors = read_weights(reader, config, packed)
    if any(name.endswith(".gguf_blocks") for name in tensors):
        config["quantization_config"] = {"quant_method": "gguf"}
    write_tokenizer(source, out_dir)
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    for name, obj in (("config.json", config), ("generation_config.json", generation_config(config, reader))):
        (out_dir / name).write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


def form_name(dtype: str, packed: bool) -> str:
    return f"packed ({dtype} activations)" if packed else dtype


def short_of(source: Path) -> str | None:
    """Where a GGUF file whose header reads ends too soon: the first tensor whose data runs past
    the end of the file, named; None if the header itself is unreadable or nothing runs past."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

    ends: list[tuple[str, int]] = []

    class TensorInfos(GGUFReader):  # the header's tensor table, without mapping the data
        def _build_tensors(self, start_offs, fields) -> None:
            for field in fields:
                _, name, _, dims, raw_type, offset = field.parts
                block, size = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_type[0]))]
                count = 1
                for d in dims.tolist():
                    count *= int(d)
                ends.append((bytes(name).decode(errors="replace"), int(start_offs + offset[0]) + count * size // block))

    try:
        TensorInfos(source)
    except (ValueError, OSError, KeyError):
        return None
    size = source.stat().st_size
    short = next(((name, end) for name, end in ends if end > size), None)
    if short is None:
        return None
    return f"truncated: tensor {short[0]!r} ends at byte {short[1]}, the file has {size}"
