"""Property-based fuzzing of every RPC over real gRPC: no message gets UNKNOWN or INTERNAL, errors
stay one short line, and an honest edge running beside the fuzz still gets the target's output.

CI runs a few hundred derandomized cases; `bench/soak.py fuzz` runs 10^4 and more with fresh randomness.
"""
import threading

import grpc
import pytest
from hypothesis import HealthCheck, given, settings

from hybridspec.cloud.pool.pool import inprocess_pool
from hybridspec.cloud.api.server import BackgroundServer
from hybridspec.cloud.core.verifier import Verifier, VerifierLimits
from hybridspec.edge.client import VerifierClient
from hybridspec.edge.config import EdgeConfig
from hybridspec.edge.worker import EdgeWorker

from fuzzing import Fuzzer, calls
from tinymodels import EVERY_ROUND, greedy_reference

PROMPT = [5, 17, 33, 80]
NEW_TOKENS = 16


@pytest.mark.slow
def test_every_rpc_survives_fuzzing_beside_an_honest_edge(target):
    backend = inprocess_pool(Verifier(target, VerifierLimits(max_context=512, max_draft=16, max_sessions=48),
                                      max_batch=16, max_wait_ms=5.0))
    server = BackgroundServer(backend)
    channel = grpc.insecure_channel(server.address)
    fuzzer = Fuzzer(channel)
    stop, outputs, errors = threading.Event(), [], []

    def honest_edge() -> None:
        config = EdgeConfig.of(cloud=server.address, max_new_tokens=NEW_TOKENS, max_draft=4, fallback_threshold=0.0,
                               **EVERY_ROUND)
        try:
            with VerifierClient(server.address) as client:
                worker = EdgeWorker(target, client, config)
                while not stop.is_set() or not outputs:
                    outputs.append(worker.generate(PROMPT).token_ids)
        except Exception as exc:  # reported by the assertion below
            errors.append(exc)

    @settings(max_examples=300, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(call=calls(fuzzer.live, fuzzer.sessions))
    def fuzz(call):
        fuzzer.send(*call)

    edge = threading.Thread(target=honest_edge)
    edge.start()
    try:
        fuzz()
    finally:
        stop.set()
        edge.join(timeout=120)
        channel.close()
        server.stop()
    assert not fuzzer.violations, fuzzer.violations[:5]
    assert not errors, errors
    reference = greedy_reference(target, PROMPT, NEW_TOKENS)
    assert outputs and all(out == reference for out in outputs), len(outputs)
    assert sum(fuzzer.counts.values()) >= 300
    assert fuzzer.counts["OK"] >= 10 and {"INVALID_ARGUMENT", "FAILED_PRECONDITION"} <= set(fuzzer.counts), \
        fuzzer.counts  # the fuzz reached the verification rules, not only the parsers
