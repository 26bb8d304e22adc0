"""The api area's shared fixture: one ingress (the real serve() against ingress_fakes' fake
engine) per test module. A module that needs other settings (limits, a scripted engine, a
locked-down server) defines a fixture of its own."""

from __future__ import annotations

import pytest

from tests.ingress_server import running_server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("ingress")) as running:
        yield running
