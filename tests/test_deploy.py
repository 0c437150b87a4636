"""The container files of the local stack (deploy/docker/*.Dockerfile, deploy/compose.yaml,
deploy/prometheus.yml): no image can be built in CI, so they are parsed and checked against the
repository, pyproject's console script and the CLI's real argument parser. No network, no docker."""
from __future__ import annotations

import dataclasses
import json
import re
import shlex
import tomllib
from pathlib import Path

import pytest
import yaml

from hybridspec.cli.main import build_parser

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
DOCKER = DEPLOY / "docker"
DOCKERFILES = sorted(DOCKER.glob("*.Dockerfile"))
COMPOSE = DEPLOY / "compose.yaml"
PROMETHEUS = DEPLOY / "prometheus.yml"


# ----------------------------------------------------------------------------------------------
# A small Dockerfile parser: comments dropped, backslash continuations joined, one
# (INSTRUCTION, argument text) per instruction.

def parse_dockerfile(path: Path) -> list[tuple[str, str]]:
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
            continue
        text = (pending + line).strip()
        pending = ""
        if text:
            word, _, rest = text.partition(" ")
            instructions.append((word.upper(), rest.strip()))
    assert not pending, f"{path.name}: a continuation runs off the end of the file"
    return instructions


def exec_form(path: Path, instruction: str, text: str) -> list[str]:
    """A JSON-array (exec form) instruction's argv."""
    try:
        argv = json.loads(text)
    except json.JSONDecodeError:
        pytest.fail(f"{path.name}: {instruction} must use the exec (JSON array) form, got {text!r}")
    assert isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv), (path.name, text)
    return argv


@dataclasses.dataclass
class Dockerfile:
    path: Path
    instructions: list[tuple[str, str]]

    def all(self, name: str) -> list[str]:
        return [text for word, text in self.instructions if word == name]

    def one(self, name: str) -> str:
        found = self.all(name)
        assert len(found) == 1, f"{self.path.name}: expected one {name}, found {len(found)}"
        return found[0]

    @property
    def entrypoint(self) -> list[str]:
        return exec_form(self.path, "ENTRYPOINT", self.one("ENTRYPOINT"))

    @property
    def exposed(self) -> set[int]:
        return {int(p.split("/")[0]) for text in self.all("EXPOSE") for p in text.split()}

    def copy_target(self, dest: str) -> Path:
        """The repository file a COPY put at `dest` in the image."""
        for text in self.all("COPY"):
            parts = [p for p in text.split() if not p.startswith("--")]
            if parts[-1] == dest:
                assert len(parts) == 2, text
                return ROOT / parts[0]
        pytest.fail(f"{self.path.name}: nothing is copied to {dest}")


def load(path: Path) -> Dockerfile:
    return Dockerfile(path, parse_dockerfile(path))


def by_name(name: str) -> Dockerfile:
    return load(DOCKER / name)


def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def parse(argv: list[str]):
    """The real CLI's parse of `hybridspec ARGV`; a rejected argument fails the test."""
    try:
        return build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse exits on a bad flag
        pytest.fail(f"hybridspec rejects {argv}: exit {exc.code}")


def host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def container_ports(service: dict) -> set[int]:
    """Container-side ports of a compose service's `ports` ("127.0.0.1:HOST:CONTAINER" strings): the
    stack runs plaintext with --insecure, so nothing may be published beyond the host's loopback."""
    ports = set()
    for mapping in service.get("ports", []):
        assert isinstance(mapping, str) and re.fullmatch(r"127\.0\.0\.1:\d+:\d+", mapping), \
            f"unexpected port mapping {mapping!r}: publish on 127.0.0.1 only"
        ports.add(int(mapping.split(":")[2]))
    return ports


def service_argv(name: str) -> tuple[Dockerfile | None, list[str]]:
    """(the Dockerfile a compose service builds, the full argv it runs)."""
    service = compose()["services"][name]
    dockerfile = load(ROOT / service["build"]["dockerfile"]) if "build" in service else None
    entrypoint = service.get("entrypoint") or (dockerfile.entrypoint if dockerfile else [])
    return dockerfile, list(entrypoint) + list(service.get("command", []))


# ----------------------------------------------------------------------------------------------
# Dockerfiles

def test_the_three_dockerfiles_exist():
    assert {p.name for p in DOCKERFILES} >= {"cloud.Dockerfile", "cloud-cpu.Dockerfile", "edge.Dockerfile"}


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_every_base_image_is_pinned_to_a_version_tag(path):
    froms = load(path).all("FROM")
    assert froms, f"{path.name} has no FROM"
    for text in froms:
        image = [w for w in text.split() if not w.startswith("--")][0]
        name, _, tag = image.rpartition(":") if ":" in image.split("/")[-1] else (image, "", "")
        assert tag, f"{path.name}: {image} has no tag"
        assert tag != "latest" and re.search(r"\d", tag), f"{path.name}: {image} is not pinned to a version"


def test_base_images_are_what_the_variants_promise():
    assert by_name("cloud.Dockerfile").one("FROM").startswith("nvidia/cuda:12.")
    assert "runtime-ubuntu" in by_name("cloud.Dockerfile").one("FROM")
    for name in ("cloud-cpu.Dockerfile", "edge.Dockerfile"):
        assert re.match(r"python:3\.11\.\d+-slim", by_name(name).one("FROM")), name


def pip_installs(dockerfile: Dockerfile) -> list[list[str]]:
    """The argument lists of every `pip install` in the RUN instructions."""
    installs = []
    for text in dockerfile.all("RUN"):
        for command in re.split(r"&&|;|\|\|", text):
            words = shlex.split(command)
            for i, word in enumerate(words):
                if word in ("pip", "pip3") or word.endswith(("/pip", "/pip3")):
                    if words[i + 1:i + 2] == ["install"]:
                        installs.append(words[i + 2:])
                elif word == "-m" and words[i + 1:i + 3] == ["pip", "install"]:
                    installs.append(words[i + 3:])
    return installs


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_every_pip_install_is_pinned_or_the_local_package(path):
    dockerfile = load(path)
    installs = pip_installs(dockerfile)
    assert installs, f"{path.name} installs nothing"
    with_value = {"--index-url", "-i", "--extra-index-url", "-c", "--constraint", "-r", "--requirement"}
    local = set()
    for text in dockerfile.all("COPY"):
        parts = [p for p in text.split() if not p.startswith("--")]
        local.add(parts[-1].rstrip("/"))
    workdirs = dockerfile.all("WORKDIR")
    for args in installs:
        assert not {"-r", "--requirement", "-e", "--editable"} & set(args), f"{path.name}: {args}"
        skip = False
        for arg in args:
            if skip:
                skip = False
                continue
            if arg in with_value:
                skip = True
                continue
            if arg.startswith("-"):
                continue
            if arg.startswith(("/", ".")):  # the local package: the folder the repo was copied into
                assert arg.rstrip("/") in workdirs or arg.rstrip("/") in local, f"{path.name}: {arg}"
                continue
            assert re.fullmatch(r"[A-Za-z0-9_.\-\[\]]+==[0-9][A-Za-z0-9.+]*", arg), \
                f"{path.name}: pip install {arg!r} is not pinned with =="


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_torch_is_pinned_in_pyprojects_range_from_the_right_index(path):
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    spec = next(d for d in pyproject["project"]["dependencies"] if d.startswith("torch"))
    low, high = re.fullmatch(r"torch>=([\d.]+),<=([\d.]+)", spec).groups()
    version = lambda s: tuple(int(x) for x in s.split("."))  # noqa: E731
    torch = [args for args in pip_installs(load(path)) if any(a.startswith("torch==") for a in args)]
    assert len(torch) == 1, f"{path.name}: torch must be installed once, on its own, before the package"
    args = torch[0]
    pinned = next(a for a in args if a.startswith("torch=="))[len("torch=="):]
    assert version(low) <= version(pinned) <= version(high), (pinned, spec)
    index = args[args.index("--index-url") + 1]
    wanted = "/whl/cu" if path.name == "cloud.Dockerfile" else "/whl/cpu"
    assert index.startswith("https://download.pytorch.org/whl/") and wanted in index, (path.name, index)
    if path.name != "cloud.Dockerfile":
        assert pinned == "2.13.0"
    installs = pip_installs(load(path))
    package = next(i for i, a in enumerate(installs) if any(x.startswith("/") for x in a))
    assert installs.index(args) < package, f"{path.name}: torch must be installed before the package"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_the_package_install_can_compile_llama_cpp_portably(path):
    """llama-cpp-python is an sdist: the step installing the package needs a compiler and CMake, and
    an image must not be tuned to the CPU of the machine that built it."""
    step = next(text for text in load(path).all("RUN") if re.search(r"pip3? install /", text))
    assert "build-essential" in step and "cmake" in step, path.name
    assert "-DGGML_NATIVE=OFF" in step, path.name


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_copied_sources_exist_and_cover_every_package_dir(path):
    dockerfile = load(path)
    sources = set()
    for text in dockerfile.all("COPY"):
        parts = [p for p in text.split() if not p.startswith("--")]
        for source in parts[:-1]:
            assert (ROOT / source).exists(), f"{path.name}: COPY {source}: no such file in the repository"
            sources.add(source.rstrip("/"))
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    needed = set(pyproject["tool"]["setuptools"]["package-dir"].values()) | {"pyproject.toml", pyproject["project"]["readme"]}
    assert needed <= sources, f"{path.name} does not copy {sorted(needed - sources)}"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_runs_as_a_non_root_user_and_pulls_the_models_as_it(path):
    instructions = load(path).instructions
    words = [w for w, _ in instructions]
    entry = words.index("ENTRYPOINT")
    users = [(i, text) for i, (w, text) in enumerate(instructions) if w == "USER" and i < entry]
    assert users, f"{path.name}: no USER before ENTRYPOINT"
    user = users[-1][1].split(":")[0]
    assert user not in ("root", "0"), f"{path.name} runs as root"
    assert "USER" not in words[entry:], f"{path.name}: a USER after the ENTRYPOINT"
    pulls = [i for i, (w, text) in enumerate(instructions) if w == "RUN" and "hybridspec models pull" in text]
    assert len(pulls) == 1 and users[-1][0] < pulls[0] < entry, f"{path.name}: models must be pulled as {user}"
    env = " ".join(load(path).all("ENV"))
    assert f"HYBRIDSPEC_HOME=/home/{user}/" in env, f"{path.name}: models belong in the user's home"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_entrypoint_is_the_console_script_and_the_cli_accepts_it(path):
    argv = load(path).entrypoint
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert argv[0] in scripts and scripts[argv[0]] == "hybridspec.cli.main:main"
    args = parse(argv[1:])
    assert args.host == "0.0.0.0", f"{path.name} must listen on every interface of the container"
    if argv[1:3] == ["cloud", "serve"]:
        assert args.direct_verify is False, "replicas' own (free) ports cannot be EXPOSEd"
    else:
        assert argv[1:3] == ["edge", "serve"], argv


def cloud_serve_config(dockerfile: Dockerfile, extra: list[str] = ()):
    """The ServeConfig a cloud image runs with: its ENTRYPOINT (plus `extra`), its --config read
    from the repository file the Dockerfile copies there."""
    from hybridspec.cli.cloud_cmd import serve_config

    args = parse(dockerfile.entrypoint[1:] + list(extra))
    assert args.config, "the cloud images give a --config"
    args.config = str(dockerfile.copy_target(args.config))
    return serve_config(args)


@pytest.mark.parametrize("name", ["cloud.Dockerfile", "cloud-cpu.Dockerfile"])
def test_cloud_image_refuses_plaintext_on_every_interface_unless_told(name):
    from hybridspec.common.config import ConfigError

    dockerfile = by_name(name)
    with pytest.raises(ConfigError, match="0.0.0.0 without TLS.*--insecure"):
        cloud_serve_config(dockerfile)
    tls = ["--tls-cert", "/etc/hybridspec/tls/tls.crt", "--tls-key", "/etc/hybridspec/tls/tls.key"]
    assert cloud_serve_config(dockerfile, tls).access.tls.enabled
    assert not cloud_serve_config(dockerfile, ["--insecure"]).access.tls.enabled


@pytest.mark.parametrize("name", ["cloud.Dockerfile", "cloud-cpu.Dockerfile"])
def test_cloud_image_exposes_exactly_the_ports_it_serves(name):
    dockerfile = by_name(name)
    config = cloud_serve_config(dockerfile, ["--insecure"])
    assert config.server.host == "0.0.0.0" and config.server.metrics_host == "0.0.0.0"
    assert (config.server.port, config.server.metrics_port) == (50051, 9464)  # the CLI's defaults
    assert dockerfile.exposed == {config.server.port, config.server.metrics_port}
    assert config.server.direct_verify is False
    assert config.replica.device == ("cuda" if name == "cloud.Dockerfile" else "cpu")
    # readiness over plain HTTP on the metrics port: still works once gRPC needs TLS and a token
    healthcheck = dockerfile.one("HEALTHCHECK")
    assert f"http://127.0.0.1:{config.server.metrics_port}/health/ready" in healthcheck


def test_edge_image_exposes_the_port_it_serves():
    dockerfile = by_name("edge.Dockerfile")
    args = parse(dockerfile.entrypoint[1:] + ["--cloud", "cloud:50051"])
    assert args.port == 8000  # the CLI's default
    assert dockerfile.exposed == {args.port}
    assert f"127.0.0.1:{args.port}/health" in dockerfile.one("HEALTHCHECK")


# ----------------------------------------------------------------------------------------------
# compose.yaml

def test_compose_has_the_stack():
    services = compose()["services"]
    assert set(services) == {"cloud", "netem", "edge", "prometheus", "grafana"}
    assert services["cloud"]["build"]["dockerfile"] == "deploy/docker/cloud-cpu.Dockerfile"
    assert services["edge"]["build"]["dockerfile"] == "deploy/docker/edge.Dockerfile"


def test_compose_files_exist():
    for name, service in compose()["services"].items():
        if "build" in service:
            context = (COMPOSE.parent / service["build"]["context"]).resolve()
            assert context == ROOT, name
            assert (context / service["build"]["dockerfile"]).is_file(), name
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            assert source.startswith("."), f"{name}: only bind mounts of repository files, got {volume}"
            assert (COMPOSE.parent / source).is_file(), f"{name}: {source} does not exist"


def test_compose_images_are_pinned():
    for name, service in compose()["services"].items():
        image = service.get("image", "")
        if "build" in service:
            assert image.startswith("hybridspec-"), name  # built here, tagged locally
            continue
        tag = image.rpartition(":")[2] if ":" in image else ""
        assert tag and tag != "latest" and re.search(r"\d", tag), f"{name}: {image!r} is not pinned"


def test_compose_commands_parse_and_ports_line_up():
    services = compose()["services"]

    cloud_file, cloud_argv = service_argv("cloud")
    assert cloud_argv[0] == "hybridspec"
    cloud = cloud_serve_config(cloud_file, services["cloud"].get("command", []))
    assert container_ports(services["cloud"]) == {cloud.server.port, cloud.server.metrics_port} == cloud_file.exposed

    _, netem_argv = service_argv("netem")
    assert netem_argv[:2] == ["hybridspec", "netem"]
    netem = parse(netem_argv[1:])
    listen_host, listen_port = host_port(netem.listen)
    assert listen_host == "0.0.0.0"
    assert host_port(netem.upstream) == ("cloud", cloud.server.port)
    assert container_ports(services["netem"]) == {listen_port}
    assert netem.delay_ms and netem.delay_ms > 0

    edge_file, edge_argv = service_argv("edge")
    edge = parse(edge_argv[1:])
    assert host_port(edge.cloud) == ("netem", listen_port)
    assert container_ports(services["edge"]) == {edge.port} == edge_file.exposed

    # the configs these flags produce are valid, not only parseable
    from hybridspec.cli.edge_options import edge_config
    from hybridspec.common.config import load_config
    from hybridspec.cli.flags import config_overrides
    from hybridspec.netem.config import NetemConfig

    assert edge_config(edge).link.cloud == "netem:%d" % listen_port
    assert load_config(NetemConfig, None, config_overrides(netem, NetemConfig)).upstream == netem.upstream


def test_compose_start_order():
    services = compose()["services"]
    assert services["netem"]["depends_on"]["cloud"]["condition"] == "service_healthy"
    assert services["edge"]["depends_on"]["netem"]["condition"] == "service_healthy"


def test_the_gpu_image_keeps_a_c_compiler_for_triton_at_run_time():
    """Triton compiles its kernel launcher when a replica first runs the GPU engine: gcc and the Python
    headers are installed on their own (not only as build-essential, which the build step purges)."""
    runtime = next(text for text in by_name("cloud.Dockerfile").all("RUN") if "python3.11-venv" in text)
    assert "gcc" in runtime.split() and "python3.11-dev" in runtime.split()
