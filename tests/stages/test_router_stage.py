"""The router stage on real sockets, the schedulers' and the ingress's ends held by the test: a
request goes only to a ready engine (none ready: a 503), its abort follows it (an abort that
overtook its request drops the request), and when an engine dies the requests on their way to it,
and only those, get a 503 from the router."""

from __future__ import annotations

import shutil
from typing import cast

import pytest
import zmq

from conveyor.config import EngineConfig, ModelConfig, ParallelConfig, ServerConfig
from conveyor.stages.router.main import RouterStage, routing_items
from conveyor.stages.router.policy import prefix_hashes
from conveyor.wire.addresses import make_run_dir
from conveyor.wire.images import ImageInput
from conveyor.wire.messages import (
    AbortRequest,
    EngineLoad,
    EngineStatus,
    RequestRejected,
    SamplingParams,
    ScheduleRequest,
)
from conveyor.wire.topology import INGRESS, SCHEDULER, receiver


@pytest.fixture
def wired():
    run_dir = make_run_dir()
    config = EngineConfig(
        model=cast(ModelConfig, None),  # the router reads no model
        parallel=ParallelConfig(data_parallel_size=2),
        server=ServerConfig(run_dir=run_dir),
    )
    ctx = zmq.Context()
    schedulers = [receiver(ctx, config, SCHEDULER, e) for e in range(2)]
    ingress = receiver(ctx, config, INGRESS)
    stage = RouterStage(config, ctx)
    yield stage, schedulers, ingress
    ctx.destroy(linger=0)
    shutil.rmtree(run_dir, ignore_errors=True)


def request(request_id: str, tokens: int = 40) -> ScheduleRequest:
    """A prompt of its own: no two requests share a block."""
    first = 10_000 * sum(request_id.encode())
    return ScheduleRequest(request_id, 0, list(range(first, first + tokens)), SamplingParams(max_tokens=4), arrival_time=0.0)


def drain(inbox) -> list:
    got, msg = [], inbox.recv(timeout_ms=200)
    while msg is not None:
        got.append(msg)
        msg = inbox.recv(timeout_ms=50)
    return got


def test_no_ready_engine_means_a_503_and_a_ready_one_gets_the_request(wired):
    stage, schedulers, ingress = wired
    stage.handle(request("early"))
    [rejected] = drain(ingress)
    assert isinstance(rejected, RequestRejected) and (rejected.request_id, rejected.status) == ("early", 503)
    stage.handle(EngineStatus(ready=True, engine=1))
    stage.handle(request("a"))
    stage.handle(request("b"))
    assert [m.request_id for m in drain(schedulers[1])] == ["a", "b"]
    assert drain(schedulers[0]) == []


def test_an_abort_follows_its_request_and_one_that_overtook_it_drops_it(wired):
    stage, schedulers, ingress = wired
    stage.handle(EngineStatus(ready=True))
    stage.handle(request("a"))
    stage.handle(request("b"))  # engine 0 holds one in transit: engine 1
    assert [m.request_id for m in drain(schedulers[0])] == ["a"]
    assert [m.request_id for m in drain(schedulers[1])] == ["b"]
    stage.handle(AbortRequest(["b"]))
    assert drain(schedulers[1]) == [AbortRequest(["b"])] and drain(schedulers[0]) == []
    # The ingress gave up on "c" before its tokenizer was done: every engine hears of it (the
    # router cannot tell a request not yet here from one it forgot), and "c" is never routed.
    stage.handle(AbortRequest(["c"]))
    assert drain(schedulers[0]) == [AbortRequest(["c"])] == drain(schedulers[1])
    stage.handle(request("c"))
    assert drain(schedulers[0]) == [] == drain(schedulers[1])


def test_a_dead_engine_fails_only_the_requests_on_their_way_to_it(wired):
    stage, schedulers, ingress = wired
    stage.handle(EngineStatus(ready=True))
    for i in range(4):  # distinct prompts, alternating engines: 0, 2 -> engine 0
        stage.handle(request(f"r{i}"))
    assert [m.request_id for m in drain(schedulers[0])] == ["r0", "r2"]
    # Engine 0 has received one of its two (it says so); then it dies.
    stage.handle(EngineLoad(engine=0, num_waiting=0, num_running=1, num_kv_blocks_used=3, num_kv_blocks=64, num_received=1))
    stage.handle(EngineStatus(ready=False, engine=0))
    rejected = drain(ingress)
    assert [(m.request_id, m.status, m.code) for m in rejected] == [("r2", 503, "engine_not_ready")]
    # Until it is back, everything goes to engine 1; a report from its dead process changes nothing.
    stage.handle(EngineLoad(engine=0, num_waiting=0, num_running=0, num_kv_blocks_used=0, num_kv_blocks=64, num_received=9))
    for i in range(4, 7):
        stage.handle(request(f"r{i}"))
    assert drain(schedulers[0]) == []
    assert [m.request_id for m in drain(schedulers[1])] == ["r1", "r3", "r4", "r5", "r6"]
    stage.handle(EngineStatus(ready=True, engine=0))
    stage.handle(request("r7"))
    assert [m.request_id for m in drain(schedulers[0])] == ["r7"]  # the idle engine again


def test_an_engines_host_tier_widens_its_prefix_map(wired):
    """The wire's num_host_blocks reaches the policy: a pool of 1 block alone keeps 1 of a 2-block
    prompt (40 tokens, blocks of 16); with a host tier of 8 the next two prompts evict nothing."""
    stage, schedulers, ingress = wired
    stage.handle(EngineStatus(ready=True, engine=0))
    stage.handle(EngineLoad(engine=0, num_waiting=0, num_running=0, num_kv_blocks_used=0, num_kv_blocks=1, num_received=0))
    stage.handle(request("a"))
    assert stage.policy.num_mapped_blocks(0) == 1  # the pool alone
    stage.handle(
        EngineLoad(engine=0, num_waiting=0, num_running=0, num_kv_blocks_used=0, num_kv_blocks=1, num_received=1, num_host_blocks=8)
    )
    stage.handle(request("b"))
    stage.handle(request("c"))
    assert stage.policy.num_mapped_blocks(0) == 5  # 1 + 2 + 2: nothing evicted past the pool
    assert [m.request_id for m in drain(schedulers[0])] == ["a", "b", "c"]


def test_an_images_pixels_name_its_blocks_for_affinity(wired):
    """Two prompts alike but for the picture behind their placeholder ids: the router's map keys
    the blocks by the image's hash, so the second matches only the blocks before the image, and
    the first's again matches in full."""

    def image(digest: int) -> ImageInput:
        return ImageInput(hash=digest, offset=16, length=32, pixels=b"", shape=[0])

    ids = [7] * 16 + [99] * 32 + [8] * 16  # text, 32 placeholders, text: 4 blocks of 16
    cat, dog = (prefix_hashes(routing_items(ids, [image(d)]), 16) for d in (1, 2))
    assert cat[0] == dog[0] and all(a != b for a, b in zip(cat[1:], dog[1:]))
    assert prefix_hashes(routing_items(ids, []), 16) == prefix_hashes(ids, 16) != cat

    stage, schedulers, _ = wired
    stage.handle(EngineStatus(ready=True, engine=0))
    stage.handle(EngineLoad(engine=0, num_waiting=0, num_running=0, num_kv_blocks_used=0, num_kv_blocks=64, num_received=0))
    for digest in (1, 2, 1):
        stage.handle(ScheduleRequest(f"r{digest}", 0, ids, SamplingParams(max_tokens=4), arrival_time=0.0, images=[image(digest)]))
    assert stage.policy.num_mapped_blocks(0) == 4 + 3  # the second prompt's blocks past the image are its own
