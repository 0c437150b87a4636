"""One end-to-end run on the real embedded SmolLM2-135M-Instruct pair."""
import pytest

from hybridspec.cloud.api.server import BackgroundServer
from hybridspec.cloud.core.verifier import Verifier
from hybridspec.common.models.embedded import default_paths

from conftest import require_embedded
from hybridspec.common.models.loading import load_model
from hybridspec.edge.client import VerifierClient
from hybridspec.edge.config import EdgeConfig
from hybridspec.edge.prompt import encode_prompt
from hybridspec.edge.worker import EdgeWorker

from tinymodels import EVERY_ROUND, greedy_reference

pytestmark = pytest.mark.embedded


@pytest.fixture(scope="module")
def target():
    require_embedded()
    return load_model(default_paths()["target"], device="cpu")


@pytest.mark.slow
@pytest.mark.parametrize("role", ["plain", "eagle"])
def test_embedded_pair_is_lossless_over_grpc(target, role):
    drafter = load_model(default_paths()[role], device="cpu")
    assert drafter.is_eagle == (role == "eagle")
    assert target.model.config.num_hidden_layers == 30
    server = BackgroundServer(Verifier(target))
    try:
        prompt = encode_prompt(target.tokenizer, "What is the capital of France?", chat=True)
        config = EdgeConfig.of(cloud=server.address, max_new_tokens=16, max_draft=4, **EVERY_ROUND)
        with VerifierClient(server.address) as client:
            gen = EdgeWorker(drafter, client, config).generate(prompt)
    finally:
        server.stop()
    assert (gen.stats.feature_bytes > 0) == (role == "eagle")
    assert gen.stats.accepted > 0
    assert gen.token_ids == greedy_reference(target, prompt, 16)
    assert "Paris" in gen.text


@pytest.mark.slow
def test_the_reported_vanishing_repetition_penalty_is_served(target):
    """The fuzzer's request (issue: INTERNAL on a setting the server accepts), on the real model."""
    import grpc

    from hybridspec.common.protocol.proto import verifier_pb2 as pb
    from hybridspec.common.protocol.proto import verifier_pb2_grpc as pb_grpc

    server = BackgroundServer(Verifier(target))
    ids = [1, 9690, 198, 3303, 314, 260, 6917, 2840, 47, 2]
    sampling = pb.SamplingParams(temperature=1, repetition_penalty=1e-38)
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.VerifierStub(channel)
            opened = stub.OpenSession(pb.OpenSessionRequest(committed_ids=ids, sampling=sampling, seed=1))
            reply = stub.Verify(pb.VerifyRequest(session_id=opened.session_id, round=0, committed_len=10))
            tokens = [r.token_id for r in stub.Generate(pb.GenerateRequest(prompt_ids=ids, sampling=sampling,
                                                                           max_new_tokens=3, seed=1))]
    finally:
        server.stop()
    assert reply.committed_len == 11 and len(tokens) >= 1
