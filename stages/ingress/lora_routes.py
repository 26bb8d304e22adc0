"""LoRA adapters over HTTP, as vLLM serves them: POST /v1/load_lora_adapter {"lora_name",
"lora_path"} and POST /v1/unload_lora_adapter {"lora_name"}, while serving and behind the API key
(auth.py guards every route but /health and /metrics); a request then picks an adapter by its
`model` field (GenerateRoutes.run), and /v1/models lists each with the base as its `parent`.

The scheduler owns the adapters (stages/scheduler/adapters.py): a command goes there and its
verdict comes back (an AdapterCommand answered with RequestAccepted or RequestRejected: a path
that is not an adapter, a rank over --max-lora-rank, a target the model lacks, a name loaded
twice, the base's name: 400; an unknown name to unload: 404). `ServedAdapters` is this ingress
process's list for /v1/models: --lora-modules, then what its own commands changed (with
--ingress-workers above 1, another process's list misses its loads; the requests still reach them).
"""

from __future__ import annotations

from aiohttp import web

from conveyor.config import EngineConfig
from conveyor.stages.ingress.bodies import LoadLoraBody, UnloadLoraBody
from conveyor.stages.ingress.engine_client import EngineClient
from conveyor.stages.ingress.errors import ApiError, read_body
from conveyor.stages.ingress.protocol import decode
from conveyor.wire.messages import AdapterCommand, RequestRejected


class ServedAdapters:
    def __init__(self, config: EngineConfig) -> None:
        self.paths: dict[str, str] = dict(config.lora.modules()) if config.lora.enable_lora else {}


class LoraRoutes:
    def __init__(self, config: EngineConfig, engine: EngineClient, adapters: ServedAdapters) -> None:
        self.config = config
        self.engine = engine
        self.adapters = adapters

    async def load(self, request: web.Request) -> web.Response:
        body = decode(await read_body(request, self.config.server.max_body_bytes), LoadLoraBody)
        await self._command(body.lora_name, body.lora_path)
        self.adapters.paths[body.lora_name] = body.lora_path
        return web.json_response({"object": "lora_adapter", "id": body.lora_name, "status": "loaded"})

    async def unload(self, request: web.Request) -> web.Response:
        body = decode(await read_body(request, self.config.server.max_body_bytes), UnloadLoraBody)
        await self._command(body.lora_name, None)
        self.adapters.paths.pop(body.lora_name, None)
        return web.json_response({"object": "lora_adapter", "id": body.lora_name, "status": "unloaded"})

    async def _command(self, name: str, path: str | None) -> None:
        if not self.config.lora.enable_lora:
            raise ApiError(400, "LoRA adapters need the server started with --enable-lora", param="lora_name")
        if not self.engine.ready:
            raise ApiError(503, "the engine is loading or restarting; retry shortly", code="engine_not_ready")
        verdict = await self.engine.command(AdapterCommand(self.engine.new_request_id("lora"), self.engine.index, name, path))
        if isinstance(verdict, RequestRejected):
            raise ApiError(verdict.status, verdict.message, param=verdict.param, code=verdict.code)
