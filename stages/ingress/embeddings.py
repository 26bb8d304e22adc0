"""POST /v1/embeddings: one vector per input, from an embedding checkpoint (config/pooling.py).

Each input is an engine request of its own, scheduled as any prompt is (admission, batching with
other requests, chunking) through `GenerateRoutes.run`: its prompt's passes pool the vector on the
worker (gpu/step/features/pooling.py), its one drawn token is discarded, and it ends there, its blocks freed. A
generative model asked for embeddings is a 400 (the generation routes refuse an embedding model
the same way: GenerateRoutes.run). `dimensions` cuts the vector where the model was trained for
it (its config's matryoshka dimensions); `encoding_format` "base64" sends each vector as its
little-endian float32 bytes, as OpenAI does. A batch is bounded by --max-seqs-per-request.
"""

from __future__ import annotations

import base64
import struct
import time
from typing import Any

from aiohttp import web

from conveyor.config import EngineConfig
from conveyor.config.pooling import check_dimensions
from conveyor.stages.ingress.bodies import EmbeddingsBody
from conveyor.stages.ingress.errors import ApiError, read_body
from conveyor.stages.ingress.generate import GenerateRoutes
from conveyor.stages.ingress.protocol import Generation, decode, prompts_of
from conveyor.wire.messages import Pooling, SamplingParams


class EmbeddingRoutes:
    def __init__(self, config: EngineConfig, generate: GenerateRoutes) -> None:
        self.config = config
        self.generate = generate

    async def embeddings(self, request: web.Request) -> web.Response:
        arrival_time = time.time()
        self.generate.check_serving()
        body = decode(await read_body(request, self.config.server.max_body_bytes), EmbeddingsBody)
        model = self.config.model
        if model.pooling is None:
            message = (
                f"the model `{model.served_name}` generates text and has no embeddings: an embedding checkpoint "
                "declares its pooling (sentence-transformers' modules.json)"
            )
            raise ApiError(400, message, param="model", code="model_not_embedding")
        try:
            check_dimensions(model.pooling, model.hidden_size, body.dimensions)
        except ValueError as e:
            raise ApiError(400, str(e), param="dimensions") from None
        max_inputs = self.config.server.max_seqs_per_request
        params = SamplingParams(temperature=0.0, max_tokens=1, pooling=Pooling(body.dimensions))
        gen = Generation(params=params, prompts=prompts_of(body.input, model.vocab_size, "input", max_inputs), model=body.model)
        async with self.generate.run(gen, chat=False, arrival_time=arrival_time, id_prefix="embd") as run:
            await run.finish()
        builder = run.builder
        data = [
            {"object": "embedding", "index": i, "embedding": _encoded(vector, body.encoding_format)}
            for i, vector in enumerate(builder.embeddings)
        ]
        num_tokens = sum(builder.num_prompt_tokens)
        usage = {"prompt_tokens": num_tokens, "total_tokens": num_tokens}
        return web.json_response({"object": "list", "data": data, "model": model.served_name, "usage": usage})


def _encoded(vector: list[float], encoding_format: str) -> Any:
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
