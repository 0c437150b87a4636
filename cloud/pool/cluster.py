"""Starting or joining the Ray cluster: explicitly, in bounded time, and with one line when it fails.

With no address the pool starts a local cluster of its own, whatever RAY_ADDRESS or a stale
`ray_current_cluster` file says: `ray.init()` with no address would join the cluster those name, and
on one that is gone it tries 20 times, about 40 s each, printing only Ray's warnings. With an
address it joins that cluster, but first checks, within a bounded time, that something listens
there and that a Ray head answers and accepts this process's credentials.

Token authentication. A cluster started here keeps Ray's token authentication on, with a token made
for this run and held only in the environment of this process and the Ray processes it starts: Ray
itself would write it to ~/.ray/auth_token, and a plain `ray start --head` on the same machine then
turns token authentication on because that file exists, while a plain `ray start --address` and a
`cloud serve --ray-address` do not, so they fail with InvalidAuthToken. A joined cluster's mode is
the operator's: RAY_AUTH_MODE=token with the cluster's token (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or
~/.ray/auth_token), exactly as `ray start --address` needs on a node of that cluster.
"""
from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import ray
from ray._private import ray_constants, services
from ray._private.authentication.authentication_token_generator import generate_new_authentication_token
from ray._private.authentication.authentication_token_setup import AUTH_MODE_ENV_VAR
from ray._private.authentication.authentication_token_setup import _enable_token_auth as enable_token_auth
from ray._private.authentication.authentication_token_setup import maybe_enable_token_auth_if_token_available
from ray._raylet import AuthenticationTokenLoader, GcsClient
from ray.exceptions import AuthenticationError

from ...common.protocol.errors import Unavailable

log = logging.getLogger(__name__)

LOCAL = "local"  # ray.init's own word for "start a new local cluster": it ignores RAY_ADDRESS and the address file
# A local cluster runs replica actors only, never tasks: Ray's workers prestarted for tasks would sit idle
# beside them, each polling for about 1 % of a core (measured on a one-core cloud host, where a
# replica then decodes that much slower). Ray starts an actor's worker when it is created either way.
LOCAL_SYSTEM_CONFIG = {"prestart_worker_first_driver": False, "enable_worker_prestart": False}
# Read by Ray's log monitor, which a local cluster inherits this process's environment for. It forwards
# workers' output to drivers that ask for it (log_to_driver), which the pool never does, yet under this
# many log files it lists the log directory every 0.1 s: about 1 % of a one-core cloud host's core,
# half of that with the listing every 0.5 s instead (Ray's LOG_NAME_UPDATE_INTERVAL_S). An operator's
# own setting wins.
LOCAL_ENV = {"RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0"}
TOKEN_ENV = "RAY_AUTH_TOKEN"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
CONNECT_TIMEOUT_S = 5.0  # a TCP connection to the head's port: anything alive there answers at once
CHILD_START_S = 10.0  # on top of the join timeout: the head check's child process imports Ray's core
AUTH_HELP = ("export RAY_AUTH_MODE=token and give it the cluster's token as RAY_AUTH_TOKEN, in the file "
             "RAY_AUTH_TOKEN_PATH names, or in ~/.ray/auth_token (`ray get-auth-token` on the head prints it)")


class ClusterUnavailable(Unavailable):
    """The Ray cluster could not be started or joined; the message names the address and the likely cause."""


def start_local(attempts: int = 2, local_only: bool = True, **init_kwargs) -> None:
    """Start a local cluster for this process (call on the main thread, where Ray installs its signal
    handlers), with token authentication unless the operator set RAY_AUTH_MODE otherwise.

    local_only: no other node may join, and every Ray process listens on 127.0.0.1 only (Ray's
    single-machine mode; on Linux it is off by default and read from the environment, by the Ray
    processes themselves and, once at import, by this one).
    """
    inherited = os.environ.pop(ray_constants.RAY_ADDRESS_ENVIRONMENT_VARIABLE, None)
    if inherited:
        log.warning("ignoring RAY_ADDRESS=%s: with no ray_address this server starts its own local Ray cluster "
                    "(set ray_address / --ray-address to join one)", inherited)
    _local_token_auth()
    for name, value in LOCAL_ENV.items():
        os.environ.setdefault(name, value)
    if local_only:
        os.environ[ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR] = "0"
        ray_constants.ENABLE_RAY_CLUSTER = False
    _init(attempts, "could not start a local Ray cluster", address=LOCAL,
          _system_config=LOCAL_SYSTEM_CONFIG, **init_kwargs)


def join(address: str, timeout_s: float, **init_kwargs) -> None:
    """Join the cluster at `address` (HOST:PORT of its head, "auto", or ray://HOST:PORT), or fail with
    one line within about CONNECT_TIMEOUT_S + timeout_s."""
    target = resolve(address)
    source = _auto_source(target) if address == "auto" else ""
    named = target if target == address else f"{target} (ray_address {address}{source and ', from ' + source})"
    client = target.startswith("ray://")
    if address == "auto" and not os.environ.get(ray_constants.RAY_ADDRESS_ENVIRONMENT_VARIABLE):
        # As ray.init("auto") does for a cluster it found on this machine (and never for an address
        # given): token authentication on if RAY_AUTH_MODE is unset and a token is at hand.
        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    host, port = _host_port(target.removeprefix("ray://"), address)
    reach(host, port, named, stale_file=source == _address_file())
    if not client:
        check_head(target, named, timeout_s)
    _init(1, f"could not join the Ray cluster at {named}", address=target, **init_kwargs)


def resolve(address: str) -> str:
    """The address ray.init will dial for `address`: "auto" as Ray resolves it (RAY_ADDRESS, then the
    address file of the last `ray start`, then a running head found among this machine's processes)."""
    if address.startswith("ray://"):
        return address
    try:
        resolved = services.canonicalize_bootstrap_address(address)
    except ConnectionError:
        raise ClusterUnavailable(f"ray_address {address}: no Ray cluster found on this machine (no RAY_ADDRESS, no "
                                 f"{_address_file()}, no running Ray head); start one with `ray start --head` or "
                                 "give its HOST:PORT") from None
    except ValueError as exc:
        raise ClusterUnavailable(f"ray_address {address!r} is not HOST:PORT, auto or ray://HOST:PORT: {exc}") from None
    if resolved is None:  # "local": the caller asked for a cluster of its own, not to join one
        raise ClusterUnavailable(f"ray_address {address!r} names no cluster to join; leave it empty to start one")
    return resolved


def reach(host: str, port: int, named: str, stale_file: bool = False) -> None:
    """ClusterUnavailable, naming the cause, unless a TCP connection to host:port opens in CONNECT_TIMEOUT_S."""
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S):
            return
    except TimeoutError:
        why = f"no answer within {CONNECT_TIMEOUT_S:.0f} s (a firewall, or a host that is down)"
    except ConnectionRefusedError:
        why = "connection refused: no Ray head listens on that port"
        if stale_file:
            why += ("; that file may name a head that ended without `ray stop`: start the cluster again, or give "
                    "ray_address explicitly")
    except OSError as exc:
        why = exc.strerror or str(exc)
    raise ClusterUnavailable(f"cannot reach the Ray cluster at {named}: {why}")


def check_head(address: str, named: str, timeout_s: float) -> None:
    """Ask the head's GCS whether it is alive, from a child process given `timeout_s`: Ray's client
    retries for minutes on a port that is open but not a head's, and its C++ side prints warnings on
    stderr while it does (the child's stderr is dropped; its one-line verdict is read)."""
    try:
        done = subprocess.run([sys.executable, "-m", __name__, address, str(timeout_s)], capture_output=True,
                              text=True, timeout=timeout_s + CHILD_START_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        done = None
    if done is None or done.stdout.strip() == "timeout":
        raise ClusterUnavailable(f"no Ray head answered at {named} within {timeout_s:.0f} s: something listens "
                                 "there, but not a Ray head (the port `ray start --head --port` was given?), or "
                                 "the head is overloaded (raise ray_join_timeout_s)") from None
    verdict, _, message = done.stdout.strip().partition(" ")
    if verdict == "auth":
        raise ClusterUnavailable(f"the Ray cluster at {named} refused this process (InvalidAuthToken): {auth_state()}")
    if verdict != "alive":
        raise ClusterUnavailable(f"could not join the Ray cluster at {named}: "
                                 f"{message or (done.stderr.strip().splitlines() or ['no answer'])[-1]}")


def explain(exc: BaseException, named: str) -> ClusterUnavailable:
    """One line for a failure to join `named`: an authentication failure names what this process
    presented; anything else gives Ray's innermost message."""
    if _is_auth_failure(exc):
        return ClusterUnavailable(f"the Ray cluster at {named} refused this process (InvalidAuthToken): {auth_state()}")
    return ClusterUnavailable(f"could not join the Ray cluster at {named}: {last_line(exc)}")


def auth_state() -> str:
    """What this process presents to a Ray cluster with token authentication, and what to change."""
    mode = os.environ.get(AUTH_MODE_ENV_VAR)
    if (mode or "").lower() != "token":
        shown = f"RAY_AUTH_MODE={mode}" if mode else "RAY_AUTH_MODE is unset"
        return f"the cluster uses token authentication and this process sends no token ({shown}): {AUTH_HELP}"
    if os.environ.get(TOKEN_ENV):
        source = "the token in RAY_AUTH_TOKEN"
    elif os.environ.get(TOKEN_PATH_ENV):
        source = f"the token in {os.environ[TOKEN_PATH_ENV]} (RAY_AUTH_TOKEN_PATH)"
    elif _default_token_file().exists():
        source = f"the token in {_default_token_file()}"
    else:
        return f"RAY_AUTH_MODE=token but no token was found: {AUTH_HELP}"
    return f"it does not accept {source}: give this process the cluster's own token (`ray get-auth-token` on the head)"


def last_line(exc: BaseException) -> str:
    """The innermost error of a Ray failure, without Ray's traceback text."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


def _init(attempts: int, failure: str, **kwargs) -> None:
    """ray.init, tried again while attempts are left: on a loaded machine a local raylet can miss Ray's
    fixed 30 s registration window."""
    for attempt in range(attempts):
        try:
            ray.init(**kwargs)
            return
        except Exception as exc:  # Ray raises a bare Exception for a node that timed out starting
            ray.shutdown()
            if _is_auth_failure(exc):
                raise explain(exc, kwargs["address"]) from None
            if attempt == attempts - 1:
                raise ClusterUnavailable(f"{failure}: {last_line(exc)}") from None
            log.warning("Ray did not start (%s); trying again", last_line(exc))


def _local_token_auth() -> None:
    """Token authentication for a cluster this process starts, unless RAY_AUTH_MODE says otherwise,
    with a token that never touches the disk unless the operator provided one."""
    mode = os.environ.get(AUTH_MODE_ENV_VAR)
    if mode is not None and mode.lower() != "token":
        return  # the operator turned it off
    if not (os.environ.get(TOKEN_ENV) or os.environ.get(TOKEN_PATH_ENV) or _default_token_file().exists()):
        # Inherited by the GCS, the raylet and the workers, which is where the cluster needs it.
        os.environ[TOKEN_ENV] = generate_new_authentication_token()
        AuthenticationTokenLoader.instance().reset_cache()
    # The mode, in the environment and in Ray's cached config: set before ray.init, which would otherwise
    # turn it on itself and warn "Token authentication is enabled..." on every start.
    enable_token_auth()


def _is_auth_failure(exc: BaseException | None) -> bool:
    while exc is not None:
        if isinstance(exc, AuthenticationError) or "InvalidAuthToken" in str(exc) \
                or "no authentication token was found" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _host_port(address: str, given: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ClusterUnavailable(f"ray_address {given!r} is not HOST:PORT, auto or ray://HOST:PORT")
    return host.strip("[]"), int(port)


def _auto_source(resolved: str) -> str:
    """Where ray_address "auto" found `resolved`: RAY_ADDRESS, the address file of the last `ray start`,
    or (Ray's last resort, and its first choice when exactly one runs) a head running on this machine."""
    from ray._private.utils import read_ray_address

    if os.environ.get(ray_constants.RAY_ADDRESS_ENVIRONMENT_VARIABLE):
        return "RAY_ADDRESS"
    written = read_ray_address()
    try:
        if written and services.canonicalize_bootstrap_address(written) == resolved:
            return _address_file()
    except (ValueError, ConnectionError):
        pass
    return "a Ray head running on this machine"


def _address_file() -> str:
    from ray._common.utils import get_ray_address_file

    return get_ray_address_file(None)


def _default_token_file() -> Path:
    return Path.home() / ".ray" / "auth_token"


def _ask_head(address: str, timeout_s: float) -> str:
    """The head check's verdict, one line: "alive", "auth MESSAGE", "error MESSAGE" or "timeout"."""
    verdict: list[str] = []

    def ask() -> None:
        try:
            GcsClient(address=address).check_alive([], timeout=max(1, int(timeout_s)))
            verdict.append("alive")
        except Exception as exc:  # the verdict names it
            verdict.append(f"{'auth' if _is_auth_failure(exc) else 'error'} {last_line(exc)}")

    thread = threading.Thread(target=ask, daemon=True)  # Ray's client may retry far longer than asked
    thread.start()
    thread.join(timeout_s)
    return verdict[0] if verdict else "timeout"


if __name__ == "__main__":  # python -m hybridspec.cloud.pool.cluster ADDRESS TIMEOUT_S (check_head's child)
    print(_ask_head(sys.argv[1], float(sys.argv[2])), flush=True)
    os._exit(0)  # without waiting for a Ray client thread that is still retrying
