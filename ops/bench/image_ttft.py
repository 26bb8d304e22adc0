"""TTFT of one-image chat requests against a running daemon, beside text-only ones (issue 51).

    python -m conveyor serve --model DIR --device cpu --port 8095 &   # DIR: a vision checkpoint
    python ops/bench/image_ttft.py --base-url http://127.0.0.1:8095 --requests 20

Sends --requests streaming chat requests one at a time, alternating: one --width x --height JPEG
(a data: URL, as a client sends it) plus a line of text, then text alone of about as many prompt
tokens as the image request had (its placeholders included), so the two differ in the image's
path (ingress decode of base64, tokenizer-stage preprocessing, the tower) and not in prompt
length. Prints the median time to the first streamed token of each, and the ratio.
"""

from __future__ import annotations

import argparse
import base64
import io
import statistics
import time

import numpy as np
import openai
from PIL import Image


def jpeg_url(width: int, height: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(out, format="JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(out.getvalue()).decode()


def ttft(client: openai.OpenAI, model: str, content: object) -> tuple[float, int]:
    began = time.perf_counter()
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": content}],  # type: ignore[list-item,misc]
        max_tokens=4,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    first, prompt_tokens = None, 0
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content is not None:
            first = time.perf_counter() - began
        if chunk.usage is not None:
            prompt_tokens = chunk.usage.prompt_tokens
    assert first is not None
    return first, prompt_tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", required=True)
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--width", type=int, default=640)
    p.add_argument("--height", type=int, default=480)
    args = p.parse_args()
    client = openai.OpenAI(base_url=f"{args.base_url}/v1", api_key="none")
    model = client.models.list().data[0].id
    question = [{"type": "text", "text": "what is in this picture?"}]
    _, prompt_tokens = ttft(
        client, model, [{"type": "image_url", "image_url": {"url": jpeg_url(args.width, args.height, 0)}}, *question]
    )
    words = " ".join(["river"] * prompt_tokens)
    _, text_tokens = ttft(client, model, words)
    words = " ".join(["river"] * max(1, prompt_tokens - (text_tokens - prompt_tokens)))  # about as long
    image_times, text_times = [], []
    for i in range(args.requests):
        url = jpeg_url(args.width, args.height, i + 1)  # a new picture each time: no encoder or prefix cache hit
        image_times.append(ttft(client, model, [{"type": "image_url", "image_url": {"url": url}}, *question])[0])
        text_times.append(ttft(client, model, f"{i} {words}")[0])
    image, text = statistics.median(image_times), statistics.median(text_times)
    print(f"{args.requests} requests each, {args.width}x{args.height} JPEG, {prompt_tokens} prompt tokens with the image")
    print(f"TTFT median: one image {image * 1000:.1f} ms, text alone {text * 1000:.1f} ms, ratio {image / text:.2f}")


if __name__ == "__main__":
    main()
