"""Greedy edge→gRPC→verifier output is token-for-token the target's own greedy decoding."""
import pytest

from hybridspec.common.protocol.wire import GenerateSpec
from hybridspec.edge.client import VerifierClient
from hybridspec.edge.config import EdgeConfig
from hybridspec.edge.generation import Origin
from hybridspec.edge.worker import EdgeWorker

from tinymodels import EVERY_ROUND, greedy_reference

PROMPTS = [[7], [5, 17, 33, 80], [9, 200, 31, 31, 64, 12, 100, 8, 41, 77, 5, 190, 6]]
NEW_TOKENS = 24


def run(server, drafter, **cfg):
    config = EdgeConfig.of(cloud=server.address, max_new_tokens=NEW_TOKENS, **{**EVERY_ROUND, **cfg})
    with VerifierClient(server.address) as client:
        worker = EdgeWorker(drafter, client, config)
        return [worker.generate(p) for p in PROMPTS]


@pytest.mark.parametrize("pipeline", [False, True], ids=["sequential", "pipelined"])
@pytest.mark.parametrize("gamma", range(1, 9))
def test_drafter_that_always_agrees(server, target, gamma, pipeline):
    gens = run(server, target, max_draft=gamma, fallback_threshold=0.0, pipeline=pipeline)
    for prompt, gen in zip(PROMPTS, gens):
        assert gen.token_ids == greedy_reference(target, prompt, NEW_TOKENS)
        assert gen.stats.acceptance_rate == 1.0
        assert Origin.CORRECTED not in gen.origins


@pytest.mark.slow
@pytest.mark.parametrize("pipeline", [False, True], ids=["sequential", "pipelined"])
@pytest.mark.parametrize("gamma", range(1, 9))
def test_drafter_that_never_agrees(server, target, random_drafter, gamma, pipeline):
    gens = run(server, random_drafter, max_draft=gamma, fallback_threshold=0.0, pipeline=pipeline)
    for prompt, gen in zip(PROMPTS, gens):
        assert gen.token_ids == greedy_reference(target, prompt, NEW_TOKENS)
        assert gen.stats.acceptance_rate < 0.5


def test_fallback_threshold_shortens_blocks_without_changing_output(server, target, random_drafter):
    (gen,) = run(server, random_drafter, max_draft=8, fallback_threshold=0.99)[:1]
    assert gen.token_ids == greedy_reference(target, PROMPTS[0], NEW_TOKENS)
    # A random drafter is never 99% sure, so every block ends after its first token (the last
    # round has room for the verifier's token only and drafts nothing).
    assert gen.stats.fallbacks == gen.stats.drafted == gen.stats.rounds - 1


def test_generation_stops_at_eos_with_eos_included(server, target, verifier):
    eos = verifier.info.eos_token_ids[0]
    # Find a prompt whose greedy continuation reaches EOS within the budget.
    for first in range(4, 256):
        ref = greedy_reference(target, [first], 60)
        if eos in ref:
            break
    else:
        pytest.fail("no prompt of the tiny target reaches EOS within 60 tokens: the test cannot check stopping")
    config = EdgeConfig.of(cloud=server.address, max_new_tokens=60, max_draft=4, **EVERY_ROUND)
    with VerifierClient(server.address) as client:
        gen = EdgeWorker(target, client, config).generate([first])
    assert gen.token_ids == ref[: ref.index(eos) + 1]
    assert gen.eos and gen.finish_reason == "stop"


def test_cloud_only_generate_matches_the_reference(server, target):
    with VerifierClient(server.address) as client:
        tokens = list(client.generate(GenerateSpec(prompt_ids=tuple(PROMPTS[1]), max_new_tokens=NEW_TOKENS)))
    assert tokens == greedy_reference(target, PROMPTS[1], NEW_TOKENS)


def test_lost_session_is_reopened_transparently(server, target, random_drafter, verifier):
    """The verifier forgets the session mid-generation; the edge re-opens it and nothing changes."""
    config = EdgeConfig.of(cloud=server.address, max_new_tokens=NEW_TOKENS, max_draft=3, **EVERY_ROUND)
    with VerifierClient(server.address) as client:
        worker = EdgeWorker(random_drafter, client, config)
        calls = {"n": 0}
        original = client.submit

        def submit_and_forget(block):
            calls["n"] += 1
            if calls["n"] == 4:
                verifier.close_session(block.session_id)  # as after a replica restart or eviction
            return original(block)

        client.submit = submit_and_forget  # the real call still goes over gRPC
        gen = worker.generate(PROMPTS[1])
    assert gen.stats.reopens == 1
    assert gen.token_ids == greedy_reference(target, PROMPTS[1], NEW_TOKENS)


@pytest.mark.parametrize("cloud_only", [False, True])
def test_a_prompt_past_the_context_is_refused_before_any_work(server, random_drafter, cloud_only):
    """Found against the llama.cpp pool: a hybrid edge drafted over a too-long prompt for 11 s before
    the cloud refused it. The edge knows max_context from GetModelInfo: it refuses at once, naming the
    numbers, and opens nothing (INVALID_ARGUMENT, as the cloud's own check)."""
    from hybridspec.common.protocol.errors import InvalidArgument

    with VerifierClient(server.address) as client:
        worker = EdgeWorker(random_drafter, client, EdgeConfig.of(cloud=server.address, max_new_tokens=30,
                                                                  cloud_only=cloud_only, **EVERY_ROUND))
        opened = server.call(server.backend.status())[0].sessions
        with pytest.raises(InvalidArgument, match=r"the prompt \(500 tokens\) plus max_new_tokens \(30\) exceeds "
                                                  r"the verifier's max_context of 512"):
            worker.stream([5] * 500)  # before its first event: nothing drafted, nothing sent
        with pytest.raises(InvalidArgument, match="the prompt is 600 tokens; the verifier's max_context is 512"):
            worker.generate([5] * 600)
        assert server.call(server.backend.status())[0].sessions == opened
