"""The Ray-managed verifier pool: N replica actors and session affinity (design brief §3).

Each session is pinned to the replica that opened it, because that replica holds its KV cache. New
sessions go to the live replica with the fewest sessions. When a replica dies, Ray restarts it
(with an empty cache); meanwhile its sessions answer FAILED_PRECONDITION, the edge re-opens them
with its committed tokens, and the re-open lands on a live replica. The pool never parses protobuf.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import ray
from ray.exceptions import RayActorError

from ..common.errors import FailedPrecondition, HybridSpecError, Unavailable
from ..common.wire import DraftBlock, ModelInfo, SessionSpec, VerifyResult
from .backend import ReplicaStatus
from .replica import ReplicaSpec, VerifierReplica

log = logging.getLogger(__name__)

# Replicas load models offline, like every other hybridspec process.
WORKER_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@dataclass(frozen=True)
class PoolSpec:
    """How many replicas, with which resources, on which cluster."""

    replica: ReplicaSpec
    replicas: int = 1
    num_cpus: float = 1.0  # Ray CPUs reserved per replica (fractional is fine)
    num_gpus: float = 0.0  # Ray GPUs per replica; 1 on a GPU cluster
    ray_address: str = ""  # "" starts a local cluster; "auto" or "ray://HOST:10001" joins one
    ray_num_cpus: int = 0  # CPUs a local cluster advertises; 0 = every core
    name: str = "hybridspec"  # prefix of the replicas' actor names


@dataclass
class _Replica:
    name: str
    handle: ray.actor.ActorHandle
    alive: bool = True
    sessions: int = 0  # sessions routed here
    failures: int = 0  # times this replica died
    routed_total: int = 0  # sessions ever routed here


def init_ray(attempts: int = 2, **kwargs) -> None:
    """ray.init, tried again once: on a loaded machine a local raylet can miss Ray's fixed 30 s
    registration window. Call it on the main thread, where Ray installs its signal handlers."""
    for attempt in range(attempts):
        try:
            ray.init(**kwargs)
            return
        except Exception as exc:  # Ray raises a bare Exception for a node that timed out starting
            ray.shutdown()
            if attempt == attempts - 1:
                raise Unavailable(f"could not start or join the Ray cluster: {_last_line(exc)}") from None
            log.warning("Ray did not start (%s); trying again", _last_line(exc))


class _ReplicaLost(FailedPrecondition):
    """The replica holding the session died: the edge re-opens and lands on a live one."""


class RayPool:
    """Backend that routes each session to its replica actor."""

    def __init__(self, spec: PoolSpec) -> None:
        if spec.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {spec.replicas}")
        self.spec = spec
        self.info: ModelInfo | None = None
        self.replicas: list[_Replica] = []
        self.routes: dict[str, _Replica] = {}  # session id -> the replica holding its cache
        self._started_ray = False
        self._watchers: set[asyncio.Task] = set()

    async def start(self) -> None:
        """Start or join the Ray cluster, create the replicas and wait until every model is loaded."""
        if not ray.is_initialized():
            kwargs: dict = {"runtime_env": {"env_vars": WORKER_ENV}, "include_dashboard": False,
                            "log_to_driver": False, "logging_level": logging.WARNING}
            if self.spec.ray_address:
                kwargs["address"] = self.spec.ray_address
            elif self.spec.ray_num_cpus:
                kwargs["num_cpus"] = self.spec.ray_num_cpus
            init_ray(**kwargs)
            self._started_ray = True
        actor = ray.remote(VerifierReplica)
        for i in range(self.spec.replicas):
            name = f"{self.spec.name}-replica-{i}"
            handle = actor.options(name=name, num_cpus=self.spec.num_cpus, num_gpus=self.spec.num_gpus,
                                   max_restarts=-1, max_task_retries=0, max_concurrency=1024,
                                   lifetime=None).remote(self.spec.replica)
            self.replicas.append(_Replica(name, handle))
        try:
            infos = await asyncio.gather(*(r.handle.ready.remote() for r in self.replicas))
        except RayActorError as exc:
            await self.stop()
            raise Unavailable(f"a verifier replica failed to start: {_last_line(exc)}") from None
        if len({(i.tokenizer_fingerprint, i.model_fingerprint) for i in infos}) != 1:
            await self.stop()
            raise Unavailable("replicas loaded different models; check the target setting")
        self.info = infos[0]
        log.info("%d replicas ready: %s", len(self.replicas), ", ".join(r.name for r in self.replicas))

    async def stop(self) -> None:
        """Kill the replicas (and the local cluster, if this pool started it)."""
        for task in self._watchers:
            task.cancel()
        for r in self.replicas:
            ray.kill(r.handle, no_restart=True)
        self.replicas.clear()
        self.routes.clear()
        if self._started_ray:
            await asyncio.to_thread(ray.shutdown)

    async def open_session(self, spec: SessionSpec) -> int:
        """Open on the replica already holding the session, else on the least loaded live one.

        The session is routed before the replica answers, so concurrent opens spread out; if the
        chosen replica turns out to be dead, the next live one is tried.
        """
        sid = spec.session_id
        for _ in range(len(self.replicas)):
            replica = self.routes.get(sid)
            if replica is None or not replica.alive:
                self._route(sid, self._least_loaded())
            replica = self.routes[sid]
            try:
                return await self._call(replica, replica.handle.open_session.remote(spec))
            except _ReplicaLost:
                continue  # _lost dropped the route; pick another replica
            except HybridSpecError:
                self._unroute(sid)
                raise
        raise Unavailable("no verifier replica could open the session; retry shortly")

    async def verify(self, block: DraftBlock) -> VerifyResult:
        """Verify on the owning replica; an unknown session must be re-opened."""
        replica = self.routes.get(block.session_id)
        if replica is None:
            raise FailedPrecondition(f"session {block.session_id!r} is unknown to this pool; re-open it")
        return await self._call(replica, replica.handle.verify.remote(block))

    async def close_session(self, session_id: str) -> bool:
        """Free the session on its replica."""
        replica = self._unroute(session_id)
        if replica is None or not replica.alive:
            return False
        try:
            return await replica.handle.close_session.remote(session_id)
        except RayActorError:
            return False

    async def status(self) -> list[ReplicaStatus]:
        """Each replica's sessions, cached tokens and evictions (a dead one reports zeros)."""
        async def one(r: _Replica) -> ReplicaStatus:
            dead = ReplicaStatus(r.name, False, 0, 0, 0, r.failures, r.routed_total)
            if not r.alive:
                return dead
            try:
                s = await asyncio.wait_for(r.handle.stats.remote(), timeout=5)
            except (RayActorError, asyncio.TimeoutError):
                return dead
            return ReplicaStatus(r.name, True, s.sessions, s.cached_tokens, s.evictions, r.failures, r.routed_total)

        return list(await asyncio.gather(*(one(r) for r in self.replicas)))

    def replica_of(self, session_id: str) -> str | None:
        """Name of the replica holding a session, if routed."""
        r = self.routes.get(session_id)
        return None if r is None else r.name

    def _least_loaded(self) -> _Replica:
        live = [r for r in self.replicas if r.alive]
        if not live:
            raise Unavailable("no verifier replica is alive; Ray is restarting them, retry shortly")
        return min(live, key=lambda r: (r.sessions, r.routed_total))

    def _route(self, session_id: str, replica: _Replica) -> None:
        self._unroute(session_id)
        self.routes[session_id] = replica
        replica.sessions += 1
        replica.routed_total += 1

    def _unroute(self, session_id: str) -> _Replica | None:
        replica = self.routes.pop(session_id, None)
        if replica is not None:
            replica.sessions -= 1
        return replica

    async def _call(self, replica: _Replica, ref):
        """Await an actor call; a replica failure drops its sessions and asks the edge to re-open."""
        try:
            result = await ref
        except RayActorError as exc:
            self._lost(replica, exc)
            raise _ReplicaLost(f"replica {replica.name} was lost; re-open the session") from None
        if isinstance(result, HybridSpecError):
            raise result
        return result

    def _lost(self, replica: _Replica, exc: Exception) -> None:
        if not replica.alive:
            return
        replica.failures += 1
        replica.alive = False
        for sid in [sid for sid, r in self.routes.items() if r is replica]:
            self._unroute(sid)
        log.warning("replica %s failed (%s); Ray is restarting it", replica.name, type(exc).__name__)
        task = asyncio.get_running_loop().create_task(self._await_restart(replica))
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)

    async def _await_restart(self, replica: _Replica) -> None:
        while True:
            try:
                await replica.handle.ready.remote()
                replica.alive = True
                log.info("replica %s is back", replica.name)
                return
            except RayActorError:
                await asyncio.sleep(0.5)



def _last_line(exc: Exception) -> str:
    """The innermost error of a Ray failure, without Ray's traceback text."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__
