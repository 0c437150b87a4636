"""Configs: the shipped YAML files load, and the local CPU file is what `cloud serve` uses by default."""
from pathlib import Path

import pytest

from hybridspec.cloud.config import ServeConfig
from hybridspec.common.config import ConfigError, load_config

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def test_local_cpu_file_equals_the_defaults():
    assert load_config(ServeConfig, DEPLOY / "local-cpu.yaml") == ServeConfig()


def test_gpu_cluster_file_loads():
    config = load_config(ServeConfig, DEPLOY / "gpu-cluster.yaml")
    assert config.replica_num_gpus == 1 and config.ray_address == "auto" and config.device == "cuda"


def test_flags_override_the_file():
    config = load_config(ServeConfig, DEPLOY / "gpu-cluster.yaml", {"replicas": 2, "port": None})
    assert config.replicas == 2 and config.port == 50051


@pytest.mark.parametrize("bad, fragment", [({"backend": "serve"}, "backend"), ({"replicas": 0}, "replicas"),
                                           ({"metrics_port": -2}, "metrics_port"), ({"max_wait_ms": -1}, "max_wait_ms")])
def test_bad_values_name_the_key(bad, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_config(ServeConfig, None, bad)


def test_edge_file_lists_every_knob_at_its_default():
    import dataclasses

    import yaml

    from hybridspec.edge.config import EdgeConfig

    raw = yaml.safe_load((DEPLOY / "edge.yaml").read_text())
    assert set(raw) == {f.name for f in dataclasses.fields(EdgeConfig)}
    assert load_config(EdgeConfig, DEPLOY / "edge.yaml") == EdgeConfig()
