"""The Grafana dashboard (docker/grafana/kvroom-dashboard.json), checked against the metrics kvroom exports.

A query naming a metric no service exports draws an empty panel without any error, so
every metric name in every PromQL expression is looked up in what the services really
register: ServiceMetrics for each role, plus the gauges the node runtime and the
bootstrap's cluster add on top.
"""

import json
import re
from pathlib import Path
from typing import Any

import pytest

from shared.metrics import ServiceMetrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docker" / "grafana" / "kvroom-dashboard.json"
# Gauges registered outside ServiceMetrics: by role, and the source file that registers them.
EXTRA_GAUGES = {
    "prefill": ["kvroom_free_pages", "kvroom_total_pages"],
    "decode": ["kvroom_free_pages", "kvroom_total_pages", "kvroom_free_aux_slots", "kvroom_total_aux_slots"],
    "bootstrap": ["kvroom_live_prefill_nodes", "kvroom_live_decode_nodes"],
}
GAUGE_SOURCES = {
    "kvroom_free_pages": "shared/node/builder.py",
    "kvroom_total_pages": "shared/node/builder.py",
    "kvroom_free_aux_slots": "decode_node/role.py",
    "kvroom_total_aux_slots": "decode_node/role.py",
    "kvroom_live_prefill_nodes": "bootstrap/registry.py",
    "kvroom_live_decode_nodes": "bootstrap/registry.py",
}
# Labels Prometheus adds to every series it scrapes.
TARGET_LABELS = {"instance", "job"}
# What the brief for the dashboard asks it to show.
WANTED = {
    "kvroom_rooms",
    "kvroom_room_transitions_total",
    "kvroom_room_failures_total",
    "kvroom_messages_rejected_total",
    "kvroom_live_prefill_nodes",
    "kvroom_live_decode_nodes",
    "kvroom_free_pages",
    "kvroom_free_aux_slots",
    "kvroom_transfer_bytes_total",
    "kvroom_transfer_seconds_bucket",
    "kvroom_aux_latency_seconds_bucket",
    "kvroom_time_to_success_seconds_bucket",
    "kvroom_room_seconds_bucket",
    "process_cpu_seconds_total",
    "process_resident_memory_bytes",
    "kvroom_info",
}
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("", "_count", "_sum", "_created"),
}
PANEL_TYPES = {"row", "timeseries", "stat", "gauge", "table", "bargauge", "text"}

# PromQL words that look like metric names: aggregations (also written "sum by (x) (...)"),
# the keywords of vector matching and grouping, set operators. Functions are followed by
# "(" and skipped that way.
KEYWORDS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values"}
KEYWORDS |= {"bottomk", "topk", "quantile", "limitk", "limit_ratio"}
KEYWORDS |= {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset"}
KEYWORDS |= {"and", "or", "unless", "atan2", "inf", "nan"}
# Grouping and matching clauses hold label names, not metrics: "by (le, state)".
LABEL_LIST = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
IDENTIFIER = re.compile(r"(?<![\w.$])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?")


def exported() -> dict[str, set[str]]:
    """Every sample name a service exports, by any role, with the label names of each."""
    names: dict[str, set[str]] = {}
    for role, gauges in EXTRA_GAUGES.items():
        metrics = ServiceMetrics(role, f"{role}-0", "tcp")
        for gauge in gauges:
            metrics.gauge_function(gauge, "as the service registers it", lambda: 0.0)
        for family in metrics.registry.collect():
            for sample in family.samples:
                names.setdefault(sample.name, set()).update(sample.labels)
            if family.samples:
                continue
            # A labelled family has no sample until its first child: its sample names follow
            # from its type, its labels from what it declares (prometheus_client keeps them
            # on the collector, under a private name).
            collector = metrics.registry._names_to_collectors[family.name]
            declared = set(getattr(collector, "_labelnames", ()))
            for suffix in SUFFIXES.get(family.type, ("",)):
                names.setdefault(family.name + suffix, set()).update(declared)
                if suffix == "_bucket":
                    names[family.name + suffix].add("le")
    return names


EXPORTED = exported()


def load() -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return dashboard


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, rows and the panels of collapsed rows included."""
    found = []
    for panel in dashboard["panels"]:
        found.append(panel)
        found.extend(panel.get("panels", []))
    return found


def targets() -> list[tuple[str, dict[str, Any]]]:
    return [(p["title"], t) for p in panels(load()) for t in p.get("targets", [])]


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects (a regex, not a parser; enough for these queries)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals: label values
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # range selectors, [$__rate_interval]
    text = LABEL_LIST.sub(" ", text)  # "by (le, state)": label names
    names = set()
    for match in IDENTIFIER.finditer(text):
        word, call = match.group(1), match.group(2)
        if call or word in KEYWORDS:
            continue
        names.add(word)
    return names


def test_the_parser_skips_functions_labels_and_keywords():
    expr = (
        'histogram_quantile(0.99, sum by (le, state) (rate(kvroom_room_seconds_bucket{state="SUCCESS"}'
        "[$__rate_interval]))) * on (instance, job) group_left (role) kvroom_info and bool 1e3"
    )
    assert metric_names(expr) == {"kvroom_room_seconds_bucket", "kvroom_info"}
    assert metric_names("sum(rate(nope_total[5m]))") == {"nope_total"}


def test_extra_gauges_are_the_names_the_services_register():
    for name, source in GAUGE_SOURCES.items():
        text = (ROOT / source).read_text()
        # The bootstrap names its two with f"kvroom_live_{role}_nodes".
        templated = re.sub(r"_(prefill|decode)_", "_{role}_", name)
        assert f'"{name}"' in text or f'f"{templated}"' in text, f"{name} is not registered in {source}"


def test_the_dashboard_is_json_grafana_imports():
    dashboard = load()
    assert dashboard["title"] and dashboard["uid"]
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["schemaVersion"] >= 36
    assert dashboard.get("id") is None, "an id would clash on import"
    (variable,) = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    assert variable["query"] == "prometheus"
    source = {"type": "prometheus", "uid": "${" + variable["name"] + "}"}
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels(dashboard):
        assert panel["type"] in PANEL_TYPES, panel["title"]
        pos = panel["gridPos"]
        assert all(isinstance(pos[k], int) for k in ("h", "w", "x", "y")), panel["title"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == source, panel["title"]
        assert panel["targets"], f"{panel['title']} has no query"
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        for t in panel["targets"]:
            assert t["expr"].strip(), panel["title"]
            assert t.get("datasource", source) == source, panel["title"]


def test_panels_do_not_overlap():
    boxes = [p["gridPos"] for p in load()["panels"]]
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            apart = (
                a["x"] + a["w"] <= b["x"]
                or b["x"] + b["w"] <= a["x"]
                or a["y"] + a["h"] <= b["y"]
                or b["y"] + b["h"] <= a["y"]
            )
            assert apart, f"{a} overlaps {b}"


@pytest.mark.parametrize(("title", "target"), targets(), ids=[f"{t}:{q['refId']}" for t, q in targets()])
def test_every_metric_in_every_query_is_exported(title, target):
    expr = target["expr"]
    assert expr.count("(") == expr.count(")"), f"{title}: unbalanced parentheses"
    names = metric_names(expr)
    assert names, f"{title}: no metric in {expr}"
    unknown = names - set(EXPORTED)
    assert not unknown, f"{title}: {sorted(unknown)} are exported by no kvroom service"


@pytest.mark.parametrize(("title", "target"), targets(), ids=[f"{t}:{q['refId']}" for t, q in targets()])
def test_labels_in_queries_and_legends_exist(title, target):
    expr = target["expr"]
    known = TARGET_LABELS.union(*(EXPORTED[n] for n in metric_names(expr)))
    for _, labels in LABEL_LIST.findall(expr):
        for label in filter(None, (s.strip() for s in labels.split(","))):
            assert label in known, f"{title}: no metric of {expr} has the label {label}"
    for label in re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")):
        assert label in known and label in expr, f"{title}: the legend's {label} is not kept by {expr}"
    if "histogram_quantile" in expr:
        assert "_bucket" in expr and re.search(r"by \([^)]*\ble\b", expr), f"{title}: quantiles need le"


def test_the_dashboard_shows_what_it_was_asked_to():
    used = set().union(*(metric_names(t["expr"]) for _, t in targets()))
    assert used >= WANTED, f"not on the dashboard: {sorted(WANTED - used)}"
    (table,) = [p for p in panels(load()) if p["type"] == "table"]
    (query,) = table["targets"]
    assert metric_names(query["expr"]) == {"kvroom_info"} and query["format"] == "table"
    for label in ("version", "role", "node_id", "transport"):
        assert label in query["expr"]
