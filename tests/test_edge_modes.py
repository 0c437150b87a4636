"""The edge worker's modes over real gRPC: adaptive γ, cloud-only hand-over, offline and recovery,
pipelining, and the event stream. Every output must still be the target's own greedy decoding."""
import time

import pytest

from hybridspec.common.protocol.errors import Unavailable
from hybridspec.edge import generation
from hybridspec.edge.client import VerifierClient
from hybridspec.edge.config import EdgeConfig
from hybridspec.edge.controller import WARMUP_CLOUD_TOKENS, Controller
from hybridspec.edge.drafter import ModelDrafter
from hybridspec.edge.estimates import Estimates
from hybridspec.edge.generation import EventKind, Generation, Origin
from hybridspec.edge.worker import EdgeWorker
from hybridspec.netem.relay import BackgroundLink
from hybridspec.netem.shaping import LinkSpec

from tinymodels import greedy_reference

PROMPT = [5, 17, 33, 80]
NEW = 40


def generate(address, drafter, **cfg):
    config = EdgeConfig.of(cloud=address, max_new_tokens=NEW, max_draft=4, fallback_threshold=0.0, **cfg)
    with VerifierClient(address, timeout_s=config.link.timeout_s) as client:
        return EdgeWorker(drafter, client, config).generate(PROMPT)


def test_adaptive_policy_is_lossless(server, target, random_drafter):
    for drafter in (target, random_drafter):
        gen = generate(server.address, drafter, gamma_policy="adaptive", cloud_only_switch=False)
        assert gen.token_ids == greedy_reference(target, PROMPT, NEW)
        assert gen.stats.rounds >= 2


def test_cloud_only_decoding_when_hybrid_cannot_win(server, target, random_drafter):
    """The tiny drafter costs about as much as the tiny target: no block length can pay off, so the
    edge measures that in its first tokens and leaves decoding to the cloud."""
    gen = generate(server.address, random_drafter, gamma_policy="adaptive", cloud_only_switch=True, probe_tokens=8)
    assert gen.token_ids == greedy_reference(target, PROMPT, NEW)
    assert gen.stats.cloud_only_tokens > NEW // 2 and gen.stats.cloud_streams >= 1
    assert Origin.CLOUD in gen.origins and any("cloud-only" in n for n in gen.stats.notices)


def test_pipelined_drafting_uses_its_predrafts(server, target):
    gen = generate(server.address, target, gamma_policy="fixed", cloud_only_switch=False, pipeline=True)
    assert gen.token_ids == greedy_reference(target, PROMPT, NEW)
    assert gen.stats.predrafted > 0 and gen.stats.pipeline_hits > 0


def test_events_add_up_to_the_generation(server, target, random_drafter):
    config = EdgeConfig.of(cloud=server.address, max_new_tokens=NEW, max_draft=4, gamma_policy="fixed",
                           cloud_only_switch=False)
    with VerifierClient(server.address) as client:
        run = EdgeWorker(random_drafter, client, config).stream(PROMPT)
        events = list(run)
    committed = [t for e in events if e.kind is EventKind.COMMIT for t in e.tokens]
    assert committed == run.token_ids == greedy_reference(target, PROMPT, NEW)
    drafts = [e for e in events if e.kind is EventKind.DRAFT]
    assert drafts and all(e.provisional for e in drafts)


@pytest.fixture
def link(server):
    """An emulated link in front of the shared server, which tests can cut and restore."""
    with BackgroundLink(LinkSpec(), server.address) as link:
        yield link


def _cut_during_round(client, link, at_round: int):
    """Cut the link just before the at_round-th round is sent."""
    original, calls = client.submit, {"n": 0}

    def submit(block):
        calls["n"] += 1
        if calls["n"] == at_round:
            link.set_down(True)
        return original(block)

    client.submit = submit


def _restored_after_offline_tokens(gen, link, offline: int = 2) -> list:
    """The generation's events, the link restored once it has drafted `offline` tokens alone: the
    outage lasts until the edge has worked through it, however fast or slow this machine is."""
    events = []
    for event in gen:
        events.append(event)
        if sum(e.kind is EventKind.UNVERIFIED for e in events) == offline:
            link.set_down(False)
    return events


@pytest.mark.parametrize("drafter_name", ["target", "random"])
def test_offline_tokens_are_verified_when_the_cloud_returns(link, target, random_drafter, drafter_name):
    drafter = target if drafter_name == "target" else random_drafter
    config = EdgeConfig.of(cloud=link.address, max_new_tokens=NEW, max_draft=4, fallback_threshold=0.0,
                           gamma_policy="fixed", cloud_only_switch=False, allow_unverified=True, timeout_s=5,
                           reconnect_s=0.2)
    with VerifierClient(link.address, timeout_s=config.link.timeout_s) as client:
        worker = EdgeWorker(drafter, client, config)
        _cut_during_round(client, link, at_round=3)
        gen = worker.stream(PROMPT)
        events = _restored_after_offline_tokens(gen, link)
    assert gen.token_ids == greedy_reference(target, PROMPT, NEW)
    assert Origin.UNVERIFIED not in gen.origins, (gen.stats, [e for e in events if e.kind is not EventKind.UNVERIFIED])
    assert gen.stats.offline_tokens > 0
    assert any(e.kind is EventKind.UNVERIFIED for e in events)
    if drafter_name == "random":  # its offline guesses are wrong: they are withdrawn and corrected
        assert gen.stats.rolled_back > 0 and any(e.kind is EventKind.ROLLBACK for e in events)
    else:
        assert gen.stats.rolled_back == 0


def test_without_allow_unverified_an_outage_is_a_clear_error(link, target):
    config = EdgeConfig.of(cloud=link.address, max_new_tokens=NEW, max_draft=4, gamma_policy="fixed",
                           cloud_only_switch=False, timeout_s=3)
    with VerifierClient(link.address, timeout_s=config.link.timeout_s) as client:
        worker = EdgeWorker(target, client, config)
        _cut_during_round(client, link, at_round=2)  # and never restored
        # A reset stream says "unreachable"; on a loaded machine the reply timeout may fire first.
        gen = worker.stream(PROMPT)
        with pytest.raises(Unavailable, match="unreachable|did not answer within"):
            list(gen)
    # Nothing verified is lost: the generation holds what was committed before the outage.
    assert gen.error and 0 < len(gen.token_ids) < NEW
    assert gen.token_ids == greedy_reference(target, PROMPT, NEW)[:len(gen.token_ids)]
    assert gen.text == target.tokenizer.decode(gen.token_ids, skip_special_tokens=True)


def test_allow_unverified_works_when_the_cloud_is_down_at_start(link, target):
    """The edge starts while the cloud is away, drafts alone, and has everything verified once the
    cloud comes back: the output is then the target's, none of it unverified."""
    config = EdgeConfig.of(cloud=link.address, max_new_tokens=NEW, max_draft=4, fallback_threshold=0.0,
                           gamma_policy="fixed", cloud_only_switch=False, allow_unverified=True, timeout_s=5,
                           reconnect_s=0.2)
    link.set_down(True)
    with VerifierClient(link.address, timeout_s=config.link.timeout_s) as client:
        worker = EdgeWorker(target, client, config)
        assert not worker.connected
        gen = worker.stream(PROMPT)
        _restored_after_offline_tokens(gen, link)
    assert gen.token_ids == greedy_reference(target, PROMPT, NEW)
    assert gen.stats.offline_tokens > 0 and gen.stats.unverified == 0 and worker.connected


def test_without_allow_unverified_a_cloud_down_at_start_is_an_error(link, target):
    link.set_down(True)
    config = EdgeConfig.of(cloud=link.address, max_new_tokens=NEW, timeout_s=2)
    with VerifierClient(link.address, timeout_s=config.link.timeout_s) as client, pytest.raises(Unavailable):
        EdgeWorker(target, client, config)


def test_cloud_only_baseline_decodes_everything_in_the_cloud(server, target, random_drafter):
    """`edge generate --cloud-only`: the same path, the cloud decoding alone from start to end."""
    config = EdgeConfig.of(cloud=server.address, max_new_tokens=NEW, cloud_only=True)
    with VerifierClient(server.address) as client:
        gen = EdgeWorker(random_drafter, client, config).generate(PROMPT)
    assert gen.token_ids == greedy_reference(target, PROMPT, NEW)
    assert gen.stats.rounds == 0 and gen.stats.cloud_streams == 1 and gen.stats.notices == []
    assert set(gen.origins) == {Origin.CLOUD}


def test_a_worker_that_measured_a_fast_cloud_starts_cloud_only(server, target, random_drafter):
    """Rates carry over between generations: a worker that measured a fast cloud starts cloud-only."""
    config = EdgeConfig.of(cloud=server.address, max_new_tokens=NEW, max_draft=4, fallback_threshold=0.0,
                           cloud_only_switch=True, probe_tokens=8)
    with VerifierClient(server.address) as client:
        worker = EdgeWorker(random_drafter, client, config)
        worker.estimates.cloud_token_s.add(1e-5)  # as if measured by an earlier generation
        gen = worker.generate(PROMPT)
    assert gen.token_ids == greedy_reference(target, PROMPT, NEW)
    assert gen.stats.cloud_only_tokens == NEW and gen.stats.rounds == 0
    assert any("starting with cloud-only" in n for n in gen.stats.notices)


def test_a_cloud_only_token_reaches_the_user_before_the_drafter_guesses_along(server, target, monkeypatch):
    """Regression: while decoding cloud-only, the edge drafted its shadow guess of each token before
    handing the token on, so the first token waited for the drafter to be built and fed the prompt
    (20-40 ms more time to first token with the llama.cpp drafter)."""
    config = EdgeConfig.of(cloud=server.address, max_new_tokens=12, max_draft=4)  # a new worker warms up cloud-only
    with VerifierClient(server.address, timeout_s=config.link.timeout_s) as client:
        run = EdgeWorker(target, client, config).stream(PROMPT)
        committed, guessed_after = [], []
        propose = ModelDrafter.propose  # the generation's drafter is built once its first phase runs

        def counting(*args, **kwargs):
            guessed_after.append(len(committed))
            return propose(*args, **kwargs)

        monkeypatch.setattr(ModelDrafter, "propose", counting)
        for event in run:
            if event.kind is EventKind.COMMIT:
                committed.extend(event.tokens)
    assert run.token_ids == greedy_reference(target, PROMPT, 12)
    assert guessed_after and guessed_after[0] >= 1, "the drafter guessed before the first token was handed on"
    assert run.stats.cloud_only_tokens == 12


def test_shadow_drafting_measures_the_drafters_time(server, target):
    """Regression: an edge that stayed cloud-only judged hybrid with the default drafting time (5 ms per
    token) however fast its drafter was, since only hybrid rounds timed drafting."""
    config = EdgeConfig.of(cloud=server.address, max_new_tokens=12, max_draft=4)  # a new worker warms up cloud-only
    with VerifierClient(server.address, timeout_s=config.link.timeout_s) as client:
        worker = EdgeWorker(target, client, config)
        gen = worker.generate(PROMPT)
    assert gen.stats.rounds == 0 and gen.stats.cloud_only_tokens == 12
    assert worker.estimates.draft_s.value is not None  # measured: no longer the default


def test_shadow_drafting_measures_where_the_clouds_tokens_rank(server, target):
    """While cloud-only, the drafter's guesses also count where the cloud's token stood among its
    choices, so the tree policy knows ρ_r before the first round is risked."""
    config = EdgeConfig.of(cloud=server.address, max_new_tokens=12, max_draft=4)  # a new worker warms up cloud-only
    with VerifierClient(server.address, timeout_s=config.link.timeout_s) as client:
        worker = EdgeWorker(target, client, config)
        prior = worker.estimates.ranks[0]
        gen = worker.generate(PROMPT)
    assert gen.stats.rounds == 0
    # The drafter is the target: every guess saw the cloud's token as its first choice. (How many tokens
    # are guessed depends on the time the edge had: those it waited for at least as long as a guess takes.)
    assert gen.stats.shadow_guesses > 0 and worker.estimates.ranks[0] > prior


def test_a_cloud_only_stream_prices_a_switch_by_its_wait_for_the_first_token(server, target, monkeypatch):
    """Regression: until a session had been opened, a switch to hybrid was priced at one round trip,
    without the prefill. With 8 edges on one replica, two edges switched after their warm-up and
    then waited 3 s for their session's prefill behind the others' prompts. A cloud-only stream's
    wait for its first token is the same round trip and prefill, queue included: it is observed once,
    for the whole prompt, when that token arrives (before it is handed on)."""
    config = EdgeConfig.of(cloud=server.address, max_new_tokens=12, max_draft=4)  # a new worker warms up cloud-only
    committed, observed = [], []
    observe_open = Estimates.observe_open

    def recording(self, seconds, context_tokens):
        observed.append((context_tokens, len(committed)))
        observe_open(self, seconds, context_tokens)

    monkeypatch.setattr(Estimates, "observe_open", recording)
    with VerifierClient(server.address, timeout_s=config.link.timeout_s) as client:
        worker = EdgeWorker(target, client, config)
        run = worker.stream(PROMPT)
        for event in run:
            if event.kind is EventKind.COMMIT:
                committed.extend(event.tokens)
    assert run.stats.rounds == 0 and run.stats.reopens == 0
    assert observed == [(len(PROMPT), 0)]
    per_token = worker.estimates.prefill_per_token_s.value
    assert per_token is not None, "no session was opened, and the stream's first token priced nothing"
    assert worker.estimates.switch_cost_s(100) >= 100 * per_token


def test_a_cloud_only_stream_asks_for_its_tokens_before_the_drafter_is_set_up(server, target, monkeypatch):
    """Regression: the default edge set its drafter up (a llama.cpp context, about 15 ms) between opening
    a cloud-only stream and reading it, and the Decode request leaves only when the stream is first
    read: every generation's first token waited for it (experiments/never_slower.yaml: 7 ms median,
    17 ms mean more time to first token than --cloud-only, a tenth of a 10-token generation)."""
    config = EdgeConfig.of(cloud=server.address, max_new_tokens=12, max_draft=4)  # a new worker warms up cloud-only
    with VerifierClient(server.address, timeout_s=config.link.timeout_s) as client:
        run = EdgeWorker(target, client, config).stream(PROMPT)
        committed, built_after = [], []
        build = Generation._build_drafter

        def recording(self):
            built_after.append(len(committed))
            return build(self)

        monkeypatch.setattr(Generation, "_build_drafter", recording)
        for event in run:
            if event.kind is EventKind.COMMIT:
                committed.extend(event.tokens)
    assert run.token_ids == greedy_reference(target, PROMPT, 12)
    assert built_after == [1], f"the drafter was set up after {built_after} tokens, not once after the first"
    assert run.stats.shadow_guesses > 0  # and it still guessed along


def test_shadow_guesses_never_hold_back_tokens_that_are_already_waiting(server, target, monkeypatch):
    """Regression: while decoding cloud-only the edge guessed along on every token it handled, even when
    the cloud's next tokens were already waiting; a drafter slower than the cloud (a torch drafter on
    the Ray pool) fell behind the stream and every guess delayed the user's tokens (stalls of 100-300 ms,
    the default edge at 0.85-0.90x the Decode RPC's speed). A guess longer than the wait for its token
    is made for one token in SHADOW_UNAFFORDABLE_EVERY only."""
    config = EdgeConfig.of(cloud=server.address, max_new_tokens=NEW, max_draft=4)  # a new worker warms up cloud-only
    propose = ModelDrafter.propose

    def slow(*args, **kwargs):  # a guess far slower than the tiny cloud's token
        time.sleep(0.03)
        return propose(*args, **kwargs)

    monkeypatch.setattr(ModelDrafter, "propose", slow)
    with VerifierClient(server.address, timeout_s=config.link.timeout_s) as client:
        gen = EdgeWorker(target, client, config).generate(PROMPT)
    assert gen.token_ids == greedy_reference(target, PROMPT, NEW)
    assert gen.stats.rounds == 0 and gen.stats.cloud_only_tokens == NEW
    # Before, warming up alone guessed 16 tokens (29 in all here).
    assert 0 < gen.stats.shadow_guesses <= 1 + NEW // generation.SHADOW_UNAFFORDABLE_EVERY, gen.stats.shadow_guesses


def test_a_cloud_only_stream_guesses_no_more_of_a_window_than_the_controller_allows(server, target, monkeypatch):
    """Regression: a window shadowed only to recheck α guessed every token of it (about 30 per
    generation in never_slower, 2026-11-27e); the controller now says how many guesses a window gets,
    and the stream stops guessing once they are made."""
    allowed = 3
    monkeypatch.setattr(Controller, "shadow_guesses", lambda self, can_shadow, window: min(window, allowed) * can_shadow)
    config = EdgeConfig.of(cloud=server.address, max_new_tokens=NEW, max_draft=4, probe_tokens=8)
    with VerifierClient(server.address, timeout_s=config.link.timeout_s) as client:
        worker = EdgeWorker(target, client, config)
        monkeypatch.setattr(Controller, "hybrid_looks_better", lambda self, *args: False)  # stay cloud-only
        gen = worker.generate(PROMPT)
    assert gen.token_ids == greedy_reference(target, PROMPT, NEW)
    assert gen.stats.rounds == 0 and gen.stats.cloud_only_tokens == NEW
    windows = 1 + -(-(NEW - WARMUP_CLOUD_TOKENS) // 8)  # the warm-up's, then one per 8 tokens
    assert 0 < gen.stats.shadow_guesses <= allowed * windows, (gen.stats.shadow_guesses, windows)


def test_shadow_guesses_time_the_drafter_only_on_one_token_steps(server, target, monkeypatch):
    """Regression: t_d was also taken from guesses that first fed the drafter the prompt or the tokens
    it had not guessed; one prompt's feed made the next tokens' guesses look unaffordable, and each
    guess after a gap then fed several tokens, so t_d stayed high (the demo reported drafting at 2.28
    cloud tokens' time). Only a guess right after a guess of the previous token times the drafter."""
    config = EdgeConfig.of(cloud=server.address, max_new_tokens=NEW, max_draft=4)  # a new worker warms up cloud-only
    guessed_at: list[int] = []
    propose = ModelDrafter.propose

    def recording(self, context, *args, **kwargs):
        guessed_at.append(len(context))
        return propose(self, context, *args, **kwargs)

    monkeypatch.setattr(ModelDrafter, "propose", recording)
    with VerifierClient(server.address, timeout_s=config.link.timeout_s) as client:
        worker = EdgeWorker(target, client, config)
        timed = []
        add = worker.estimates.draft_s.add
        monkeypatch.setattr(worker.estimates.draft_s, "add", lambda s: (timed.append(guessed_at[-1]), add(s)))
        gen = worker.generate(PROMPT)
    assert gen.stats.rounds == 0 and gen.stats.shadow_guesses == len(guessed_at) > 1
    assert guessed_at[0] not in timed  # the first guess fed the drafter the prompt
    assert timed and all(at - 1 in guessed_at for at in timed), (guessed_at, timed)


def test_a_cloud_only_stream_hands_over_to_hybrid_when_hybrid_looks_better(server, target, monkeypatch):
    """Regression: the cloud-only phase's hand-over to hybrid read a setting the controller's resolved
    `Policy` no longer carried once the config was split into sections (AttributeError, seen only where
    the tiny models made hybrid look faster by chance). Forced here: hybrid always looks better."""
    from hybridspec.edge.controller import Controller

    monkeypatch.setattr(Controller, "hybrid_looks_better", lambda self, *args: True)
    config = EdgeConfig.of(cloud=server.address, max_new_tokens=NEW, max_draft=4)  # a new worker warms up cloud-only
    with VerifierClient(server.address, timeout_s=config.link.timeout_s) as client:
        gen = EdgeWorker(target, client, config).generate(PROMPT)
    assert gen.token_ids == greedy_reference(target, PROMPT, NEW)
    # It left the first stream for hybrid: rounds, or a second stream where the hybrid phase found
    # (on this machine's timing) that cloud-only is faster after all.
    assert gen.stats.cloud_only_tokens > 0 and (gen.stats.rounds > 0 or gen.stats.cloud_streams >= 2)
