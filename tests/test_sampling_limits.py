"""Every accepted sampling setting gives a well-defined distribution, on both sides.

A repetition penalty of 1e-38 lies inside the accepted range (0, 10]; it used to divide positive
logits into +inf, softmax turned them into NaN and every round of that session (and Generate, and
`edge serve`) failed with INTERNAL. These tests sweep the whole accepted ranges of temperature,
top-k, top-p and the three penalties, with logits of any finite size, through the edge's drafting
transform and the cloud's verification rules, and then over gRPC.
"""
import math

import grpc
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridspec.cloud.core.rules import apply_rule
from hybridspec.common.protocol.proto import verifier_pb2 as pb
from hybridspec.common.protocol.proto import verifier_pb2_grpc as pb_grpc
from hybridspec.common.maths.sampling import logits_to_probs, penalize, sample
from hybridspec.common.maths.sparse import truncate
from hybridspec.common.protocol.wire import (MAX_OPENAI_PENALTY, MAX_REPETITION_PENALTY, MAX_TEMPERATURE, MIN_TEMPERATURE,
                                    DraftBlock, Mode, SamplingParams, SessionSpec)

VOCAB = 12
FLOAT32_MAX = torch.finfo(torch.float32).max

# The accepted ranges, edges included; positive floats down to the smallest subnormal.
temperatures = st.one_of(st.just(0.0), st.floats(MIN_TEMPERATURE, MAX_TEMPERATURE))
repetition = st.floats(min_value=0.0, max_value=MAX_REPETITION_PENALTY, exclude_min=True)
openai_penalty = st.floats(-MAX_OPENAI_PENALTY, MAX_OPENAI_PENALTY)
top_p = st.floats(min_value=0.0, max_value=1.0, exclude_min=True)
params_st = st.builds(SamplingParams, temperature=temperatures, top_k=st.integers(0, VOCAB + 2), top_p=top_p,
                      repetition_penalty=repetition, frequency_penalty=openai_penalty,
                      presence_penalty=openai_penalty)
# Any finite float32 logit, from a model's ordinary ±30 to the largest a float32 holds.
logit = st.one_of(st.floats(-30, 30, width=32),
                  st.floats(-FLOAT32_MAX, FLOAT32_MAX, allow_nan=False, allow_infinity=False, width=32))
token = st.integers(0, VOCAB - 1)


@st.composite
def scored_block(draw):
    """(params, logits [γ+1, V], context, prompt_len, block of γ tokens)."""
    params = draw(params_st)
    gamma = draw(st.integers(0, 3))
    logits = torch.tensor(draw(st.lists(st.lists(logit, min_size=VOCAB, max_size=VOCAB),
                                        min_size=gamma + 1, max_size=gamma + 1)), dtype=torch.float32)
    context = draw(st.lists(token, min_size=1, max_size=8))
    prompt_len = draw(st.integers(0, len(context)))
    block = draw(st.lists(token, min_size=gamma, max_size=gamma))
    return params, logits, context, prompt_len, block


def assert_distribution(probs: torch.Tensor) -> None:
    assert torch.isfinite(probs).all(), probs
    assert (probs >= 0).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(probs.shape[:-1]), atol=1e-5, rtol=0)


@pytest.mark.slow
@settings(max_examples=400, deadline=None)
@given(scored_block())
def test_the_transform_is_a_distribution_for_every_accepted_setting(case):
    params, logits, context, prompt_len, block = case
    penalized = penalize(logits, params, context, prompt_len, block)
    assert not torch.isnan(penalized).any() and not torch.isposinf(penalized).any()
    probs = logits_to_probs(penalized, params)
    assert_distribution(probs)
    for row in probs:
        assert 0 <= sample(row, torch.Generator().manual_seed(0)) < VOCAB


@settings(max_examples=300, deadline=None)
@given(scored_block(), scored_block(), st.sampled_from([Mode.SPECULATIVE, Mode.COUPLED, Mode.BILD, Mode.LENIENT]),
       st.integers(0, 2**63 - 1))
@pytest.mark.slow
def test_drafting_and_every_rule_run_for_every_accepted_setting(target_case, draft_case, mode, seed):
    """The edge drafts as edge/drafter.py does (penalise, transform, truncate, sample); the cloud
    applies the session's rule to its own logits (cloud/core/verifier.py)."""
    params, target_logits, context, prompt_len, _ = target_case
    draft_logits = draft_case[1]
    if params.greedy:
        mode = Mode.GREEDY if mode is not Mode.BILD else Mode.BILD
    gamma = target_logits.shape[0] - 1
    gen = torch.Generator().manual_seed(seed % 2**32)
    block, support, probs = [], [], []
    for j in range(gamma):
        row = draft_logits[min(j, draft_logits.shape[0] - 1)]
        q = logits_to_probs(penalize(row[None], params, context + block, prompt_len)[0], params)
        assert_distribution(q)
        if params.greedy:
            block.append(int(q.argmax()))
            continue
        dist = truncate(q, 4)
        assert math.isclose(float(dist.probs.sum()), 1.0, abs_tol=1e-5) and (dist.probs > 0).all()
        block.append(dist.sample(gen))
        support.append(tuple(dist.ids.tolist()))
        probs.append(tuple(dist.probs.tolist()))
    spec = SessionSpec(session_id="s", committed_ids=tuple(context), sampling=params, mode=mode, seed=seed,
                       prompt_len=prompt_len)
    draft = DraftBlock("s", 0, len(context), tuple(block),
                       tuple(support) if mode.uses_draft_probs else (), tuple(probs) if mode.uses_draft_probs else ())
    draft.validate(VOCAB, 16, needs_probs=mode.uses_draft_probs)
    nodes, token = apply_rule(spec, draft, target_logits, list(context))
    assert nodes == list(range(len(nodes))) and 0 <= len(nodes) <= gamma and 0 <= token < VOCAB


# ---- over gRPC: the reported request -----------------------------------------------------------

TINY_PROMPT = [1, 96, 198, 33, 114, 60, 17, 240, 47, 2]  # ids of the tiny test vocabulary (256)


@pytest.fixture
def stub(server):
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.VerifierStub(channel)


@pytest.mark.parametrize("temperature", [1.0, MIN_TEMPERATURE])
def test_a_vanishing_repetition_penalty_verifies_and_generates(stub, temperature):
    sampling = pb.SamplingParams(temperature=temperature, repetition_penalty=1e-38)
    opened = stub.OpenSession(pb.OpenSessionRequest(committed_ids=TINY_PROMPT, sampling=sampling, seed=1))
    reply = stub.Verify(pb.VerifyRequest(session_id=opened.session_id, round=0, committed_len=len(TINY_PROMPT)))
    assert reply.committed_len == len(TINY_PROMPT) + 1 and 0 <= reply.next_token < 256
    tokens = [r.token_id for r in stub.Generate(pb.GenerateRequest(prompt_ids=TINY_PROMPT, max_new_tokens=4,
                                                                   sampling=sampling, seed=1))]
    assert 1 <= len(tokens) <= 4


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=4), st.integers(0, 2**31 - 1), st.booleans())
def test_greedy_argmaxes_match_torch_on_the_cpu_ties_included(rows_per_round, seed, penalized):
    """The CPU path takes argmaxes with numpy (a tenth of torch's per-call cost): it must pick what
    torch picks, the first of tied maxima included, and leave penalized rounds to the full rule."""
    from hybridspec.cloud.core.rules import prepare_pass

    g = torch.Generator().manual_seed(seed)
    logits = [torch.randint(0, 3, (n, 50), generator=g).float() for n in rows_per_round]  # many ties
    sampling = SamplingParams(repetition_penalty=1.3) if penalized else SamplingParams()
    specs = [SessionSpec("s", (1, 2), sampling=sampling if r == 0 else SamplingParams()) for r in range(len(logits))]
    got = [prepared.best for prepared in prepare_pass(specs, logits)]
    for r, rows in enumerate(logits):
        expected = None if (penalized and r == 0) else rows.argmax(dim=-1).tolist()
        assert got[r] == expected
