"""ops/k8s: every manifest validates, offline, against the Kubernetes JSON schemas that
kubernetes-validate bundles (strict: an unknown field is an error) at the pinned versions; every
container's command line parses with conveyor's own CLI (after the image's entrypoint, read from
docker/Dockerfile) and within the settings' bounds; probes ask routes the app really serves, on
the port it listens on; Services and annotations name ports that exist; the router finds the
StatefulSet's replicas through their headless Service; the grace period covers the drain."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import kubernetes_validate  # type: ignore[import-untyped]  # no type information shipped
import pytest
import yaml

from conveyor import cli
from conveyor.config.engine_options import OPTION_CLASSES
from conveyor.config.options import collect, settings
from conveyor.stages.replica_router.config import RouterConfig

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "ops" / "k8s"
# The oldest minor release still common in managed clusters, and the newest the package bundles.
KUBERNETES_VERSIONS = ("1.29.0", "1.37.0")


def manifests() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        out += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return out


def by_kind(kind: str) -> list[dict]:
    return [doc for _, doc in manifests() if doc["kind"] == kind]


def entrypoint() -> list[str]:
    match = re.search(r"^ENTRYPOINT\s+(\[.*\])\s*$", (ROOT / "docker" / "Dockerfile").read_text(), re.M)
    assert match, "docker/Dockerfile has no exec-form ENTRYPOINT"
    return json.loads(match.group(1))


def command_line(container: dict) -> list[str]:
    """What the container runs: its command, or the image's entrypoint, then its args."""
    return [*(container.get("command") or entrypoint()), *container.get("args", [])]


def parse(argv: list[str]) -> argparse.Namespace:
    """argv through `conveyor`'s parser, then each setting through its bounds (ConfigError)."""
    assert argv[0] == "conveyor", argv
    parser = argparse.ArgumentParser(prog="conveyor")
    sub = parser.add_subparsers(dest="command", required=True)
    cli.serve_parser(sub)
    cli.router_parser(sub)
    args = parser.parse_args(argv[1:])
    classes = tuple(OPTION_CLASSES.values()) if args.command == "serve" else (RouterConfig,)
    collect(classes, {s.name: getattr(args, s.name) for cls in classes for s in settings(cls)})
    return args


def get_routes(command: str, tmp_path: Path) -> set[str]:
    """The GET routes the process serves: the ingress app built on a tiny config, or the router's."""
    if command == "serve":
        from conveyor.stages.ingress.app import build_app
        from tests.ingress_server import make_config

        app = build_app(make_config(tmp_path, str(tmp_path)), None)  # type: ignore[arg-type]  # no engine is called
    else:
        from conveyor.stages.replica_router.proxy import make_app

        app = make_app(RouterConfig(backends=("http://replica:8000",)))
    return {r.resource.canonical for r in app.router.routes() if r.method == "GET" and r.resource is not None}


def workloads() -> list[dict]:
    return by_kind("StatefulSet") + by_kind("Deployment")


def containers() -> list[tuple[dict, dict]]:
    return [(w, c) for w in workloads() for c in w["spec"]["template"]["spec"]["containers"]]


def test_there_are_replicas_and_a_router():
    commands = sorted(parse(command_line(c)).command for _, c in containers())
    assert commands == ["router", "serve"]
    assert {s["metadata"]["name"] for s in by_kind("Service")} == {"conveyor", "conveyor-router"}


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_manifests_follow_the_kubernetes_schemas(version):
    for name, doc in manifests():
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{name}: {doc['kind']} {doc['metadata']['name']}: {e.message} at {list(e.path)}")
    broken = by_kind("Deployment")[0]
    broken = {**broken, "spec": {**broken["spec"], "replica": 2}}  # a misspelt field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, version, strict=True)


def test_probes_ask_routes_that_exist_on_the_port_served(tmp_path):
    for workload, container in containers():
        args = parse(command_line(container))
        routes = get_routes(args.command, tmp_path)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert list(ports.values()) == [args.port]  # the one port the process listens on
        for kind in ("readinessProbe", "livenessProbe"):
            probe = container[kind]["httpGet"]
            assert probe["path"] in routes, (container["name"], kind, probe["path"])
            assert ports.get(probe["port"], probe["port"]) == args.port
        assert container["readinessProbe"]["httpGet"]["path"] == "/health"
        annotations = workload["spec"]["template"]["metadata"]["annotations"]
        assert int(annotations["prometheus.io/port"]) == args.port and annotations["prometheus.io/path"] in routes


def test_services_select_pods_and_name_their_ports():
    for service in by_kind("Service"):
        selected = [
            w for w in workloads() if service["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(selected) == 1, service["metadata"]["name"]
        names = {p["name"] for c in selected[0]["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
        assert all(p["targetPort"] in names for p in service["spec"]["ports"])


def test_the_router_finds_the_replicas_through_their_headless_service():
    (replicas,) = by_kind("StatefulSet")
    (headless,) = [s for s in by_kind("Service") if s["metadata"]["name"] == replicas["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None"  # headless: the name resolves to every pod
    assert headless["spec"]["publishNotReadyAddresses"]  # the router sees replicas that load
    (router,) = [c for _, c in containers() if parse(command_line(c)).command == "router"]
    args = parse(command_line(router))
    assert args.backends_dns == f"{headless['metadata']['name']}:{headless['spec']['ports'][0]['port']}"
    assert replicas["spec"]["replicas"] <= args.max_replicas


def test_the_grace_period_covers_the_drain():
    (replicas,) = by_kind("StatefulSet")
    (container,) = replicas["spec"]["template"]["spec"]["containers"]
    drain = parse(command_line(container)).drain_timeout
    assert replicas["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= drain + 5  # the stages' stop
