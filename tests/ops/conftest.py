"""The ops area's shared fixtures, for conveyor bench's tests: one FakeServer (bench_fakes) per
test module, emptied before each test, and a counter over the tiny checkpoint's tokenizer."""

from __future__ import annotations

import pytest

from conveyor.bench.prompts import FileCounter
from tests.ops.bench_fakes import FakeServer


@pytest.fixture(scope="module")
def fake():
    server = FakeServer()
    yield server
    server.stop()


@pytest.fixture
def server(fake):
    fake.reset()
    return fake


@pytest.fixture(scope="module")
def tiny_counter():
    from conveyor.tiny.checkpoint import ensure_default_model

    return FileCounter(ensure_default_model() / "tokenizer.json")
