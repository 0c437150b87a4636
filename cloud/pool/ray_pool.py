"""The Ray-managed verifier pool: N replica actors and session affinity.

Each session is pinned to the replica that opened it, because that replica holds its KV cache
(routing lives in the Backend base class). New sessions go to the live replica with the fewest
sessions. When a replica dies, Ray restarts it (with an empty cache); meanwhile its sessions answer
FAILED_PRECONDITION and the edge re-opens them with its committed tokens: on another live replica,
or — with a single replica — on the restarted one, which a new session waits for (bounded). The pool
never parses protobuf, and no Ray error text (tracebacks, pids, addresses) ever reaches a client.

Replicas given an endpoint to start (cloud/api/server.py `ReplicaEndpoint`, passed in by whoever builds
the pool) serve their sessions' rounds on their own gRPC endpoint too;
OpenSession answers with the owning replica's address, and a (re)started replica reports its new one.
Opening, closing, limits and routing stay here either way.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import ray
from ray.exceptions import RayActorError

from ...common.protocol.errors import HybridSpecError, Unavailable, incident
from ...common.protocol.wire import DraftBlock, SessionOpened, SessionSpec, VerifyResult
from .backend import Backend, ReplicaLost
from .cluster import join, last_line, start_local
from ..core.telemetry import Tally
from .reaper import start_reaper
from .specs import PoolSpec
from .replica import EndpointStarter, ReplicaReady, VerifierReplica
from ..core.verifier import VerifierStats

log = logging.getLogger(__name__)

# Replicas load models offline, like every other hybridspec process.
WORKER_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def replica_env(niceness: int) -> dict[str, str]:
    """A replica process's environment: the workers' own, and the niceness the raylet starts it at
    (Ray reads RAY_worker_niceness from an actor's runtime env; its default is 15)."""
    return {**WORKER_ENV, "RAY_worker_niceness": str(niceness)}


@dataclass
class _Replica:
    name: str
    handle: ray.actor.ActorHandle
    alive: bool = True
    failures: int = 0  # times this replica died
    verify_address: str = ""  # its direct endpoint (changes when Ray restarts it); "" = none


class RayPool(Backend):
    """Backend whose replicas are Ray actors."""

    def __init__(self, spec: PoolSpec, endpoint: EndpointStarter | None = None) -> None:
        """`endpoint`: what each replica starts to take its sessions' rounds directly (None: none)."""
        if spec.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {spec.replicas}")
        super().__init__(spec.max_sessions_per_client, spec.max_sessions_per_address)
        self.spec = spec
        self.endpoint = endpoint
        self.replicas: dict[str, _Replica] = {}
        self._started_ray = False
        self._revived = asyncio.Event()  # set whenever a replica comes back
        self._watchers: set[asyncio.Task] = set()

    async def start(self) -> None:
        """Start or join the Ray cluster (cloud/pool/cluster.py), create the replicas and wait until
        every model is loaded."""
        if not ray.is_initialized():
            kwargs: dict = {"runtime_env": {"env_vars": WORKER_ENV}, "include_dashboard": False,
                            "log_to_driver": False, "logging_level": logging.WARNING}
            if self.spec.ray_address:
                join(self.spec.ray_address, self.spec.ray_join_timeout_s, **kwargs)
            else:
                start_reaper()  # no Ray process outlives this one, however it ends
                if self.spec.ray_num_cpus:
                    kwargs["num_cpus"] = self.spec.ray_num_cpus
                start_local(local_only=self.spec.ray_local_only, **kwargs)
            self._started_ray = True
        actor = ray.remote(VerifierReplica)
        for i in range(self.spec.replicas):
            name = f"{self.spec.name}-replica-{i}"
            options = actor.options(name=name, num_cpus=self.spec.num_cpus, num_gpus=self.spec.num_gpus,
                                    max_restarts=-1, max_task_retries=0, max_concurrency=1024, lifetime=None,
                                    runtime_env={"env_vars": replica_env(self.spec.niceness)})
            handle = options.remote(self.spec.replica, self.endpoint)
            self.replicas[name] = _Replica(name, handle)
        try:
            readies: list[ReplicaReady] = await asyncio.gather(*(r.handle.ready.remote()
                                                                 for r in self.replicas.values()))
        except RayActorError as exc:
            await self.stop()
            raise Unavailable(f"a verifier replica failed to start: {last_line(exc)}") from None
        if len({(r.info.tokenizer_fingerprint, r.info.model_fingerprint) for r in readies}) != 1:
            await self.stop()
            raise Unavailable("replicas loaded different models; check the target setting")
        for replica, ready in zip(self.replicas.values(), readies):
            replica.verify_address = ready.verify_address
        self.info = readies[0].info
        log.info("%d replicas ready: %s", len(self.replicas), ", ".join(self.replicas))

    async def stop(self) -> None:
        """Kill the replicas (and the local cluster, if this pool started it)."""
        for task in self._watchers:
            task.cancel()
        for r in self.replicas.values():
            ray.kill(r.handle, no_restart=True)
        self.replicas.clear()
        if self._started_ray:
            await asyncio.to_thread(ray.shutdown)

    def _replica_names(self) -> list[str]:
        return list(self.replicas)

    async def _place(self) -> str:
        """The live replica with the fewest sessions; with none alive, wait (bounded) for one."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.spec.replica_wait_s
        while True:
            live = [r for r in self.replicas.values() if r.alive]
            if live:
                return min(live, key=lambda r: (self.table.count(r.name), self.routed_total.get(r.name, 0))).name
            self._revived.clear()
            try:
                await asyncio.wait_for(self._revived.wait(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise Unavailable("no verifier replica is alive; Ray is restarting them, retry shortly") from None

    async def _open_on(self, replica: str, spec: SessionSpec) -> SessionOpened:
        r = self.replicas[replica]
        return await self._call(r, r.handle.open_session.remote(spec), "OpenSession")

    async def _verify_on(self, replica: str, block: DraftBlock) -> VerifyResult:
        r = self.replicas[replica]
        return await self._call(r, r.handle.verify.remote(block), "Verify")

    async def _decode_on(self, replica: str, block: DraftBlock, max_tokens: int,
                         eos: frozenset[int]) -> AsyncIterator[int]:
        r = self.replicas[replica]
        stream = r.handle.decode.options(num_returns="streaming").remote(block, max_tokens, eos)
        try:
            while True:
                try:
                    ref = await stream.__anext__()
                except StopAsyncIteration:
                    return
                except RayActorError as exc:
                    self._lost(r, exc)
                    raise ReplicaLost("the replica holding the session was lost; re-open it") from None
                yield await self._call(r, ref, "Generate")
        finally:
            ray.cancel(stream)  # a no-op once it ended; stops the replica's loop when the client left early

    async def _close_on(self, replica: str, session_id: str) -> bool:
        r = self.replicas[replica]
        if not r.alive:
            return False
        return await self._call(r, r.handle.close_session.remote(session_id), "CloseSession")

    async def _stats_of(self, replica: str) -> VerifierStats | None:
        r = self.replicas[replica]
        if not r.alive:
            return None
        try:
            return await asyncio.wait_for(self._call(r, r.handle.stats.remote(), "stats"), timeout=5)
        except (HybridSpecError, asyncio.TimeoutError):
            return None

    def _failures(self, replica: str) -> int:
        return self.replicas[replica].failures

    def _verify_address(self, replica: str) -> str:
        r = self.replicas[replica]
        return r.verify_address if r.alive else ""

    async def _tally_of(self, replica: str) -> Tally:
        r = self.replicas[replica]
        try:
            return await asyncio.wait_for(self._call(r, r.handle.take_tally.remote(), "take_tally"), timeout=5)
        except (HybridSpecError, asyncio.TimeoutError):
            return Tally()  # those rounds go uncounted; serving them mattered more

    async def _call(self, replica: _Replica, ref, what: str):
        """Await an actor call. A dead replica drops its sessions (the edge re-opens them); any
        other Ray failure is logged as an incident and reaches the client as INTERNAL."""
        try:
            result = await ref
        except RayActorError as exc:
            self._lost(replica, exc)
            raise ReplicaLost("the replica holding the session was lost; re-open it") from None
        except Exception as exc:
            raise incident(log, exc, what) from None
        if isinstance(result, HybridSpecError):
            raise result
        return result

    def _lost(self, replica: _Replica, exc: Exception) -> None:
        if not replica.alive:
            return
        replica.failures += 1
        replica.alive = False
        for sid in self.table.on_replica(replica.name):
            # An open in flight there gets ReplicaLost from its own call and places the session again
            # under the same id (the edge re-opening after its direct stream broke is exactly that).
            if not self.table.get(sid).opening:
                self.table.remove(sid)
        log.warning("replica %s failed (%s); Ray is restarting it", replica.name, type(exc).__name__)
        task = asyncio.get_running_loop().create_task(self._await_restart(replica))
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)

    async def _await_restart(self, replica: _Replica) -> None:
        while True:
            try:
                ready: ReplicaReady = await replica.handle.ready.remote()
                replica.verify_address = ready.verify_address
                replica.alive = True
                self._revived.set()
                log.info("replica %s is back", replica.name)
                return
            except Exception:  # any Ray error while it restarts: keep watching
                await asyncio.sleep(0.5)

