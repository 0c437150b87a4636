"""The monitoring half of the local stack (deploy/prometheus.yml, deploy/grafana/): Prometheus scrapes
the cloud and the edge where compose runs them, and the dashboard reads series the code exports."""
from __future__ import annotations

import json
import re

import yaml

from test_deploy import COMPOSE, DEPLOY, PROMETHEUS, cloud_serve_config, compose, container_ports, host_port, parse, service_argv


def test_prometheus_scrapes_the_cloud_and_the_edge_where_they_serve():
    services = compose()["services"]
    cloud = cloud_serve_config(service_argv("cloud")[0], services["cloud"].get("command", []))
    edge = parse(service_argv("edge")[1][1:])
    wanted = {("cloud", cloud.server.metrics_port), ("edge", edge.port)}
    config = yaml.safe_load(PROMETHEUS.read_text())
    targets = set()
    for job in config["scrape_configs"]:
        assert job.get("metrics_path", "/metrics") == "/metrics"
        for static in job["static_configs"]:
            for target in static["targets"]:
                host, port = host_port(target)
                assert host in services, f"{target}: no compose service {host}"
                targets.add((host, port))
    assert targets == wanted
    assert container_ports(services["prometheus"]) == {9090}


def test_grafana_reads_the_compose_prometheus():
    services = compose()["services"]
    mounts = [v for v in services["grafana"]["volumes"] if "/provisioning/datasources/" in v]
    assert len(mounts) == 1
    datasource = yaml.safe_load((COMPOSE.parent / mounts[0].split(":")[0]).read_text())
    url = datasource["datasources"][0]["url"]
    assert url == "http://prometheus:%d" % next(iter(container_ports(services["prometheus"])))


DASHBOARD = DEPLOY / "grafana" / "hybridspec.json"


def dashboard_queries() -> list[str]:
    """Every PromQL expression of the Grafana dashboard's panels."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [target["expr"] for panel in panels for target in panel.get("targets", [])]


def test_grafana_provisions_the_dashboard():
    services = compose()["services"]
    mounts = dict(v.rsplit(":", 1)[0].split(":", 1) for v in services["grafana"]["volumes"])
    provider = next(source for source, dest in mounts.items() if "/provisioning/dashboards/" in dest)
    path = yaml.safe_load((COMPOSE.parent / provider).read_text())["providers"][0]["options"]["path"]
    assert mounts["./grafana/hybridspec.json"] == f"{path}/hybridspec.json"
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "hybridspec" and dashboard_queries()
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}" and panel["fieldConfig"]["defaults"]["unit"]


def dashboard_metric_names() -> set[str]:
    """The hybridspec series names the dashboard's queries read."""
    return {name for expr in dashboard_queries() for name in re.findall(r"\bhybridspec_[a-z_]+", expr)}


def test_dashboard_reads_the_vllm_aligned_speculative_decoding_series():
    names = dashboard_metric_names()
    for wanted in ("hybridspec_spec_decode_num_accepted_tokens_total", "hybridspec_spec_decode_num_draft_tokens_total",
                   "hybridspec_spec_decode_num_drafts_total", "hybridspec_spec_decode_num_accepted_tokens_per_pos_total",
                   "hybridspec_time_to_first_token_seconds_bucket", "hybridspec_inter_token_latency_seconds_bucket",
                   "hybridspec_request_queue_time_seconds_bucket", "hybridspec_kv_cache_usage_perc"):
        assert wanted in names, wanted
