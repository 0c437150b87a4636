"""The target's final hidden states ("features") for an edge's EAGLE drafter: the wire format, and
what a session that asked for them receives through the real gRPC server (docs/architecture.md)."""
import grpc
import pytest
import torch

from hybridspec.cloud.engine.base import Feed
from hybridspec.cloud.api.server import BackgroundServer
from hybridspec.cloud.core.verifier import Verifier, VerifierLimits
from hybridspec.common.protocol import codec
from hybridspec.common.protocol.errors import InvalidArgument
from hybridspec.common.maths.features import decode_features, encode_features, join_blocks
from hybridspec.common.protocol.proto import verifier_pb2 as pb
from hybridspec.common.protocol.proto import verifier_pb2_grpc as pb_grpc
from hybridspec.common.protocol.wire import (DraftBlock, FeatureBlock, FeatureFormat, SessionOpened, SessionSpec,
                                    VerifyResult)

from tinymodels import VOCAB, greedy_reference

PROMPT = [7, 19, 40, 81, 100, 5, 33, 9]  # 7 context tokens: prefill chunks of 3, 3 and 1
LIMITS = VerifierLimits(max_context=512, max_draft=16, max_sessions=16, prefill_chunk=3)
# Per round, the draft as a pattern over the target's own greedy continuation: "." its token, "x" a wrong
# one. Full acceptance, partial, rejection at once, an empty draft.
ROUNDS = ["...", "..x.", "x..", "", ".x", "....", "x"]
PB_FORMAT = {FeatureFormat.FP16: pb.FEATURES_FP16, FeatureFormat.INT8: pb.FEATURES_INT8}


@pytest.fixture(scope="module")
def feature_server(target):
    """A real gRPC front door whose verifier prefills in chunks of 3 tokens."""
    srv = BackgroundServer(Verifier(target, LIMITS))
    yield srv
    srv.stop()


@pytest.fixture
def stub(feature_server):
    with grpc.insecure_channel(feature_server.address) as channel:
        yield pb_grpc.VerifierStub(channel)


def teacher_forced(target, ids: list[int]) -> torch.Tensor:
    """The target's final hidden states over `ids` in one plain forward pass, [len(ids), H]."""
    with torch.inference_mode():
        return target.model.get_decoder()(input_ids=torch.tensor([ids])).last_hidden_state[0].float()


def int8_step(reference: torch.Tensor) -> torch.Tensor:
    """One int8 quantisation step per vector: the largest error int8 features may have."""
    return reference.abs().amax(dim=1, keepdim=True) / 127


def draft_for(pattern: str, continuation: list[int]) -> tuple[int, ...]:
    return tuple(t if c == "." else (t + 1) % VOCAB for c, t in zip(pattern, continuation))


def run_session(target, stub, fmt: FeatureFormat | None, prompt=PROMPT):
    """Open a session asking for `fmt` (None: not asking) and run ROUNDS of greedy rounds through gRPC.
    Returns (every reply's features in order, the final committed tokens, the replies)."""
    reference = greedy_reference(target, prompt, 40)
    request = pb.OpenSessionRequest(committed_ids=prompt)
    if fmt is not None:
        request.features = PB_FORMAT[fmt]
    opened = codec.opened_from_pb(stub.OpenSession(request))
    blocks, replies, committed = [opened.features], [opened], list(prompt)
    for r, pattern in enumerate(ROUNDS):
        done = len(committed) - len(prompt)
        draft = draft_for(pattern, reference[done:])
        reply = stub.Verify(codec.block_to_pb(DraftBlock(opened.session_id, r, len(committed), draft)))
        result = codec.result_from_pb(reply)
        expected = (pattern + "x").index("x")
        assert result.num_accepted == expected, f"round {r}: the target did not follow its own greedy decoding"
        committed += [*draft[:result.num_accepted], result.next_token]
        assert committed == list(prompt) + reference[:len(committed) - len(prompt)]
        blocks.append(result.features)
        replies.append(result)
    stub.CloseSession(pb.CloseSessionRequest(session_id=opened.session_id))
    return blocks, committed, replies


# ---- the wire format ------------------------------------------------------------------------------

def test_encode_decode_round_trip_within_the_format_error():
    hidden = torch.randn(5, 64, generator=torch.Generator().manual_seed(0)) * 3
    fp16 = encode_features(hidden, 4, FeatureFormat.FP16)
    fp16.validate()
    assert (fp16.start, fp16.count, fp16.dim, fp16.nbytes) == (4, 5, 64, 5 * 64 * 2)
    assert torch.allclose(decode_features(fp16), hidden, rtol=2 ** -10, atol=1e-4)
    int8 = encode_features(hidden, 4, FeatureFormat.INT8)
    int8.validate()
    assert int8.nbytes == 5 * 64 + 5 * 2
    assert ((decode_features(int8) - hidden).abs() <= int8_step(hidden)).all()


def test_join_blocks_concatenates_consecutive_blocks():
    hidden = torch.randn(7, 16, generator=torch.Generator().manual_seed(1))
    for fmt in (FeatureFormat.FP16, FeatureFormat.INT8):
        parts = [encode_features(hidden[:3], 10, fmt), encode_features(hidden[3:6], 13, fmt),
                 encode_features(hidden[6:], 16, fmt)]
        assert join_blocks(parts) == encode_features(hidden, 10, fmt)
        with pytest.raises(ValueError):
            join_blocks([parts[0], parts[2]])  # a gap
    with pytest.raises(ValueError):
        join_blocks([encode_features(hidden[:3], 0, FeatureFormat.FP16), encode_features(hidden[3:], 3,
                                                                                          FeatureFormat.INT8)])


@pytest.mark.parametrize("block, fragment", [
    (FeatureBlock(0, 2, 4, FeatureFormat.FP16, bytes(15)), "data bytes"),
    (FeatureBlock(0, 2, 4, FeatureFormat.FP16, bytes(16), bytes(4)), "scale bytes"),
    (FeatureBlock(0, 2, 4, FeatureFormat.INT8, bytes(8)), "scale bytes"),
    (FeatureBlock(0, 2, 4, FeatureFormat.INT8, bytes(9), bytes(4)), "data bytes"),
    (FeatureBlock(0, 0, 4, FeatureFormat.FP16, b""), "count"),
    (FeatureBlock(0, 1, 4, FeatureFormat.NONE, b""), "format"),
])
def test_validate_refuses_lengths_that_do_not_match_the_shape(block, fragment):
    with pytest.raises(InvalidArgument, match=fragment):
        block.validate()


def test_codec_round_trips_features():
    block = encode_features(torch.randn(3, 8), 5, FeatureFormat.INT8)
    for message in (VerifyResult(2, 2, 9, 8, features=block), VerifyResult(2, 2, 9, 8)):
        assert codec.result_from_pb(codec.result_to_pb(message)) == message
    for message in (SessionOpened("s", 6, "h:1", block), SessionOpened("s", 6)):
        assert codec.opened_from_pb(codec.opened_to_pb(message)) == message
    spec = SessionSpec("s", (1, 2), features=FeatureFormat.FP16)
    assert codec.session_from_pb(codec.session_to_pb(spec)) == spec
    assert codec.session_from_pb(pb.OpenSessionRequest(committed_ids=[1])).features is FeatureFormat.NONE
    bad = codec.features_to_pb(block)
    bad.format = 9
    with pytest.raises(InvalidArgument, match="features.format 9"):
        codec.features_from_pb(bad)


# ---- what a session receives ------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", [FeatureFormat.FP16, FeatureFormat.INT8])
def test_features_cover_every_committed_position_but_the_last(target, stub, fmt):
    blocks, committed, replies = run_session(target, stub, fmt)
    assert all(b is not None and b.format is fmt for b in blocks)
    # The open: the prompt's context, chunk by chunk in one block; each round: its committed context.
    assert (blocks[0].start, blocks[0].count) == (0, len(PROMPT) - 1)
    for before, result, block in zip(replies, replies[1:], blocks[1:]):
        assert block.start == before.committed_len - 1 and block.count == result.num_accepted + 1
    for block in blocks:
        block.validate()
    joined = join_blocks(blocks)  # raises unless the starts are contiguous
    assert (joined.start, joined.count, joined.dim) == (0, len(committed) - 1, target.model.config.hidden_size)
    received, reference = decode_features(joined), teacher_forced(target, committed)[:-1]
    if fmt is FeatureFormat.FP16:
        torch.testing.assert_close(received, reference, rtol=2e-3, atol=2e-3)
    else:
        assert ((received - reference).abs() <= int8_step(reference) + 1e-4).all()


def test_a_session_that_did_not_ask_gets_none(target, stub, feature_server):
    info = codec.model_info_from_pb(stub.GetModelInfo(pb.GetModelInfoRequest()))
    assert info.feature_dim == target.model.config.hidden_size
    registry = feature_server.running.metrics.registry
    before = registry.get_sample_value("hybridspec_feature_bytes_total")
    blocks, _, _ = run_session(target, stub, None)
    assert blocks == [None] * len(blocks)
    assert registry.get_sample_value("hybridspec_feature_bytes_total") == before
    asked, _, _ = run_session(target, stub, FeatureFormat.INT8)
    assert registry.get_sample_value("hybridspec_feature_bytes_total") - before == sum(b.nbytes for b in asked)


def test_a_one_token_prompt_gets_its_features_with_the_first_round(target, stub):
    blocks, committed, _ = run_session(target, stub, FeatureFormat.FP16, prompt=[7])
    assert blocks[0] is None and blocks[1].start == 0
    torch.testing.assert_close(decode_features(join_blocks(blocks[1:])), teacher_forced(target, committed)[:-1],
                               rtol=2e-3, atol=2e-3)


def test_an_unknown_feature_format_is_invalid_argument(stub):
    with pytest.raises(grpc.RpcError) as info:
        stub.OpenSession(pb.OpenSessionRequest(committed_ids=[5, 6], features=7))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "features 7" in info.value.details()


def test_a_replayed_round_returns_the_same_features(stub):
    opened = stub.OpenSession(pb.OpenSessionRequest(committed_ids=PROMPT, features=pb.FEATURES_FP16))
    request = pb.VerifyRequest(session_id=opened.session_id, round=0, committed_len=len(PROMPT), draft_ids=[9, 9])
    first, again = stub.Verify(request), stub.Verify(request)
    assert first.HasField("features") and first.features == again.features
    assert (first.num_accepted, first.next_token, first.committed_len) == (again.num_accepted, again.next_token,
                                                                           again.committed_len)
    stub.CloseSession(pb.CloseSessionRequest(session_id=opened.session_id))


# ---- in one packed pass with other sessions ---------------------------------------------------------

def test_features_are_each_sessions_own_in_a_shared_pass(target):
    """Rounds with and without features and a prompt chunk asking for them, all in the same passes."""
    verifier = Verifier(target, LIMITS)
    prompts = {"plain": [5, 6, 7, 8], "eagle": [40, 41, 42, 43, 44]}
    verifier.open_session(SessionSpec("plain", tuple(prompts["plain"])))
    opened = verifier.open_session(SessionSpec("eagle", tuple(prompts["eagle"]), features=FeatureFormat.FP16))
    blocks = [opened.features]
    late = verifier.submit_open(SessionSpec("late", tuple(range(60, 70)), features=FeatureFormat.FP16))
    committed = {sid: list(p) for sid, p in prompts.items()}
    for r in range(4):
        rounds = [DraftBlock(sid, r, len(committed[sid]), (9, 10)) for sid in committed]
        results = verifier.verify_batch(rounds)  # the first pass carries late's prompt too
        for block, result in zip(rounds, results):
            committed[block.session_id] += [*block.draft_ids[:result.num_accepted], result.next_token]
        assert results[0].features is None
        blocks.append(results[1].features)
    assert late.done() and late.result().features.count == 9
    for ids, block in ((committed["eagle"], join_blocks(blocks)), (list(range(60, 70)), late.result().features)):
        torch.testing.assert_close(decode_features(block), teacher_forced(target, ids)[:-1], rtol=2e-3, atol=2e-3)


def test_asking_for_features_leaves_the_logits_bit_identical(target):
    engine = Verifier(target, LIMITS).engine
    tokens = [5, 9, 13, 200, 31]
    out = []
    for features in (False, True):
        kv = engine.new_sequence()
        engine.reserve(kv, len(tokens))
        out.append(engine.forward([Feed(kv, tokens, scored=True, features=features)])[0])
        engine.release(kv)
    assert out[0].hidden is None and out[1].hidden.shape == (len(tokens), target.model.config.hidden_size)
    assert torch.equal(out[0].logits, out[1].logits)
