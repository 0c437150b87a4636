"""The edge's decisions for one generation, without any network: which phase, and how long a block.

Fed the worker's measured rates (edge/estimates.py) and the generation's progress, the controller
answers: start hybrid or cloud-only? γ for the next round, or hand decoding to the cloud? While
cloud-only: when to look again, whether shadow drafting is worth it, whether to go back to hybrid.
The maths is in edge/policy.py; this object adds what the loop needs around it: the warm-up of a
worker that has measured nothing yet, the optimism of the first hybrid rounds, and hysteresis.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

from ..common.config import Choice, check_fields, setting
from . import policy, tree_policy
from .estimates import Estimates
from .tree_policy import Shape

# Until these are measured, the policy assumes them (seconds); the first rounds measure them all.
DEFAULT_RATES = policy.Rates(alphas=[0.5], draft_s=0.005, rtt_s=0.02, verify_single_s=0.03, verify_block_s=0.03,
                             verify_per_draft_s=0.002, cloud_token_s=0.03)
# With the cloud-only switch on, a worker's first generation starts with tokens decoded by the cloud
# alone: their stream times T, the cloud's cost per token as the edge sees it, and the
# drafter's guesses against them ("shadow drafting") measure α before any block is risked.
WARMUP_CLOUD_TOKENS = 16  # with shadow drafting: long enough for its acceptance to mean something
WARMUP_CLOUD_TOKENS_UNSHADOWED = 4  # without (prompt lookup, eagle heads, BiLD when sampling): hybrid is tried optimistically
# For its first hybrid rounds (after any switch) the edge leaves hybrid decoding only if it would
# lose even with this good a drafter: acceptance needs a few rounds to be known.
MIN_HYBRID_ROUNDS = 4
OPTIMISTIC_ALPHA = 0.9
# Shadow drafting is not free where edge and cloud share a machine's memory (about 2 % of the cloud's
# speed while it runs on every token, docs/measurements.md), and it costs a real edge energy. Once
# enough guesses were checked, it runs only while hybrid could win with α_1 at most SHADOW_MARGIN
# above what they showed; otherwise one window in SHADOW_RECHECK still guesses, since texts change.
# Such a recheck guesses only its first SHADOW_RECHECK_GUESSES tokens: enough to see α move (a text
# that got easy then has every window shadowed again), a quarter of a window's share of the memory.
SHADOW_MIN_CHECKS = 16
SHADOW_MARGIN = 0.15
SHADOW_RECHECK = 4
SHADOW_RECHECK_GUESSES = 8
# A generation starts hybrid only when hybrid is predicted this much faster (a fraction) with the α
# measured so far, which earlier texts gave: acceptance belongs to the text. Below it, the generation
# starts cloud-only and its own shadow guesses decide after `probe_tokens`; that switch costs one
# session open, a short prefill where the replica's prefix cache holds the context.
START_MARGIN = 0.2
FIRST_GAMMA = 4  # the adaptive policy's first block, before the drafter's speed is known


class Phase(Enum):
    """What the generation is doing."""

    HYBRID = "hybrid"  # draft blocks on the edge, verify them in the cloud
    CLOUD_ONLY = "cloud-only"  # the cloud decodes alone (Generate)
    OFFLINE = "offline"  # the cloud is unreachable: draft alone, verify later


class GammaPolicy(Choice):
    """How long a block to draft."""

    ADAPTIVE = "adaptive"  # γ (or a tree's size) each round for the most tokens/s, from measured rates
    FIXED = "fixed"  # always a chain of max_draft
    TREE = "tree"  # always a tree of tree_nodes nodes, max_draft deep, tree_top_k children per node


@dataclass(frozen=True)
class PolicySettings:
    """The settings the controller follows: EdgeConfig's `policy` section, and the one place their
    defaults, help and bounds live."""

    max_draft: int = setting(8, "most tokens drafted per round (the server's limit caps it too)", ge=1)
    tree_nodes: int = setting(32, "most nodes of a draft tree per round; the policy sends a tree only when it "
                                  "predicts one faster than a chain (greedy, speculative and coupled modes, "
                                  "model drafters, servers that verify trees); 0 or 1 = chains only", ge=0)
    tree_top_k: int = setting(4, "most children per node of a draft tree", ge=1)
    gamma_policy: GammaPolicy = setting(GammaPolicy.ADAPTIVE, "adaptive: the block length (or tree size) per "
                                                              "round from measured acceptance, RTT and costs; "
                                                              "fixed: a chain of max_draft; tree: a tree of "
                                                              "tree_nodes (where trees are possible)")
    pipeline: bool = setting(True, "draft the next block while the current one is verified")
    cloud_only_switch: bool = setting(True, "let the cloud decode alone while that is predicted to be faster")
    cloud_only: bool = setting(False, "the baseline: the cloud decodes every token alone and the drafter never "
                                      "runs (same CLI path)")
    probe_tokens: int = setting(32, "while cloud-only: tokens per stream before measuring and deciding again; "
                                    "0 = never reconsider", ge=0)

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class Policy:
    """The policy settings as resolved for one generation against its server and drafter."""

    cap: int  # most tokens per block: min(the edge's and the server's max_draft)
    tree_nodes: int = 0  # most nodes of a draft tree, as resolved for this server and drafter; 0 = chains only
    settings: PolicySettings = PolicySettings()

    @property
    def adaptive(self) -> bool:
        """Choose γ (or a tree) per round; False: always `cap`."""
        return self.settings.gamma_policy is GammaPolicy.ADAPTIVE

    @property
    def fixed_tree(self) -> bool:
        """Not adaptive: always a tree of tree_nodes, `cap` deep (where trees are possible)."""
        return self.settings.gamma_policy is GammaPolicy.TREE


class Controller:
    """Decisions of one generation; `estimates` belong to the worker and carry over between them."""

    def __init__(self, policy_: Policy, estimates: Estimates) -> None:
        self.policy = policy_
        self.estimates = estimates
        s = policy_.settings
        self.warming_up = s.cloud_only_switch and not s.cloud_only and estimates.cloud_token_s.value is None
        self.hybrid_rounds = 0  # since the last switch to hybrid

    def rates(self) -> policy.Rates:
        """What the edge believes now, defaults where nothing was measured."""
        return self.estimates.rates(DEFAULT_RATES)

    def initial_phase(self) -> Phase:
        """Cloud-only while warming up or unless earlier measurements favour hybrid by START_MARGIN:
        starting either mode costs one prefill, but a hybrid start that turns out slower costs a
        second one to leave (a new stream of the whole context) after MIN_HYBRID_ROUNDS rounds, and
        the α behind the prediction was measured on other texts, so a close call starts cloud-only."""
        p = self.policy
        if p.settings.cloud_only or self.warming_up or (p.settings.cloud_only_switch and policy.prefer_cloud_only(
                self.rates(), p.cap, p.settings.pipeline, now_cloud_only=True, hysteresis=START_MARGIN,
                hybrid=self._best_hybrid(self.rates()))):
            return Phase.CLOUD_ONLY
        return Phase.HYBRID

    def next_gamma(self, remaining_tokens: int, context_tokens: int, rates: policy.Rates | None = None) -> int | None:
        """γ for the next round, or None to hand decoding to the cloud. rates: the caller's snapshot of
        `rates()`; without one they are read here, and only where a decision reads them."""
        p = self.policy
        if p.settings.cloud_only_switch:
            rates = rates or self.rates()
            judged = rates if self.hybrid_rounds >= MIN_HYBRID_ROUNDS else rates.optimistic(OPTIMISTIC_ALPHA)
            if self._prefer_cloud(judged, False, remaining_tokens, context_tokens):
                return None
        if not p.adaptive:
            return p.cap
        if self.estimates.draft_s.value is None:
            return min(FIRST_GAMMA, p.cap)
        return policy.choose_gamma(rates or self.rates(), p.cap, p.settings.pipeline)

    def next_shape(self, remaining_tokens: int, context_tokens: int) -> Shape | None:
        """The next round's draft: a chain of γ or a tree (whichever is predicted faster), or None to
        hand decoding to the cloud."""
        p = self.policy
        # One snapshot of the rates for every decision of the round; a fixed γ without the cloud-only
        # switch decides nothing and reads none.
        rates = self.rates() if p.settings.cloud_only_switch or p.adaptive else None
        gamma = self.next_gamma(remaining_tokens, context_tokens, rates)
        if gamma is None:
            return None
        chain = Shape(gamma, gamma, 1)
        if p.tree_nodes < 2:
            return chain
        if not p.adaptive:
            return Shape(p.tree_nodes, p.cap, p.settings.tree_top_k) if p.fixed_tree else chain
        if self.estimates.draft_s.value is None:
            return chain
        tree_rate, tree = self._tree(rates)
        better = tree_rate > policy.hybrid_rate(rates, gamma, p.settings.pipeline)
        return tree if not tree.is_chain and better else chain

    def _tree(self, rates: policy.Rates) -> tuple[float, Shape]:
        p = self.policy
        return tree_policy.choose_tree(rates, self.estimates.ranks, p.tree_nodes, p.cap, p.settings.tree_top_k)

    def _best_hybrid(self, rates: policy.Rates) -> float | None:
        """Hybrid's predicted rate with trees if they are on (None: the chain policy's own)."""
        if self.policy.tree_nodes < 2:
            return None
        p = self.policy
        pipeline = p.settings.pipeline
        chain = policy.hybrid_rate(rates, policy.choose_gamma(rates, p.cap, pipeline), pipeline)
        return max(chain, self._tree(rates)[0])

    def chains_only(self) -> None:
        """The drafter turned out to draft chains only (an eagle head, prompt lookup): no trees."""
        self.policy = replace(self.policy, tree_nodes=0)

    def observed_hybrid_round(self) -> None:
        """One more hybrid round measured since the last switch."""
        self.hybrid_rounds += 1

    def entered_hybrid(self) -> None:
        """Decoding went (back) to hybrid: the first rounds are judged optimistically again."""
        self.warming_up = False
        self.hybrid_rounds = 0

    # ---- while cloud-only ---------------------------------------------------------------------

    def end_warmup(self) -> bool:
        """The warm-up decided to stay cloud-only; True if it was still warming up."""
        was, self.warming_up = self.warming_up, False
        return was

    @property
    def reconsiders(self) -> bool:
        """Whether a cloud-only stream is ever reconsidered."""
        return not self.policy.settings.cloud_only and self.policy.settings.probe_tokens > 0

    def first_check_after(self, can_shadow: bool) -> int:
        """Cloud tokens before the first decision of a cloud-only stream."""
        if not self.warming_up:
            return self.policy.settings.probe_tokens
        return WARMUP_CLOUD_TOKENS if can_shadow else WARMUP_CLOUD_TOKENS_UNSHADOWED

    def shadow_guesses(self, can_shadow: bool, window: int) -> int:
        """How many of the next `window` cloud tokens to shadow-draft: all of them if the guesses can be
        checked and hybrid could win (while warming up T is not known yet, so always); else none, but
        every SHADOW_RECHECK-th window still guesses its first SHADOW_RECHECK_GUESSES so that α follows
        a changing text."""
        if not (can_shadow and self.reconsiders):
            return 0
        if self.warming_up or self.hybrid_could_win():
            self.estimates.unshadowed_windows = 0
            return window
        if self.estimates.unshadowed_windows + 1 >= SHADOW_RECHECK:
            self.estimates.unshadowed_windows = 0
            return min(window, SHADOW_RECHECK_GUESSES)
        self.estimates.unshadowed_windows += 1
        return 0

    def hybrid_looks_better(self, can_shadow: bool, remaining_tokens: int, context_tokens: int) -> bool:
        """Leave cloud-only decoding? While warming up without shadow acceptance (sampling), judged
        with a good drafter's α."""
        rates = self.rates()
        judged = rates.optimistic(OPTIMISTIC_ALPHA) if self.warming_up and not can_shadow else rates
        return not self._prefer_cloud(judged, True, remaining_tokens, context_tokens)

    def hybrid_could_win(self) -> bool:
        """Could hybrid beat cloud-only here with a drafter accepted OPTIMISTIC_ALPHA of the time, or,
        once SHADOW_MIN_CHECKS guesses were checked, SHADOW_MARGIN more often than they showed?"""
        rates = self.rates()
        alpha = OPTIMISTIC_ALPHA
        if self.estimates.checked[0] >= SHADOW_MIN_CHECKS:
            alpha = min(alpha, rates.alphas[0] + SHADOW_MARGIN)
        rates = rates.optimistic(alpha)
        p = self.policy
        return not policy.prefer_cloud_only(rates, p.cap, p.settings.pipeline, now_cloud_only=True,
                                            hysteresis=0.0, hybrid=self._best_hybrid(rates))

    def _prefer_cloud(self, rates: policy.Rates, now_cloud_only: bool, remaining_tokens: int,
                      context_tokens: int) -> bool:
        """The policy's verdict, with what a switch would cost here and what is left to gain."""
        return policy.prefer_cloud_only(rates, self.policy.cap, self.policy.settings.pipeline, now_cloud_only,
                                        hybrid=self._best_hybrid(rates), remaining_tokens=remaining_tokens,
                                        switch_cost_s=self.estimates.switch_cost_s(context_tokens))
