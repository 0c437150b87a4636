"""Configs: the shipped YAML files load, and the local CPU file is what `cloud serve` uses by default."""
from pathlib import Path

import pytest

from hybridspec.cloud.config import ServeConfig
from hybridspec.common.config import ConfigError, flat_settings, load_config, settings_of
from hybridspec.edge.config import EdgeConfig

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def test_local_cpu_file_equals_the_defaults():
    assert load_config(ServeConfig, DEPLOY / "local-cpu.yaml") == ServeConfig()


def test_gpu_cluster_file_loads():
    config = load_config(ServeConfig, DEPLOY / "gpu-cluster.yaml")
    assert config.pool.replica_num_gpus == 1 and config.pool.ray_address == "auto"
    assert config.replica.device == "cuda"


def test_flags_override_the_file():
    config = load_config(ServeConfig, DEPLOY / "gpu-cluster.yaml", {"replicas": 2, "port": None})
    assert config.pool.replicas == 2 and config.server.port == 50051


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
    assert load_config(ServeConfig, None, {"max_wait_ms": 3}).replica.max_wait_ms == 3.0


def test_edge_file_lists_every_knob_at_its_default():
    import dataclasses

    import yaml

    from hybridspec.edge.config import EdgeConfig

    raw = yaml.safe_load((DEPLOY / "edge.yaml").read_text())
    assert set(raw) == {f.name for f in dataclasses.fields(EdgeConfig)}  # every section, nested
    for section, values in raw.items():
        assert set(values) == {f.name for f in dataclasses.fields(getattr(EdgeConfig(), section))}, section
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
    good = next(iter(type(flat_settings(kind())[key])))
    path.write_text(f"{key}: {good.value}\n")
    loaded = flat_settings(load_config(kind, path))[key]
    assert loaded is good and loaded == good.value and str(loaded) == good.value


def test_the_acceptance_rule_is_a_choice_and_auto_keeps_its_old_spelling(tmp_path):
    """mode is an enum (auto or one of the rules); "" (auto before it had a name) still loads as auto."""
    from hybridspec.common.protocol.wire import Mode
    from hybridspec.edge.config import RuleChoice

    path = tmp_path / "edge.yaml"
    for spelled in ('""', "auto"):
        path.write_text(f"mode: {spelled}\n")
        assert load_config(EdgeConfig, path).generation.mode is RuleChoice.AUTO
    assert EdgeConfig().resolved_mode is Mode.GREEDY
    assert EdgeConfig.of(temperature=0.7, seed=1).resolved().generation.mode is RuleChoice.COUPLED
    assert EdgeConfig.of(mode="bild").resolved_mode is Mode.BILD
    assert {m.value for m in RuleChoice} == {"auto", *(m.value for m in Mode)}


def test_an_edge_file_may_nest_settings_under_their_section_or_give_them_flat(tmp_path):
    """`policy: {max_draft: 4}` and `max_draft: 4` say the same; flags still override either."""
    nested, flat = tmp_path / "nested.yaml", tmp_path / "flat.yaml"
    nested.write_text("policy:\n  max_draft: 4\n  pipeline: false\nsampling: {temperature: 0.5}\nseed: 3\n")
    flat.write_text("max_draft: 4\npipeline: false\ntemperature: 0.5\nseed: 3\n")
    expected = EdgeConfig.of(max_draft=4, pipeline=False, temperature=0.5, seed=3)
    assert load_config(EdgeConfig, nested) == load_config(EdgeConfig, flat) == expected
    assert expected.policy.max_draft == 4 and expected.sampling.temperature == 0.5 and expected.generation.seed == 3
    assert load_config(EdgeConfig, nested, {"max_draft": 6}).policy.max_draft == 6
    assert EdgeConfig.of(policy={"max_draft": 4}, temperature=0.5).updated(seed=3, pipeline=False) == expected
    nested.write_text("policy:\n  # max_draft: 4\nlink:\n")  # sections whose keys are all commented out
    assert load_config(EdgeConfig, nested) == EdgeConfig()


@pytest.mark.parametrize("text, fragment", [
    ("policy:\n  max_drafts: 4\n", "unknown config key(s) for EdgeConfig: policy.max_drafts"),
    ("sampling:\n  max_draft: 4\n", "unknown config key(s) for EdgeConfig: sampling.max_draft"),  # wrong section
    ("polcy:\n  max_draft: 4\n", "unknown config key(s) for EdgeConfig: polcy"),
    ("policy: 4\n", "section policy must be a mapping"),
    ("policy:\n  max_draft: zero\n", "max_draft must be an integer, got 'zero'"),
    ("policy:\n  max_draft: 0\n", "max_draft must be >= 1, got 0"),
    ("generation:\n  stop: [\"\"]\n", "stop takes at most"),
])
def test_a_bad_nested_key_or_value_is_one_line_naming_it(tmp_path, text, fragment):
    path = tmp_path / "edge.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(EdgeConfig, path)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_every_setting_name_is_unique_across_sections():
    """One flag and one flat key per setting: a name in two sections (or naming a section) could not say
    which it sets. settings_of refuses such a config; this checks the real ones hold no such name."""
    import dataclasses

    from hybridspec.common.config import Sections, sections_of

    for cls in (EdgeConfig, ServeConfig):
        names = [f.name for kind in (sections_of(cls) or {None: cls}).values() for f in dataclasses.fields(kind)]
        assert len(names) == len(set(names)) and not set(names) & set(sections_of(cls)), cls.__name__
        assert list(settings_of(cls)) == names

    @dataclasses.dataclass(frozen=True)
    class A:
        x: int = 1

    @dataclasses.dataclass(frozen=True)
    class B:
        x: int = 2

    @dataclasses.dataclass(frozen=True)
    class Twice(Sections):
        a: A = A()
        b: B = B()

    with pytest.raises(TypeError, match="setting x is named twice"):
        settings_of(Twice)


def test_components_receive_their_section_whole():
    """The sections are the components' own specs: what the drafters, the controller and the verifier's
    sampling get is the config's section itself, not a copy of its fields."""
    from hybridspec.common.protocol.wire import SamplingParams
    from hybridspec.edge.controller import PolicySettings
    from hybridspec.edge.proposal import Drafting

    config = EdgeConfig.of(wire_top_k=8, max_draft=3, temperature=0.5)
    assert isinstance(config.drafting, Drafting) and isinstance(config.policy, PolicySettings)
    assert isinstance(config.sampling, SamplingParams)
    assert config.draft_settings(100, frozenset()).drafting is config.drafting
    assert config.draft_settings(100, frozenset()).sampling is config.sampling


def test_serve_sections_are_the_cloud_components_own_settings():
    """Each ServeConfig section but the front door's is declared beside the component it configures
    (no copy of its fields in cloud/config.py), and a nested or flat YAML file still loads into it."""
    from hybridspec.cloud.api.access import AccessSpec
    from hybridspec.cloud.config import ServerSettings
    from hybridspec.cloud.core.limits import VerifierLimits
    from hybridspec.cloud.pool.specs import PoolSettings, ReplicaSettings
    from hybridspec.common.config import sections_of

    assert sections_of(ServeConfig) == {"server": ServerSettings, "access": AccessSpec, "pool": PoolSettings,
                                        "replica": ReplicaSettings, "limits": VerifierLimits}
    nested = load_config(ServeConfig, None, {"pool": {"replica_num_cpus": 0.5, "replica_niceness": 3},
                                              "replica": {"max_batch_size": 4}, "access": {"stream_idle_s": 9}})
    flat = load_config(ServeConfig, None, {"replica_num_cpus": 0.5, "replica_niceness": 3, "max_batch_size": 4,
                                            "stream_idle_s": 9})
    assert nested == flat == ServeConfig(pool=PoolSettings(replica_num_cpus=0.5, replica_niceness=3),
                                         replica=ReplicaSettings(max_batch_size=4), access=AccessSpec(stream_idle_s=9))


@pytest.mark.parametrize("cls", [EdgeConfig, ServeConfig])
def test_a_device_is_checked_when_the_config_is_read(cls):
    """Not an enum (cuda:N names any GPU), but no longer any string: a typo is one line, not a torch error."""
    for good in ("auto", "cpu", "cuda", "cuda:1"):
        assert flat_settings(load_config(cls, None, {"device": good}))["device"] == good
    for bad in ("gpu", "cuda:", "CPU", "cuda:x"):
        with pytest.raises(ConfigError, match=f"device must be auto, cpu, cuda or cuda:N, got '{bad}'"):
            load_config(cls, None, {"device": bad})
