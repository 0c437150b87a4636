"""The pool over the `Replica` protocol (cloud/pool/pool.py), without Ray: both kinds of replica (a
Verifier in this process, a Ray actor's stand-in) match the protocol member for member, and one `Pool`
over two in-process verifiers places, routes, reconciles and closes sessions and runs cloud-only
generation (cloud/api/service.py `generate_tokens`) across them."""
import asyncio
import inspect

import pytest

from hybridspec.cloud.api.service import generate_tokens
from hybridspec.cloud.core.verifier import Verifier, VerifierLimits
from hybridspec.cloud.pool.pool import Pool, Replica
from hybridspec.cloud.pool.ray_pool import RayReplica
from hybridspec.cloud.pool.specs import PoolSpec, ReplicaSpec
from hybridspec.common.protocol.errors import FailedPrecondition, PermissionDenied
from hybridspec.common.protocol.wire import DraftBlock, GenerateSpec, SessionSpec
from hybridspec.common.security.credentials import Identity, anonymous

from tinymodels import greedy_reference

LIMITS = VerifierLimits(max_context=512, max_draft=16, max_sessions=8)
CALLER = anonymous("ipv4:127.0.0.1")
PROMPT = (5, 6, 7, 8)


def protocol_members() -> dict[str, object]:
    """Replica's members: its attributes (annotations) and its properties and methods."""
    members = {name: None for name in Replica.__annotations__}
    members |= {name: value for name, value in vars(Replica).items() if not name.startswith("_")}
    return members


def parameters(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_both_kinds_of_replica_have_every_member_of_the_replica_protocol(verifier):
    """A member added to the protocol, or a call's parameters changed, on one side only fails here."""
    adapters = [verifier, RayReplica("r", PoolSpec(replica=ReplicaSpec(target="unused")), None)]  # no Ray call until start
    members = protocol_members()
    assert {"aopen_session", "averify", "adecode", "aclose_session", "astats", "alive", "name"} <= set(members)
    for adapter in adapters:
        for name, declared in members.items():
            assert hasattr(adapter, name), f"{type(adapter).__name__} lacks {name}"
            if inspect.isfunction(declared):
                assert parameters(getattr(type(adapter), name)) == parameters(declared), (type(adapter), name)
                # Awaited calls stay awaited; the one stream stays an async generator; what it last said
                # it serves is read at once.
                kind = inspect.isasyncgenfunction if name == "adecode" else inspect.iscoroutinefunction
                if name == "model_info":
                    kind = lambda fn: inspect.isfunction(fn) and not inspect.iscoroutinefunction(fn)
                assert kind(getattr(type(adapter), name)), (type(adapter).__name__, name)


@pytest.fixture
def two_replicas(target) -> Pool:
    return Pool([Verifier(target, LIMITS, max_batch=4, max_wait_ms=0.0, prefill_budget_ms=50.0, name=f"r{i}")
                 for i in range(2)], max_sessions_per_client=8, max_sessions_per_address=8, replica_wait_s=0.0)


def test_a_pool_of_two_in_process_replicas_spreads_routes_and_reconciles_sessions(two_replicas):
    pool = two_replicas

    async def scenario() -> None:
        await pool.start()
        try:
            ids = [(await pool.open_session(SessionSpec("", PROMPT), CALLER)).session_id for _ in range(4)]
            placed = [pool.table.get(sid).replica for sid in ids]
            assert sorted(placed) == ["r0", "r0", "r1", "r1"]  # the replica with the fewest sessions
            for sid, name in zip(ids, placed):  # each round reaches the replica holding its cache
                result = await pool.averify(DraftBlock(sid, 0, len(PROMPT), (9,), owner=CALLER.owner))
                assert result.num_accepted in (0, 1)
                other = pool.replicas["r1" if name == "r0" else "r0"]
                with pytest.raises(FailedPrecondition):  # the other replica has never heard of it
                    await other.averify(DraftBlock(sid, 1, len(PROMPT) + 1 + result.num_accepted, ()))
            with pytest.raises(PermissionDenied):
                await pool.averify(DraftBlock(ids[0], 1, 0, (), owner=Identity("mallory", authenticated=True).owner))
            assert [s.sessions for s in await pool.status()] == [2, 2]
            # A session its replica dropped on its own leaves the table at the next status.
            assert await pool.replicas[placed[0]].aclose_session(ids[0])
            status = await pool.status()
            assert pool.table.lookup(ids[0]) is None and len(pool.table) == 3
            assert sorted(s.sessions for s in status) == [1, 2] and sum(s.routed_total for s in status) == 4
            assert await pool.close_session(ids[1], CALLER) and not await pool.close_session(ids[1], CALLER)
            assert len(pool.table) == 2
        finally:
            await pool.stop()

    asyncio.run(scenario())


def test_cloud_only_generation_over_a_pool_of_two_is_the_targets_greedy_output(two_replicas, target):
    pool = two_replicas

    async def scenario() -> list[int]:
        await pool.start()
        try:
            tokens = [t async for t in generate_tokens(pool, GenerateSpec(PROMPT, max_new_tokens=12), CALLER)]
            assert len(pool.table) == 0  # the stream's own session is closed when it ends
            return tokens
        finally:
            await pool.stop()

    assert asyncio.run(scenario()) == greedy_reference(target, list(PROMPT), 12)
