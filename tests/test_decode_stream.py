"""Cloud-only decoding as a stream the model thread drives (cloud/core/verifier.py `DecodeStream`): the
target's output, decoded ahead of its consumer, batched with other sessions, stopped by a close, a
shutdown or a lost replica, on a verifier, the in-process front door and the Ray pool."""
import asyncio
import time

import pytest
import ray

from hybridspec.cloud.api.server import BackgroundServer
from hybridspec.cloud.core.verifier import Verifier, VerifierLimits
from hybridspec.cloud.pool.ray_pool import RayPool
from hybridspec.cloud.pool.specs import PoolSettings, PoolSpec, ReplicaSettings, ReplicaSpec
from hybridspec.common.protocol.errors import FailedPrecondition, Unavailable
from hybridspec.common.protocol.wire import DraftBlock, GenerateSpec, SessionSpec
from hybridspec.edge.client import VerifierClient

from tinymodels import greedy_reference

PROMPT = [5, 17, 33, 80]
LIMITS = VerifierLimits(max_context=512, max_draft=8, max_sessions=8)


def run(coro):
    return asyncio.run(coro)


async def opened(verifier: Verifier, sid: str, prompt=PROMPT) -> DraftBlock:
    await verifier.aopen_session(SessionSpec(session_id=sid, committed_ids=tuple(prompt)))
    return DraftBlock(sid, 0, len(prompt), ())


async def running(verifier: Verifier) -> Verifier:
    await verifier.start()
    return verifier


def test_a_stream_gives_the_targets_greedy_tokens(target):
    async def main():
        verifier = await running(Verifier(target, LIMITS))
        try:
            return [t async for t in verifier.adecode(await opened(verifier, "a"), 12, frozenset())]
        finally:
            await verifier.stop()

    assert run(main()) == greedy_reference(target, PROMPT, 12)


def test_the_model_thread_decodes_ahead_of_a_slow_consumer(target):
    """The point of the stream: the engine does not wait for the consumer to ask for the next token."""
    async def main():
        verifier = await running(Verifier(target, LIMITS))
        try:
            tokens = verifier.adecode(await opened(verifier, "a"), 10, frozenset())
            first = await tokens.__anext__()
            deadline = time.monotonic() + 10
            while (await verifier.astats()).cached_tokens < len(PROMPT) + 10:
                assert time.monotonic() < deadline, "the stream waited for its consumer"
                await asyncio.sleep(0.02)
            return [first] + [t async for t in tokens]
        finally:
            await verifier.stop()

    assert run(main()) == greedy_reference(target, PROMPT, 10)


def test_streams_stop_at_end_of_sequence_and_batch_with_each_other(target):
    reference = greedy_reference(target, PROMPT, 8)
    stop = reference[4]
    expected = reference[: reference.index(stop) + 1]

    async def main():
        verifier = await running(Verifier(target, LIMITS, max_wait_ms=20.0))
        try:
            async def one(sid):
                return [t async for t in verifier.adecode(await opened(verifier, sid), 8, frozenset({stop}))]
            return await asyncio.gather(*(one(f"s{i}") for i in range(3)))
        finally:
            await verifier.stop()

    assert run(main()) == [expected] * 3


def test_closing_the_session_ends_its_stream_with_failed_precondition(target):
    async def main():
        verifier = await running(Verifier(target, LIMITS))
        try:
            tokens = verifier.adecode(await opened(verifier, "a"), 400, frozenset())
            await tokens.__anext__()
            await verifier.aclose_session("a")
            with pytest.raises(FailedPrecondition):
                async for _ in tokens:
                    pass
        finally:
            await verifier.stop()

    run(main())


def test_a_shutdown_ends_every_stream_with_unavailable(target):
    async def main():
        verifier = await running(Verifier(target, LIMITS))
        tokens = verifier.adecode(await opened(verifier, "a"), 400, frozenset())
        await tokens.__anext__()
        await verifier.stop()
        with pytest.raises(Unavailable):
            async for _ in tokens:
                pass
        with pytest.raises(Unavailable, match="not started"):  # an event loop never steps it itself
            await verifier.averify(DraftBlock("a", 0, len(PROMPT), ()))

    run(main())


def test_generate_over_the_in_process_front_door(target):
    server = BackgroundServer(Verifier(target, LIMITS))
    try:
        with VerifierClient(server.address) as client:
            tokens = list(client.generate(GenerateSpec(prompt_ids=tuple(PROMPT), max_new_tokens=15)))
    finally:
        server.stop()
    assert tokens == greedy_reference(target, PROMPT, 15)


def test_generate_sends_its_request_before_the_first_token_is_read(target):
    """A cloud-only edge starts its stream, then sets up its drafter: the drafter's context (about 15 ms
    with llama.cpp) must overlap the cloud's prefill and round trip instead of delaying the first token."""
    server = BackgroundServer(Verifier(target, LIMITS))
    try:
        with VerifierClient(server.address) as client:
            tokens = client.generate(GenerateSpec(prompt_ids=tuple(PROMPT), max_new_tokens=3))
            streamed = server.running.metrics.registry
            deadline = time.monotonic() + 30
            while (streamed.get_sample_value("hybridspec_generate_tokens_total") or 0) < 3:
                assert time.monotonic() < deadline, "the server never saw the request: it waits for the first read"
                time.sleep(0.05)
            assert list(tokens) == greedy_reference(target, PROMPT, 3)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def stream_pool(ray_cluster, model_dirs):
    replica = ReplicaSpec(str(model_dirs["target"]), ReplicaSettings(device="cpu", torch_threads=1, pass_cost_tokens=0),
                          LIMITS)
    pool = RayPool(PoolSpec(replica, PoolSettings(replicas=1, replica_num_cpus=0.5), name="stream-pool"))
    server = BackgroundServer(pool)
    yield server, pool
    server.stop()


@pytest.mark.slow
def test_a_client_leaving_early_stops_the_replicas_stream(stream_pool):
    server, pool = stream_pool
    with VerifierClient(server.address) as client:
        for i, _ in enumerate(client.generate(GenerateSpec(prompt_ids=tuple(PROMPT), max_new_tokens=400))):
            if i == 2:
                break
    deadline = time.monotonic() + 30
    while server.call(pool.status())[0].sessions:
        assert time.monotonic() < deadline, "the abandoned stream's session was never closed"
        time.sleep(0.1)


@pytest.mark.slow
def test_a_replica_killed_mid_stream_is_recovered_from_the_tokens_so_far(stream_pool, target):
    server, pool = stream_pool
    new_tokens = 400  # long enough that the kill lands mid-stream
    with VerifierClient(server.address) as client:
        tokens = []
        for token in client.generate(GenerateSpec(prompt_ids=tuple(PROMPT), max_new_tokens=new_tokens)):
            tokens.append(token)
            if len(tokens) == 3:  # the replica decodes ahead, so kill it at once
                ray.kill(next(iter(pool.replicas.values())).handle, no_restart=False)
    assert sum(r.failures for r in pool.replicas.values()) == 1
    assert tokens == greedy_reference(target, PROMPT, new_tokens)
