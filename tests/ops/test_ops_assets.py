"""The operations assets (docker/, ops/) agree with the Compose schema, Prometheus, and the metrics.

Every PromQL expression in the Grafana dashboard and the alert rules may name only metrics that
stages/metrics.py defines, with the suffix prometheus-client exposes (`_total`, `_bucket`, ...),
and only their labels. The promtool checks run where promtool is on PATH (Debian: `prometheus`).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")

from prometheus_client.metrics import MetricWrapperBase  # noqa: E402

from conveyor.stages import metrics  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker" / "compose.yaml"
DASHBOARD = REPO / "ops" / "grafana" / "dashboards" / "conveyor.json"
PROVISIONING = REPO / "ops" / "grafana" / "provisioning"
PROMETHEUS = REPO / "ops" / "prometheus"

promtool = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(promtool is None, reason="promtool not on PATH (Debian package `prometheus`)")


def load_yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def dashboard_panels() -> list[dict]:
    """Every panel but the rows themselves, including those nested in a collapsed row."""
    found: list[dict] = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        found.extend(panel.get("panels", []) if panel["type"] == "row" else [panel])
    return found


def alert_rules() -> list[dict]:
    return [rule for group in load_yaml(PROMETHEUS / "alerts.yml")["groups"] for rule in group["rules"]]


def all_exprs() -> list[tuple[str, str]]:
    dashboard = [(f"panel {p['title']!r} {t['refId']}", t["expr"]) for p in dashboard_panels() for t in p["targets"]]
    return dashboard + [(f"alert {r['alert']}", r["expr"]) for r in alert_rules()]


def catalogue() -> tuple[set[str], set[str]]:
    """The sample names the daemon exposes, and every label name a query may use."""
    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
    names, labels = {"up"}, {"le", "job", "instance"}  # up, job, instance: added by Prometheus
    for value in vars(metrics).values():
        metric = value.metric if isinstance(value, metrics.PerEngine) else value  # its `engine` label too
        if isinstance(metric, MetricWrapperBase):
            labels.update(metric._labelnames)
            for family in metric.describe():
                names.update(family.name + suffix for suffix in suffixes[family.type])
    return names, labels


# Strings, identifiers, numbers and durations ("1m", "0.99"), then any single character.
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|[A-Za-z_:][A-Za-z0-9_:]*|\d+(?:\.\d+)?[a-z]*|\S')
_LABEL_LISTS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
_KEYWORDS = _LABEL_LISTS | {"and", "or", "unless", "bool", "offset"}
_PAIRS = {")": "(", "]": "[", "}": "{"}


def promql_names(expr: str) -> tuple[list[str], list[str]]:
    """The metric names and label names in `expr`; asserts its brackets balance."""
    tokens = _TOKEN.findall(expr)
    names, labels, stack = [], [], []
    label_list = False  # inside by (...), on (...) and the like
    for i, token in enumerate(tokens):
        following = tokens[i + 1] if i + 1 < len(tokens) else ""
        if token in "([{":
            stack.append(token)
        elif token in _PAIRS:
            assert stack and stack.pop() == _PAIRS[token], f"unbalanced {token!r} in {expr!r}"
            label_list = False
        elif re.fullmatch(r"[A-Za-z_:][A-Za-z0-9_:]*", token):
            if token in _KEYWORDS:
                label_list = token in _LABEL_LISTS
            elif label_list or (stack and stack[-1] == "{"):
                labels.append(token)
            elif following not in ("(", "by", "without"):  # not a function or an aggregation
                names.append(token)
    assert not stack, f"unclosed {stack} in {expr!r}"
    return names, labels


# --- docker ----------------------------------------------------------------------------------


def test_compose_file_matches_the_compose_spec():
    schema = json.loads((REPO / "docker" / "schema" / "compose-spec.json").read_text())
    validator = jsonschema.Draft7Validator(schema)
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(load_yaml(COMPOSE))]
    assert not errors, errors


def test_compose_wires_the_services_to_each_other():
    services = load_yaml(COMPOSE)["services"]
    assert set(services) == {"conveyor", "prometheus", "grafana"}
    assert "8000:8000" in services["conveyor"]["ports"]
    assert "/health" in " ".join(services["conveyor"]["healthcheck"]["test"])
    mounts = {}
    for service in services.values():
        for volume in service.get("volumes", []):
            source, target = volume.split(":")[:2]
            if source.startswith("."):
                assert (COMPOSE.parent / source).exists(), volume
                mounts[(COMPOSE.parent / source).resolve()] = target
    # Prometheus reads its default config path; Grafana's provider reads the mounted dashboards.
    assert mounts[PROMETHEUS] == "/etc/prometheus"
    assert mounts[PROVISIONING] == "/etc/grafana/provisioning"
    provider = load_yaml(PROVISIONING / "dashboards" / "conveyor.yml")["providers"][0]
    assert provider["options"]["path"] == mounts[DASHBOARD.parent]
    # Each side names the other by its compose service name and port.
    job = load_yaml(PROMETHEUS / "prometheus.yml")["scrape_configs"][0]
    assert job["job_name"] == "conveyor"
    assert job["static_configs"][0]["targets"] == ["conveyor:8000"]
    datasource = load_yaml(PROVISIONING / "datasources" / "prometheus.yml")["datasources"][0]
    assert datasource["url"] == "http://prometheus:9090"


def test_dockerfile_copies_every_package_dir():
    """conveyor/ and every top-level folder its links point to (a layer missing from the image
    would only fail when the container starts)."""
    links = [p for p in (REPO / "conveyor").iterdir() if p.is_symlink()]
    package_dirs = {"conveyor", *(str(p.readlink()).removeprefix("../") for p in links)}
    assert package_dirs >= {"conveyor", "stages", "wire", "gpu", "config"}
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    sources = [s for line in re.findall(r"^COPY (.+)$", dockerfile, re.M) for s in line.split()[:-1]]
    assert all((REPO / s).exists() for s in sources), sources
    assert package_dirs <= set(sources)
    assert re.search(r"^HEALTHCHECK .*/health", dockerfile, re.M | re.S)
    assert 'ENTRYPOINT ["conveyor", "serve", "--host", "0.0.0.0"]' in dockerfile


# --- grafana ---------------------------------------------------------------------------------


def test_dashboard_has_the_rows_of_the_issue():
    dashboard = json.loads(DASHBOARD.read_text())
    rows = [p["title"] for p in dashboard["panels"] if p["type"] == "row"]
    assert rows == ["Overview", "Latency", "GPU bubble", "Queue", "KV cache", "Stages", "Speculative decoding", "KV tiers"]
    ids = [p["id"] for p in dashboard["panels"] if p["type"] == "row"] + [p["id"] for p in dashboard_panels()]
    assert len(ids) == len(set(ids))
    assert dashboard["uid"] == "conveyor" and dashboard["schemaVersion"] >= 39


@pytest.mark.parametrize("panel", dashboard_panels(), ids=lambda p: p["title"])
def test_panel_queries_the_provisioned_datasource(panel):
    uid = load_yaml(PROVISIONING / "datasources" / "prometheus.yml")["datasources"][0]["uid"]
    assert panel["datasource"] == {"type": "prometheus", "uid": uid}
    assert panel["targets"]
    for target in panel["targets"]:
        assert target["expr"].strip()
        assert target["datasource"]["uid"] == uid


# --- prometheus ------------------------------------------------------------------------------


def test_alert_rules_of_the_issue():
    assert [r["alert"] for r in alert_rules()] == [
        "ConveyorDown",
        "ConveyorGpuBubbleHigh",
        "ConveyorQueueTimeHigh",
        "ConveyorKvCacheExhausted",
        "ConveyorStageRestarted",
    ]


@pytest.mark.parametrize(("where", "expr"), all_exprs(), ids=[w for w, _ in all_exprs()])
def test_expr_names_only_catalogued_metrics(where, expr):
    known_names, known_labels = catalogue()
    names, labels = promql_names(expr)
    assert names, f"{where}: no metric in {expr!r}"
    assert set(names) <= known_names, f"{where}: unknown metrics {set(names) - known_names}"
    assert set(labels) <= known_labels, f"{where}: unknown labels {set(labels) - known_labels}"


def test_promql_names_rejects_what_it_should():
    assert promql_names('sum by (le) (rate(a_bucket{job="x"}[1m])) / b') == (["a_bucket", "b"], ["le", "job"])
    with pytest.raises(AssertionError):
        promql_names("sum(rate(a[1m])")
    with pytest.raises(AssertionError):
        promql_names("rate(a[1m)]")


def run_promtool(*args: str, cwd: Path = REPO) -> None:
    assert promtool is not None  # its callers are marked needs_promtool
    done = subprocess.run([promtool, *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


@needs_promtool
def test_promtool_checks_config_and_rules():
    run_promtool("check", "config", "ops/prometheus/prometheus.yml")
    run_promtool("check", "rules", "ops/prometheus/alerts.yml")


@needs_promtool
def test_alert_rules_fire_as_described():
    run_promtool("test", "rules", "alerts_test.yml", cwd=PROMETHEUS)


@needs_promtool
def test_promtool_parses_every_query(tmp_path):
    # promtool has no bare "parse this query": each dashboard and alert query becomes a recording rule.
    rules = [{"record": f"dashboard:query_{i}", "expr": expr} for i, (_, expr) in enumerate(all_exprs())]
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "queries", "rules": rules}]}))
    run_promtool("check", "rules", str(path))
