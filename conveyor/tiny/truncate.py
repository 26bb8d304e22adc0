"""A checkpoint cut to its first N decoder layers: the draft of self-speculation
(`--speculative-config '{"method": "draft_model", "model": DST, ...}'`), derived from the
target's own weights, so it shares its tokenizer, embeddings and head.

    python -m conveyor.tiny.truncate SRC DST --layers N

Every file is copied; the safetensors keep every tensor but those of layers N and up
(`model.layers.I.*`), stored as they were (a packed GGUF conversion stays packed); config.json
says `num_hidden_layers: N`. Deterministic: the same SRC and N give the same files.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def truncate(src: Path, dst: Path, num_layers: int) -> Path:
    """Write SRC cut to its first `num_layers` layers into DST (created); DST."""
    config = json.loads((src / "config.json").read_text())
    if not 1 <= num_layers <= config["num_hidden_layers"]:
        raise ValueError(f"--layers {num_layers}: the checkpoint has {config['num_hidden_layers']} layers")
    dst.mkdir(parents=True, exist_ok=True)
    for path in sorted(src.iterdir()):
        if path.is_file() and path.suffix != ".safetensors" and path.name != "config.json":
            shutil.copy2(path, dst / path.name)
    for path in sorted(src.glob("*.safetensors")):
        kept = {}
        with safe_open(str(path), "pt") as f:
            metadata = f.metadata()
            for name in f.keys():
                layer = _LAYER.match(name)
                if layer is None or int(layer.group(1)) < num_layers:
                    kept[name] = f.get_tensor(name)
        save_file(kept, str(dst / path.name), metadata=metadata)
    index = src / "model.safetensors.index.json"
    if index.exists():  # the index names only tensors still there
        data = json.loads(index.read_text())
        data["weight_map"] = {
            k: v for k, v in data["weight_map"].items() if not ((m := _LAYER.match(k)) and int(m.group(1)) >= num_layers)
        }
        (dst / index.name).write_text(json.dumps(data, indent=2))
    (dst / "config.json").write_text(json.dumps({**config, "num_hidden_layers": num_layers}, indent=2))
    return dst


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m conveyor.tiny.truncate", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("src", type=Path)
    parser.add_argument("dst", type=Path)
    parser.add_argument("--layers", type=int, required=True, help="decoder layers to keep, from the first")
    args = parser.parse_args()
    truncate(args.src, args.dst, args.layers)


if __name__ == "__main__":
    main()
