"""The Ray-managed verifier pool: N replica actors behind the `Replica` protocol, on a Ray cluster.

Each session is pinned to the replica that opened it, because that replica holds its KV cache
(routing, placement and limits are the `Pool`'s, cloud/pool/pool.py). When a replica dies, Ray
restarts it (with an empty cache); meanwhile its sessions answer FAILED_PRECONDITION and the edge
re-opens them with its committed tokens: on another live replica, or — with a single replica — on the
restarted one, which a new session waits for (bounded). This layer never parses protobuf, and no Ray
error text (tracebacks, pids, addresses) ever reaches a client.

Replicas given an endpoint to start (cloud/api/server.py `ReplicaEndpoint`, passed in by whoever builds
the pool) serve their sessions' rounds on their own gRPC endpoint too; OpenSession answers with the
owning replica's address, and a (re)started replica reports its new one. Opening, closing, limits
and routing stay at the front door either way.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import ray
from ray.exceptions import RayActorError

from ...common.protocol.errors import HybridSpecError, Unavailable, incident
from ...common.protocol.wire import DraftBlock, ModelInfo, OpenProgress, SessionOpened, SessionSpec, VerifyResult
from ..core.telemetry import Tally
from .cluster import join, last_line, start_local
from .pool import CHECK_S, REPLICA_SILENT_S, Pool, ReplicaLost, ReplicaSilent
from .reaper import start_reaper
from .replica import EndpointStarter, ReplicaReady, VerifierReplica
from .specs import PoolSettings, PoolSpec

if TYPE_CHECKING:
    from ..core.verifier import VerifierStats

log = logging.getLogger(__name__)

# Replicas load models offline, like every other hybridspec process.
WORKER_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
ACTOR = ray.remote(VerifierReplica)  # the actor class; each replica gives it its resources and name


def replica_env(niceness: int) -> dict[str, str]:
    """A replica process's environment: the workers' own, and the niceness the raylet starts it at
    (Ray reads RAY_worker_niceness from an actor's runtime env; its default is 15)."""
    return {**WORKER_ENV, "RAY_worker_niceness": str(niceness)}


def RayPool(spec: PoolSpec, endpoint: EndpointStarter | None = None) -> Pool:
    """The pool of `spec.settings.replicas` Ray actors (named as the class it replaced, so the CLI, the
    benchmarks and the tests build it as before). `endpoint`: what each replica starts to take its
    sessions' rounds directly (None: none)."""
    settings = spec.settings
    replicas = [RayReplica(f"{spec.name}-replica-{i}", spec, endpoint) for i in range(settings.replicas)]
    return Pool(replicas, settings.max_sessions_per_client, settings.max_sessions_per_address,
                settings.replica_wait_s, RayCluster(settings), paces=endpoint is not None)


class RayCluster:
    """The cluster the replicas run on: joined at `settings.ray_address`, or a local one of this
    process's own (cloud/pool/cluster.py), unless Ray is already initialised here."""

    def __init__(self, settings: PoolSettings) -> None:
        self.settings = settings
        self._started = False

    def start(self) -> None:
        """Start or join the cluster, in bounded time."""
        if ray.is_initialized():
            return
        kwargs: dict = {"runtime_env": {"env_vars": WORKER_ENV}, "include_dashboard": False,
                        "log_to_driver": False, "logging_level": logging.WARNING}
        if self.settings.ray_address:
            join(self.settings.ray_address, self.settings.ray_join_timeout_s, **kwargs)
        else:
            start_reaper()  # no Ray process outlives this one, however it ends
            if self.settings.ray_num_cpus:
                kwargs["num_cpus"] = self.settings.ray_num_cpus
            start_local(local_only=self.settings.ray_local_only, **kwargs)
        self._started = True

    async def stop(self) -> None:
        """Leave the cluster if `start` started or joined it."""
        if self._started:
            await asyncio.to_thread(ray.shutdown)


class RayReplica:
    """A `Replica` that is a Ray actor (cloud/pool/replica.py `VerifierReplica`), restarted by Ray when
    it dies. Actor calls return domain errors as values; a raised RayActorError means the actor died:
    it is marked down, counted, watched until Ray has it back, and the call raises ReplicaLost. An actor
    that says nothing for REPLICA_SILENT_S during an open is marked not answering (no new sessions) until a
    call is answered again; a status call that times out only reports it down to the metrics."""

    def __init__(self, name: str, spec: PoolSpec, endpoint: EndpointStarter | None) -> None:
        self.name = name
        self.spec = spec
        self.endpoint = endpoint
        self.handle: ray.actor.ActorHandle | None = None
        self.alive = False  # until `start` has it loaded
        self.answering = True  # False while it is silent (alive, but not answering)
        self.failures = 0  # times this replica died
        self.address = ""  # its direct endpoint (changes when Ray restarts it); "" = none
        self.info: ModelInfo | None = None  # what it serves, as it last said (its pass-cost curve once in)
        self._back = asyncio.Event()  # set while alive
        self._watcher: asyncio.Task | None = None
        self._curve: asyncio.Task | None = None  # waiting for the curve it measures after it started
        self._stopped = False

    @property
    def verify_address(self) -> str:
        """Its direct endpoint while it is alive."""
        return self.address if self.alive else ""

    async def start(self) -> ModelInfo:
        """Create the actor (on the running cluster) and wait until its model is loaded."""
        settings = self.spec.settings
        options = ACTOR.options(
            name=self.name, num_cpus=settings.replica_num_cpus, num_gpus=settings.replica_num_gpus,
            max_restarts=-1, max_task_retries=0, max_concurrency=1024, lifetime=None,
            runtime_env={"env_vars": replica_env(settings.replica_niceness)})
        self.handle = options.remote(self.spec.replica, self.endpoint, settings.model_process)
        try:
            ready: ReplicaReady | HybridSpecError = await self.handle.ready.remote()
        except RayActorError as exc:
            raise Unavailable(f"a verifier replica failed to start: {last_line(exc)}") from None
        if isinstance(ready, HybridSpecError):  # the model's own process could not load it
            ray.kill(self.handle, no_restart=True)
            raise Unavailable(f"a verifier replica failed to start: {ready}") from None
        self._up(ready)
        return ready.info

    def model_info(self) -> ModelInfo:
        """What it serves, as it last said: its pass-cost curve once measured (the pool asks again)."""
        assert self.info is not None, "a replica's model info is asked for before it started"
        return self.info

    async def stop(self) -> None:
        """Kill the actor for good."""
        self._stopped, self.alive = True, False
        for task in (self._watcher, self._curve):
            if task is not None:
                task.cancel()
        if self.handle is not None:
            ray.kill(self.handle, no_restart=True)

    async def wait_alive(self) -> None:
        """Return once Ray has it back (at once if it is alive)."""
        await self._back.wait()

    async def aopen_session(self, spec: SessionSpec,
                            progress: Callable[[OpenProgress], None] | None = None) -> SessionOpened:
        """Open or re-open a session on the actor, as a Ray streaming call of its progress (every second)
        then its answer; ReplicaSilent, the open abandoned, if nothing comes for REPLICA_SILENT_S. The
        answer names the actor's endpoint: Ray may have restarted it (on a new port) without any call of
        ours seeing it die."""
        stream = self.handle.open_session_progress.options(num_returns="streaming").remote(spec)
        try:
            while True:
                try:
                    ref = await asyncio.wait_for(stream.__anext__(), REPLICA_SILENT_S)
                except StopAsyncIteration:
                    raise incident(log, RuntimeError("the open's stream ended without an answer"), "OpenSession") \
                        from None
                except asyncio.TimeoutError:
                    self.answering = False
                    raise ReplicaSilent(f"the verifier replica stopped answering: nothing for {REPLICA_SILENT_S:g} s "
                                        "while it had the prompt") from None
                except RayActorError as exc:
                    raise self._lost(exc) from None
                item = await self._call(ref, "OpenSession")
                self.answering = True
                if isinstance(item, SessionOpened):
                    self.address = item.verify_address
                    return item
                if progress is not None:
                    progress(item)
        finally:
            ray.cancel(stream)  # a no-op once it ended; abandons the open when the caller left early

    async def averify(self, block: DraftBlock) -> VerifyResult:
        """Verify one round on the actor."""
        return await self._call(self.handle.verify.remote(block), "Verify")

    async def adecode(self, block: DraftBlock, max_tokens: int, eos: frozenset[int]) -> AsyncIterator[int]:
        """Cloud-only decoding as a Ray streaming call: one token per item, not one call per token."""
        stream = self.handle.decode.options(num_returns="streaming").remote(block, max_tokens, eos)
        try:
            while True:
                try:
                    ref = await stream.__anext__()
                except StopAsyncIteration:
                    return
                except RayActorError as exc:
                    raise self._lost(exc) from None
                yield await self._call(ref, "Generate")
        finally:
            ray.cancel(stream)  # a no-op once it ended; stops the replica's loop when the client left early

    async def aclose_session(self, session_id: str) -> bool:
        """Free a session on the actor (nothing to free on a dead one)."""
        if not self.alive:
            return False
        return await self._call(self.handle.close_session.remote(session_id), "CloseSession")

    async def astats(self) -> VerifierStats | None:
        """The actor's stats, or None if it is down or does not answer within CHECK_S."""
        if not self.alive:
            return None
        try:
            stats = await asyncio.wait_for(self._call(self.handle.stats.remote(), "stats"), timeout=CHECK_S)
        except ReplicaLost:
            raise
        except (asyncio.TimeoutError, HybridSpecError):
            return None  # a slow status call on a busy host bars no new session; only an open's silence does
        if stats is not None:  # None: the actor answered, its model's process did not (yet)
            self.answering = True
        return stats

    async def take_tally(self) -> Tally:
        """What its direct endpoint answered since the last call."""
        try:
            return await asyncio.wait_for(self._call(self.handle.take_tally.remote(), "take_tally"), timeout=CHECK_S)
        except ReplicaLost:
            raise
        except (HybridSpecError, asyncio.TimeoutError):
            return Tally()  # those rounds go uncounted; serving them mattered more

    async def _call(self, ref, what: str):
        """Await an actor call. A dead actor is ReplicaLost; any other Ray failure is logged as an
        incident and reaches the client as INTERNAL."""
        try:
            result = await ref
        except RayActorError as exc:
            raise self._lost(exc) from None
        except Exception as exc:
            raise incident(log, exc, what) from None
        if isinstance(result, HybridSpecError):
            if isinstance(result, ReplicaSilent):  # the actor answers, but the model's process stopped answering
                self.answering = False
            raise result
        return result

    def _lost(self, exc: Exception) -> ReplicaLost:
        """Mark it down and watch for Ray's restart (once per death); the error to raise."""
        if self.alive:
            self.failures += 1
            self.alive = False
            self._back.clear()
            log.warning("replica %s failed (%s); Ray is restarting it", self.name, type(exc).__name__)
            self._watcher = asyncio.get_running_loop().create_task(self._await_restart())
        return ReplicaLost()

    async def _await_restart(self) -> None:
        """Ask the restarting actor until it answers loaded (a Ray error, or its model's process failing to
        load, means not yet)."""
        while not self._stopped:
            try:
                ready = await self.handle.ready.remote()
            except Exception:  # noqa: BLE001 — any Ray error while it restarts: keep watching
                ready = None
            if isinstance(ready, ReplicaReady):
                self._up(ready)
                log.info("replica %s is back", self.name)
                return
            await asyncio.sleep(0.5)

    def _up(self, ready: ReplicaReady) -> None:
        self.address = ready.verify_address
        self.info = ready.info
        self.alive = True
        self._back.set()
        if not ready.info.pass_costs and self.spec.replica.settings.pass_cost_tokens and \
                (self._curve is None or self._curve.done()):
            self._curve = asyncio.get_running_loop().create_task(self._await_curve())

    async def _await_curve(self) -> None:
        """The curve the replica measures while it serves, once it has it (a death ends the wait: the
        restarted replica is waited for again)."""
        try:
            self.info = await self.handle.measured_info.remote()
        except Exception:  # noqa: BLE001 — a dead or restarting actor: `_up` waits again
            pass
