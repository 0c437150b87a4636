"""Configs: the shipped YAML files load, and the local CPU file is what `cloud serve` uses by default."""
from pathlib import Path

import pytest

from hybridspec.cloud.config import ServeConfig
from hybridspec.common.config import ConfigError, load_config
from hybridspec.edge.config import EdgeConfig

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
                                           ({"metrics_port": -2}, "metrics_port"), ({"max_wait_ms": -1}, "max_wait_ms"),
                                           ({"replicas": "two"}, "replicas must be an integer, got 'two'"),
                                           ({"max_wait_ms": "fast"}, "max_wait_ms must be a number"),
                                           ({"ray_local_only": "yes"}, "ray_local_only must be true or false"),
                                           ({"replicas": True}, "replicas must be an integer"),
                                           ({"host": 7}, "host must be a string")])
def test_bad_values_name_the_key(bad, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_config(ServeConfig, None, bad)


@pytest.mark.parametrize("bad, fragment", [({"max_new_tokens": "eight"}, "max_new_tokens must be an integer"),
                                           ({"max_draft": 0}, "max_draft must be >= 1"),
                                           ({"temperature": "hot"}, "temperature must be a number"),
                                           ({"pipeline": 1}, "pipeline must be true or false")])
def test_bad_edge_values_are_one_clear_error(bad, fragment):
    from hybridspec.edge.config import EdgeConfig

    with pytest.raises(ConfigError, match=fragment):
        load_config(EdgeConfig, None, bad)


def test_an_int_where_a_number_is_wanted_is_fine():
    assert load_config(ServeConfig, None, {"max_wait_ms": 3}).max_wait_ms == 3.0


def test_edge_file_lists_every_knob_at_its_default():
    import dataclasses

    import yaml

    from hybridspec.edge.config import EdgeConfig

    raw = yaml.safe_load((DEPLOY / "edge.yaml").read_text())
    assert set(raw) == {f.name for f in dataclasses.fields(EdgeConfig)}
    assert load_config(EdgeConfig, DEPLOY / "edge.yaml") == EdgeConfig()


@pytest.mark.parametrize("cls, key, bad", [("ServeConfig", "backend", "kubernetes"), ("ServeConfig", "dtype", "int4"),
                                           ("EdgeConfig", "gamma_policy", "greedy"), ("EdgeConfig", "drafter_kind", "lm"),
                                           ("EdgeConfig", "features", "fp8"), ("EdgeConfig", "mode", "fast")])
def test_a_bad_choice_is_one_line_naming_the_choices(tmp_path, cls, key, bad):
    kind = {"ServeConfig": ServeConfig, "EdgeConfig": EdgeConfig}[cls]
    path = tmp_path / "c.yaml"
    path.write_text(f"{key}: {bad}\n")
    with pytest.raises(ConfigError) as info:
        load_config(kind, path)
    message = str(info.value)
    assert "\n" not in message and key in message and repr(bad) in message and "one of" in message
    # A good value becomes the enum member, which still reads and compares as its string.
    good = next(iter(type(getattr(kind(), key))))
    path.write_text(f"{key}: {good.value}\n")
    loaded = getattr(load_config(kind, path), key)
    assert loaded is good and loaded == good.value and str(loaded) == good.value


def test_the_acceptance_rule_is_a_choice_and_auto_keeps_its_old_spelling(tmp_path):
    """mode is an enum (auto or one of the rules); "" (auto before it had a name) still loads as auto."""
    from hybridspec.common.protocol.wire import Mode
    from hybridspec.edge.config import RuleChoice

    path = tmp_path / "edge.yaml"
    for spelled in ('""', "auto"):
        path.write_text(f"mode: {spelled}\n")
        assert load_config(EdgeConfig, path).mode is RuleChoice.AUTO
    assert EdgeConfig().resolved_mode is Mode.GREEDY
    assert EdgeConfig(temperature=0.7, seed=1).resolved().mode is RuleChoice.COUPLED
    assert EdgeConfig(mode="bild").resolved_mode is Mode.BILD
    assert {m.value for m in RuleChoice} == {"auto", *(m.value for m in Mode)}
