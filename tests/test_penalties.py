"""Repetition, frequency and presence penalties: one function, applied identically by drafter, verifier
and cloud-only decoding, so greedy output equals the penalised target's and sampling stays exact
(docs/design.md §2.1)."""
import pytest
import torch
from hybridspec.common.protocol import codec
from hybridspec.common.protocol.errors import InvalidArgument
from hybridspec.common.maths.sampling import gumbel_max, logits_to_probs, penalize
from hybridspec.common.protocol.wire import GenerateSpec, Mode, SamplingParams, SessionSpec
from hybridspec.edge.client import VerifierClient
from hybridspec.edge.config import EdgeConfig
from hybridspec.edge.worker import EdgeWorker
from tinymodels import EVERY_ROUND
from transformers import RepetitionPenaltyLogitsProcessor

PROMPT = [5, 17, 33, 80, 17, 33, 5, 9]


def brute_force(logits, params, context, prompt_len, block):
    """Each row on its own, token by token: HF's repetition rule, then OpenAI's counts."""
    out = logits.clone().double()
    for j in range(logits.shape[0]):
        history = list(context) + list(block[:j])
        generated = history[prompt_len:]
        for v in range(logits.shape[1]):
            x = float(logits[j, v])
            if v in history:
                x = x / params.repetition_penalty if x > 0 else x * params.repetition_penalty
            count = generated.count(v)
            x -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
            out[j, v] = x
    return out.float()


@pytest.mark.parametrize("rep,freq,pres", [(1.3, 0.0, 0.0), (1.0, 0.7, 0.0), (1.0, 0.0, -0.5),
                                           (0.8, 1.5, 0.5), (2.0, -1.0, 2.0)])
def test_penalize_matches_a_per_row_loop(rep, freq, pres):
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.7, repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres)
    for trial in range(20):
        vocab, gamma = 12, trial % 5
        context = torch.randint(vocab, (3 + trial % 7,), generator=gen).tolist()
        block = torch.randint(vocab, (gamma,), generator=gen).tolist()
        logits = torch.randn(gamma + 1, vocab, generator=gen) * 3
        prompt_len = trial % (len(context) + 1)
        torch.testing.assert_close(penalize(logits, params, context, prompt_len, block),
                                   brute_force(logits, params, context, prompt_len, block))
        # Fewer rows than the block allows: the rows that are there see the same histories.
        torch.testing.assert_close(penalize(logits[:1], params, context, prompt_len, block),
                                   brute_force(logits[:1], params, context, prompt_len, block))


def test_repetition_penalty_is_hugging_faces():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(1)) * 4
    context = [3, 7, 7, 12, 49]
    want = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([context]), logits.clone())
    got = penalize(logits, SamplingParams(repetition_penalty=1.7), context, len(context))
    torch.testing.assert_close(got, want)


def test_neutral_penalties_change_nothing():
    logits = torch.randn(4, 30)
    for params in (SamplingParams(), SamplingParams(temperature=0.9, top_k=5),
                   SamplingParams(repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=-0.0)):
        assert not params.penalized
        assert penalize(logits, params, [1, 2, 3], 1, [4, 5, 6]) is logits


@pytest.mark.parametrize("kwargs,field", [({"repetition_penalty": 0.0}, "repetition_penalty"),
                                          ({"repetition_penalty": 10.5}, "repetition_penalty"),
                                          ({"repetition_penalty": float("nan")}, "repetition_penalty"),
                                          ({"frequency_penalty": 2.5}, "frequency_penalty"),
                                          ({"presence_penalty": -2.01}, "presence_penalty"),
                                          ({"presence_penalty": float("inf")}, "presence_penalty")])
def test_out_of_range_penalties_name_the_field(kwargs, field):
    with pytest.raises(InvalidArgument, match=field):
        SamplingParams(**kwargs)


def test_prompt_len_is_validated_and_resolved():
    assert SessionSpec("s", (1, 2, 3)).prompt_end == 3  # 0: everything sent is prompt
    assert SessionSpec("s", (1, 2, 3), prompt_len=2).prompt_end == 2
    assert GenerateSpec((4, 5)).prompt_end == 2
    with pytest.raises(InvalidArgument, match="prompt_len"):
        SessionSpec("s", (1, 2, 3), prompt_len=4).validate(10)
    with pytest.raises(InvalidArgument, match="prompt_len"):
        GenerateSpec((1, 2), prompt_len=3).validate(10)


def test_the_new_fields_cross_the_wire():
    sampling = SamplingParams(temperature=0.5, repetition_penalty=1.25, frequency_penalty=0.5, presence_penalty=-1.5)
    spec = SessionSpec("s", (1, 2, 3, 4), sampling, Mode.COUPLED, seed=9, prompt_len=3)
    assert codec.session_from_pb(codec.session_to_pb(spec)) == spec
    gen = GenerateSpec((1, 2, 3), sampling, 5, 6, prompt_len=2)
    assert codec.generate_from_pb(codec.generate_to_pb(gen)) == gen
    unset = codec.sampling_to_pb(SamplingParams())
    unset.repetition_penalty = 0.0  # proto3's default: not sent, so off
    assert codec.sampling_from_pb(unset) == SamplingParams()


# ---- end to end ----------------------------------------------------------------------------------

PENALTIES = {"repetition_penalty": 1.5, "frequency_penalty": 0.5, "presence_penalty": 0.25}  # exact in float32


@torch.inference_mode()
def penalised_target(target, prompt, n, params, seed=None):
    """The target alone with the penalties written out here: greedy argmax, or Gumbel-max by position."""
    ids = list(prompt)
    for _ in range(n):
        logits = target.model(torch.tensor([ids])).logits[0, -1].double()
        generated = ids[len(prompt):]
        for v in set(ids):
            logits[v] = logits[v] / params.repetition_penalty if logits[v] > 0 else logits[v] * params.repetition_penalty
        for v in set(generated):
            logits[v] -= params.frequency_penalty * generated.count(v) + params.presence_penalty
        if params.greedy:
            ids.append(int(logits.argmax()))
        else:
            probs = logits_to_probs(logits.float(), params)
            support = torch.nonzero(probs > 0, as_tuple=True)[0]
            ids.append(gumbel_max(support, probs[support], seed, len(ids)))
        if ids[-1] in target.eos_token_ids:
            break
    return ids[len(prompt):]


def generate(server, drafter, **cfg):
    config = EdgeConfig.of(cloud=server.address, max_new_tokens=24, **cfg)
    with VerifierClient(server.address) as client:
        return EdgeWorker(drafter, client, config).generate(PROMPT).token_ids


def test_greedy_with_penalties_is_the_penalised_targets_own_decoding(server, target, random_drafter):
    params = SamplingParams(**PENALTIES)
    want = penalised_target(target, PROMPT, 24, params)
    assert want != penalised_target(target, PROMPT, 24, SamplingParams())  # the penalties matter here
    assert generate(server, random_drafter, **PENALTIES, **EVERY_ROUND, max_draft=4) == want
    assert generate(server, target, **PENALTIES, **EVERY_ROUND, max_draft=4) == want  # drafts all accepted
    assert generate(server, random_drafter, **PENALTIES, cloud_only=True) == want
    only_repetition = SamplingParams(repetition_penalty=1.3)
    assert generate(server, random_drafter, repetition_penalty=1.3, **EVERY_ROUND, max_draft=3) == \
        penalised_target(target, PROMPT, 24, only_repetition)


def test_a_drafter_equal_to_the_target_is_always_accepted_with_penalties(server, target):
    stats_cfg = dict(**PENALTIES, **EVERY_ROUND, max_draft=4, fallback_threshold=0.0)
    config = EdgeConfig.of(cloud=server.address, max_new_tokens=24, **stats_cfg)
    with VerifierClient(server.address) as client:
        gen = EdgeWorker(target, client, config).generate(PROMPT)
    assert gen.stats.acceptance_rate == 1.0  # the drafter penalised its logits exactly as the verifier did


def test_coupled_sampling_with_penalties_is_one_text_per_seed(server, target, random_drafter):
    cfg = dict(temperature=0.9, seed=5, mode="coupled", **PENALTIES)
    want = penalised_target(target, PROMPT, 24, SamplingParams(temperature=0.9, **PENALTIES), seed=5)
    assert generate(server, random_drafter, cloud_only=True, **cfg) == want
    assert generate(server, random_drafter, **EVERY_ROUND, max_draft=3, **cfg) == want
