"""Wire dataclasses survive the protobuf round trip unchanged."""
from hybridspec.common.protocol import codec
from hybridspec.common.protocol.wire import (DraftBlock, GenerateSpec, Mode, ModelInfo, SamplingParams, SessionSpec,
                                    VerifyResult)


def test_round_trips():
    sampling = SamplingParams(temperature=0.5, top_k=20, top_p=0.75)
    spec = SessionSpec("s1", (1, 2, 3), sampling, Mode.LENIENT, seed=2**40, rollback_threshold=3.5,
                       lenience=0.5, tokenizer_fingerprint="t", model_fingerprint="m", next_round=7)
    assert codec.session_from_pb(codec.session_to_pb(spec)) == spec
    block = DraftBlock("s1", 4, 10, (5, 6), ((5, 9), (6,)), ((0.75, 0.25), (1.0,)))
    assert codec.block_from_pb(codec.block_to_pb(block)) == block
    tree = DraftBlock("s1", 4, 10, (5, 6, 7), parents=(-1, -1, 1))
    assert codec.block_from_pb(codec.block_to_pb(tree)) == tree
    result = VerifyResult(4, 1, 8, 12, 0.5)
    assert codec.result_from_pb(codec.result_to_pb(result)) == result
    tree_result = VerifyResult(4, 2, 8, 13, 0.5, accepted_path=(1, 2))
    assert codec.result_from_pb(codec.result_to_pb(tree_result)) == tree_result
    info = ModelInfo("m", 100, "t", "f", 10, 4, 2, 60, (2, 3), feature_dim=64, max_tree_nodes=32)
    assert codec.model_info_from_pb(codec.model_info_to_pb(info)) == info
    gen = GenerateSpec((1, 2), sampling, 9, 3, "t")
    assert codec.generate_from_pb(codec.generate_to_pb(gen)) == gen


def test_unspecified_mode_follows_temperature():
    greedy = codec.session_to_pb(SessionSpec("s", (1,)))
    greedy.mode = 0
    assert codec.session_from_pb(greedy).mode is Mode.GREEDY
    sampled = codec.session_to_pb(SessionSpec("s", (1,), SamplingParams(temperature=1.0), Mode.SPECULATIVE))
    sampled.mode = 0
    assert codec.session_from_pb(sampled).mode is Mode.SPECULATIVE


def test_a_timed_answer_is_the_answer_with_its_timings_replaced():
    """VerifyResult.timed (what a step calls for every round it answers) is `dataclasses.replace` of the
    two timings: equal, of the same class, hashed alike, and the answer it came from unchanged."""
    import dataclasses
    import pickle

    result = VerifyResult(4, 2, 8, 13, batch_size=64, accepted_path=(1, 2))
    timed = result.timed(12.5, 0.25)
    assert timed == dataclasses.replace(result, verify_ms=12.5, queue_ms=0.25) and type(timed) is VerifyResult
    assert hash(timed) == hash(dataclasses.replace(result, verify_ms=12.5, queue_ms=0.25))
    assert result.verify_ms == 0.0 and result.queue_ms == 0.0
    assert pickle.loads(pickle.dumps(timed)) == timed
