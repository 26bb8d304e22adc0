"""Images per second through the tokenizer stage's preparation, with 1..N tokenizer processes (issue 51).

    python ops/bench/image_prep.py --workers 1 2 --requests 400 [--crop 336] [--width 640 --height 480]

Each process builds the stage's PromptEncoder for a LLaVA-1.5 checkpoint (the tiny one from
conveyor/tiny/vision.py, its preprocessor and tower sized to --crop pixels: 336 is LLaVA-1.5's)
and runs `prepare` on its share of chat requests, each one JPEG of --width x --height pixels and a
line of text: decode, resize, crop, normalize, hash, template, placeholder expansion, as a
tokenizer process does per request (the ingress's and the sockets' work is not in it). Prints the
wall time and images per second for each process count, and the CPU model.
"""

from __future__ import annotations

import argparse
import io
import multiprocessing
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image


def checkpoint(root: Path, crop: int) -> Path:
    from conveyor.tiny.vision import make_llava

    return make_llava(root / "llava", image_size=crop)


def jpeg(width: int, height: int) -> bytes:
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x * 255 / width, y * 255 / height, (x + y) % 256], axis=-1) + rng.normal(0, 20, (height, width, 3))
    out = io.BytesIO()
    Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8)).save(out, format="JPEG", quality=90)
    return out.getvalue()


def _worker(path: str, data: bytes, count: int, start, done) -> None:
    from conveyor.engine_config import build_engine_config
    from conveyor.stages.tokenizer.encoder import PromptEncoder
    from conveyor.stages.tokenizer.preparation import prepare
    from conveyor.wire.images import ContentPart, ImageData
    from conveyor.wire.messages import ChatMessage, SamplingParams, TokenizeRequest

    config = build_engine_config(path, device="cpu")
    encoder = PromptEncoder.for_engine(config)
    parts = [ContentPart(image=0), ContentPart(text="what is in this picture?")]
    message = ChatMessage("user", "what is in this picture?", parts=parts)
    requests = [
        TokenizeRequest(
            f"r{i}", 0, SamplingParams(max_tokens=8), 0.0, messages=[message], images=[ImageData(data, "messages[0].content[0]")]
        )
        for i in range(count)
    ]
    start.wait()
    for req in requests:
        prepare(encoder, config, req)
    done.put(time.perf_counter())


def run(path: Path, data: bytes, workers: int, total: int) -> float:
    """Images per second with `workers` processes sharing `total` requests."""
    ctx = multiprocessing.get_context("spawn")
    start, done = ctx.Barrier(workers + 1), ctx.Queue()
    share = total // workers
    procs = [ctx.Process(target=_worker, args=(str(path), data, share, start, done)) for _ in range(workers)]
    for p in procs:
        p.start()
    start.wait()
    began = time.perf_counter()
    ends = [done.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    return share * workers / (max(ends) - began)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--crop", type=int, default=336)
    p.add_argument("--width", type=int, default=640)
    p.add_argument("--height", type=int, default=480)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    cpu = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")),
        platform.processor(),
    )
    data = jpeg(args.width, args.height)
    with tempfile.TemporaryDirectory() as tmp:
        path = checkpoint(Path(tmp), args.crop)
        print(f"CPU: {cpu}; {args.width}x{args.height} JPEG ({len(data)} bytes), LLaVA-1.5 crop {args.crop}, {args.requests} requests")
        for workers in args.workers:
            rates = sorted(run(path, data, workers, args.requests) for _ in range(args.rounds))
            each = ", ".join(f"{r:.1f}" for r in rates)
            print(f"{workers} tokenizer process(es): {rates[len(rates) // 2]:.1f} images/s median of {args.rounds} ({each})")


if __name__ == "__main__":
    main()
