"""CLI flags are made from the config dataclasses: every field is a flag with its help and default,
a flag reaches its field, and a bad flag of any kind is one line."""
import dataclasses
import typing

import pytest

from hybridspec.cli.flags import config_overrides
from hybridspec.cli.main import build_parser, main
from hybridspec.cloud.api.access import AccessSpec
from hybridspec.cloud.config import ServeConfig
from hybridspec.cloud.pool.specs import PoolSpec, ReplicaSpec
from hybridspec.common.config import Choice, load_config, settings_of
from hybridspec.distill.config import DistillConfig
from hybridspec.edge.config import EdgeConfig
from hybridspec.edge.serve.config import ServeOptions
from hybridspec.netem.config import NetemConfig

REQUIRED = {DistillConfig: {"target": "t", "out": "o"}}  # settings without a usable default
COMMANDS = [(["cloud", "serve"], ServeConfig), (["edge", "generate", "--prompt", "p"], EdgeConfig),
            (["edge", "serve"], EdgeConfig), (["edge", "serve"], ServeOptions), (["demo"], EdgeConfig),
            (["netem"], NetemConfig), (["distill"], DistillConfig)]


def _as_flags(f: dataclasses.Field, hint) -> tuple[list[str], object]:
    """Command-line words that set field `f` to a valid value, and the value the config should get."""
    flag = "--" + f.name.replace("_", "-")
    default = f.default
    if hint is bool:
        return [flag if not default else "--no-" + flag[2:]], not default
    if typing.get_origin(hint) is tuple:
        return [flag, "a", flag, "b"], ("a", "b")
    if isinstance(hint, type) and issubclass(hint, Choice):
        member = list(hint)[-1]
        return [flag, member.value], member
    if f.metadata.get("choices"):
        value = f.metadata["choices"][-1]
        return [flag, value], value
    if default is None:  # an optional number
        return [flag, "2"], (float if float in typing.get_args(hint) else int)(2)
    if isinstance(default, str):
        return [flag, default or "x"], default or "x"
    return [flag, str(default)], default


def _fields(cls):
    """Every setting's field and type (of every section, for a config made of sections)."""
    return [(f, hint) for _, f, hint in settings_of(cls).values()]


@pytest.mark.parametrize("argv, cls", COMMANDS, ids=lambda x: " ".join(x) if isinstance(x, list) else x.__name__)
def test_every_field_is_a_flag_that_reaches_its_field(argv, cls):
    parser = build_parser()
    for f, hint in _fields(cls):
        if (argv[:2], cls, f.name) == (["edge", "serve"], EdgeConfig, "insecure"):
            assert config_overrides(parser.parse_args(argv + ["--insecure"]), cls)["insecure"] is True
            continue  # ServeOptions' --insecure, which sets both
        words, expected = _as_flags(f, hint)
        args = parser.parse_args(argv + words)
        assert config_overrides(args, cls)[f.name] == expected, f.name
    # Flags not given are left out, so a --config file or the default applies.
    assert set(config_overrides(parser.parse_args(argv), cls)) == set()


@pytest.mark.parametrize("cls", [ServeConfig, EdgeConfig, ServeOptions, NetemConfig, DistillConfig])
def test_every_flag_says_what_it_does_and_its_default(cls):
    parser = build_parser()
    sub = {ServeConfig: "cloud serve", EdgeConfig: "edge generate", ServeOptions: "edge serve",
           NetemConfig: "netem", DistillConfig: "distill"}[cls].split()
    node = parser
    for word in sub:
        node = next(a for a in node._actions if a.dest.endswith("command")).choices[word]
    helps = {a.dest: a.help for a in node._actions}
    for f, _ in _fields(cls):
        assert len(f.metadata.get("help", "")) > 10, f"{cls.__name__}.{f.name} has no help"
        assert helps[f.name].startswith(f.metadata["help"].replace("%", "%%")), f.name
        if f.default not in ("", None, (), False, True):
            assert f"(default: {f.default})" in helps[f.name], f.name


def test_serve_config_hands_its_sections_to_the_specs_whole():
    """ServeConfig's access, pool, replica and limits sections are the components' own settings: the
    specs carry the very section objects (not copies of their fields), with the owners' defaults."""
    config = ServeConfig.of(replicas=2, replica_num_cpus=0.5, max_batch_size=4, credentials="tokens.yaml")
    assert config.access == AccessSpec(credentials="tokens.yaml")
    spec = config.pool_spec("t")
    assert spec.settings is config.pool and spec.replica.settings is config.replica
    assert spec.replica.limits is config.limits and spec.replica.target == "t"
    assert config.replica_endpoint().access is config.access
    assert ServeConfig().pool_spec("t") == PoolSpec(ReplicaSpec("t"))


@pytest.mark.parametrize("argv, fragment", [
    (["cloud", "serve", "--max-context", "0"], "max_context must be >= 1, got 0"),
    (["cloud", "serve", "--port", "70000"], "port must be in [0, 65535], got 70000"),
    (["cloud", "serve", "--stream-idle-s", "0"], "stream_idle_s must be > 0"),
    (["edge", "generate", "--prompt", "p", "--fallback-threshold", "1.5"], "fallback_threshold must be in [0, 1]"),
    (["distill", "--target", "t"], "target and out are required"),
    (["netem", "--up-delay-ms", "-1"], "delay_ms must be a finite number >= 0"),
])
def test_a_value_out_of_bounds_is_one_line(argv, fragment, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hybridspec: error:") and fragment in err[0], err


@pytest.mark.parametrize("argv, fragment", [
    (["cloud", "serve", "--backend", "k8s"], "argument --backend: invalid choice: 'k8s'"),
    (["cloud", "serve", "--replicas", "two"], "argument --replicas: invalid int value: 'two'"),
    (["edge", "generate"], "the following arguments are required: --prompt"),
    (["netem", "--profile", "moon"], "argument --profile: invalid choice"),
    (["cloud", "serve", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_a_flag_argparse_rejects_is_one_line_too(argv, fragment, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0] and err[0].endswith("--help)"), err


def test_flags_override_a_config_file_key_by_key(tmp_path):
    path = tmp_path / "edge.yaml"
    path.write_text("max_draft: 3\ntemperature: 0.5\n")
    args = build_parser().parse_args(["edge", "generate", "--prompt", "p", "--config", str(path), "--max-draft", "5"])
    config = load_config(EdgeConfig, args.config, config_overrides(args, EdgeConfig))
    assert (config.policy.max_draft, config.sampling.temperature) == (5, 0.5)
