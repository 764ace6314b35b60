"""deploy/: the dashboard, the rules and the chart ask only for metrics the server really exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

from attnserve_server.settings import load_settings

from conftest import Running

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
# Exported only where a CUDA device serves a model (read at scrape time).
CUDA_ONLY = {"attnserve_device_memory_allocated_bytes", "attnserve_device_memory_reserved_bytes"}
NAME = re.compile(r"\b(attnserve_[a-z_]+|[a-z_]+:attnserve_[a-z_:0-9]+)\b")


def exported(server: Running) -> set[str]:
    names = set(CUDA_ONLY)
    # Families are listed before any sample exists (a labelled series appears on first use),
    # so the sample names come from each family's type.
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "info": ("_info",)}
    for family in text_string_to_metric_families(server.metrics_text()):
        names.add(family.name)
        names.update(family.name + suffix for suffix in suffixes.get(family.type, ()))
        names.update(sample.name for sample in family.samples)
    return names


def rules() -> list[dict]:
    groups = yaml.safe_load((DEPLOY / "prometheus" / "rules" / "attnserve.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def test_cuda_only_names_are_the_servers() -> None:
    source = (Path(__file__).resolve().parents[1] / "server" / "attnserve_server" / "metrics.py").read_text()
    assert all(f'"{name}"' in source for name in CUDA_ONLY)


def test_every_dashboard_query_uses_exported_metrics(default_server: Running) -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "attnserve.json").read_text())
    known = exported(default_server)
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    exprs += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    assert len(exprs) > 20
    used = {name for expr in exprs for name in NAME.findall(expr)}
    assert used and used <= known, sorted(used - known)
    # The panels the issue asks for are there.
    titles = " ".join(panel["title"].lower() for panel in dashboard["panels"])
    for word in ("latency", "throughput", "batch", "queue", "padding", "error"):
        assert word in titles, word


def test_rules_use_exported_metrics_and_alerts_use_recorded_series(default_server: Running) -> None:
    known = exported(default_server)
    recorded = {rule["record"] for rule in rules() if "record" in rule}
    for rule in rules():
        used = set(NAME.findall(rule["expr"]))
        assert used <= known | recorded, (rule.get("record") or rule.get("alert"), sorted(used - known - recorded))
    alerts = {rule["alert"] for rule in rules() if "alert" in rule}
    assert {"AttnServeDown", "AttnServeHighErrorRatio", "AttnServeHighLatencyP99", "AttnServeQueueSaturated"} <= alerts


def test_the_charts_configs_are_valid_settings(tmp_path: Path) -> None:
    chart = DEPLOY / "helm" / "attnserve"
    for values in ("values.yaml", "values-gpu.yaml"):
        config = tmp_path / f"{values}.config.yaml"
        config.write_text(yaml.safe_dump(yaml.safe_load((chart / values).read_text())["config"]))
        loaded = load_settings(env={"ATTNSERVE_CONFIG": str(config)})
        assert loaded.max_connection_age_s == 120 and loaded.models[0].name == "default", values


def test_the_autoscaler_metrics_are_exported(default_server: Running) -> None:
    known = exported(default_server)
    chart = DEPLOY / "helm" / "attnserve"
    for values in ("values.yaml", "values-gpu.yaml"):
        metric = yaml.safe_load((chart / values).read_text())["autoscaling"]["metric"]["name"]
        assert metric in known, (values, metric)
    adapter = yaml.safe_load((DEPLOY / "helm" / "prometheus-adapter-values.yaml").read_text())
    series = adapter["rules"]["custom"][0]["seriesQuery"]
    assert {"attnserve_inflight_requests", "attnserve_queue_depth"} <= set(NAME.findall(series)) <= known
