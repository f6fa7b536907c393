"""deploy/ monitoring: the Grafana dashboard's queries parse (promtool, from the `prometheus`
package) and name only metrics the processes export; the scrape config validates; compose has
the `monitoring` profile services."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kernel import metrics

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "asyncrl.json"
needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None,
    reason="promtool is not installed (apt-get install -y prometheus; .ci/run does)",
)


def panel_queries(dash: dict) -> list[tuple[str, str]]:
    out = []
    for p in dash["panels"]:
        for t in p.get("targets", []):
            out.append((p["title"], t["expr"]))
    return out


def exported_series() -> set[str]:
    return {s for fam in metrics.EXPORTED for s in metrics.series(fam)}


def names_in(expr: str) -> set[str]:
    return set(re.findall(r"\basyncrl_[a-z0-9_]+", expr))


def check_with_promtool(queries: list[tuple[str, str]], tmp_path: Path) -> subprocess.CompletedProcess:
    """Each query as a recording rule: `promtool check rules` parses every expression."""
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:panel_{i}", "expr": expr} for i, (_t, expr) in enumerate(queries)
                ],
            }
        ]
    }
    f = tmp_path / "rules.yml"
    f.write_text(json.dumps(rules))  # JSON is YAML
    return subprocess.run(["promtool", "check", "rules", str(f)], capture_output=True, text=True)


def test_dashboard_names_only_exported_metrics():
    queries = panel_queries(json.loads(DASHBOARD.read_text()))
    assert len(queries) >= 10
    known = exported_series()
    for title, expr in queries:
        names = names_in(expr)
        assert names, f"panel {title!r} names no asyncrl metric: {expr}"
        assert names <= known, f"panel {title!r} names metrics nobody exports: {sorted(names - known)}"
    # the dashboard covers what the issue asks to watch
    used = set().union(*(names_in(e) for _t, e in queries))
    for fam in (
        "asyncrl_versions_published_total",
        "asyncrl_versions_applied_total",
        "asyncrl_deltas_refused_total",
        "asyncrl_update_stall_seconds_bucket",
        "asyncrl_publish_to_patched_seconds_bucket",
        "asyncrl_tokens_generated_total",
        "asyncrl_rollouts_scored_total",
        "asyncrl_dlq_parked_total",
        "asyncrl_consumer_pending_messages",
    ):
        assert fam in used, fam


def test_name_check_catches_an_unknown_metric():
    assert not names_in("rate(asyncrl_tokens_genrated_total[1m])") <= exported_series()


@needs_promtool
def test_dashboard_queries_parse(tmp_path):
    queries = panel_queries(json.loads(DASHBOARD.read_text()))
    r = check_with_promtool(queries, tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    bad = check_with_promtool(
        [("broken", "sum by (le (rate(asyncrl_update_stall_seconds_bucket[5m]))")], tmp_path
    )
    assert bad.returncode != 0


@needs_promtool
def test_scrape_config_validates():
    r = subprocess.run(
        ["promtool", "check", "config", "--syntax-only", str(DEPLOY / "prometheus" / "prometheus.yml")],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.skipif(
    shutil.which("docker-compose") is None, reason="no compose validator: apt-get install docker-compose"
)
def test_compose_monitoring_profile(tmp_path):
    r = subprocess.run(
        ["docker-compose", "-f", str(DEPLOY / "docker-compose.yml"), "--profile", "monitoring", "config"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    import yaml

    services = yaml.safe_load(r.stdout)["services"]
    assert {"prometheus", "grafana"} <= set(services)
    assert services["prometheus"]["profiles"] == ["monitoring"]
