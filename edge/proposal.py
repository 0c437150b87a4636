"""What every drafter hands the loop: a `Proposal` (a block and the q each token was sampled from),
the `Drafter` interface, and the `DraftSettings` every drafter is built with. Free of torch, so the loop around drafting imports nothing heavy."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ..common.config import Choice, check_fields, setting
from ..common.protocol.errors import Internal
from ..common.protocol.tree import ROOT, children, is_chain, path_to
from ..common.protocol.wire import DraftBlock, Mode, SamplingParams, VerifyResult

if TYPE_CHECKING:
    from ..common.maths.sparse import SparseDist


class DrafterKind(Choice):
    """What drafts."""

    MODEL = "model"  # the drafter checkpoint, whatever it is (an LM or an eagle head)
    NGRAM = "ngram"  # prompt lookup: no model


Interrupt = Callable[[], bool]

# When sampling, the cloud's stream draws each token by the coupled rule (seed, position), and a
# shadow guess is the drafter's coupled draw from its q. Their agreement is exactly a first draft's
# acceptance in coupled mode, and, by the coupling inequality (no coupling of p and q agrees more
# often than 1 - TV(p, q), the speculative rule's acceptance), a lower bound on it under the
# speculative and lenient rules. BiLD's threshold rule is neither, so it is not measured this way.
SHADOW_SAMPLED_MODES = frozenset({Mode.COUPLED, Mode.SPECULATIVE, Mode.LENIENT})


@dataclass(frozen=True)
class Drafting:
    """How every drafter drafts: EdgeConfig's `drafting` section, and the one place these settings'
    defaults, help and bounds live."""

    fallback_threshold: float = setting(0.6, "BiLD alpha_FB: end a block when the drafter's top probability "
                                             "falls below this", ge=0, le=1)
    # When the fallback ends a block, keep the token that triggered it (as Hugging Face assisted
    # generation does: the verifier scores it at almost no cost) or drop it (as BiLD does).
    keep_low_confidence: bool = setting(True, "send the token that triggered alpha_FB, or drop it (BiLD)")
    wire_top_k: int = setting(64, "q is truncated to this many tokens before sampling and sending; 0 = full",
                              ge=0)
    ngram_max: int = setting(3, "ngram: the longest suffix looked up in the context", ge=1)

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class DraftSettings:
    """Everything fixed for one generation's drafting: the `drafting` section and what this generation
    and its target add."""

    sampling: SamplingParams
    vocab_size: int  # the target's; drafter logits are cut or padded to it so ids always agree
    stop_ids: frozenset[int]  # a block ends after one of these
    drafting: Drafting = Drafting()
    seed: int = 0  # seeds the drafter's sampling
    # Tokens of the prompt at the head of every context (penalties count only what follows as
    # generated); 0 = all of the first context drafted after is prompt, as SessionSpec.prompt_len 0 is.
    prompt_len: int = 0
    # Draw each token by Gumbel-max with the noise of its position (mode coupled: docs/design.md §2.2)
    # instead of from a generator.
    coupled: bool = False
    # The target's limit on a session's tokens (ModelInfo.max_context): a llama.cpp drafter's context
    # holds as many, whatever length the drafter was trained for; 0 = its trained length.
    max_context: int = 0


@dataclass(frozen=True)
class Proposal:
    """A draft block."""

    ids: list[int]
    dists: list[SparseDist] | None  # the q each token was sampled from; None at temperature 0
    fell_back: bool  # the block ended because the drafter's confidence dropped below α_FB
    drafted_ahead: bool = False  # drafted during the previous round's wait (pipelining)
    # A draft tree (common/protocol/tree.py): each node's parent, -1 for the root's children; None for
    # a chain. A tree's dists hold, per node, the q of its parent that it was drawn from.
    parents: tuple[int, ...] | None = None
    # Per node, the drafter's most likely tokens (best first) where the node was drawn: what the
    # target's token is ranked against (edge/tree_policy.py). None when the drafter does not say.
    ranked: list[tuple[int, ...]] | None = None

    def shadow_guess(self, seed: int, position: int) -> int | None:
        """The first token as the cloud's stream draws at `position` from this proposal's q: the
        drafted token itself at temperature 0 (and in coupled mode, which draws it so), else q's
        coupled draw with the stream's seed; None if nothing was drafted."""
        if not self.ids:
            return None
        return self.ids[0] if self.dists is None else self.dists[0].coupled(seed, position)

    def block(self, session_id: str, round_index: int, committed_len: int, with_probs: bool) -> DraftBlock:
        """This proposal as a verify request; with_probs: send q (the modes that read it)."""
        q = self.dists if with_probs and self.dists else ()
        return DraftBlock(session_id=session_id, round=round_index, committed_len=committed_len,
                          draft_ids=tuple(self.ids),
                          support_ids=tuple(tuple(d.ids.tolist()) for d in q) if q else (),
                          probs=tuple(tuple(d.probs.tolist()) for d in q) if q else (),
                          parents=self.parents or ())

    def accepted(self, result: VerifyResult) -> list[int]:
        """The node indices a verdict kept, checked against this proposal: a reply that names
        anything else comes from a broken or hostile verifier and commits nothing."""
        if self.parents is None or is_chain(self.parents):  # the verifier answers chain-shaped trees as chains
            if not 0 <= result.num_accepted <= len(self.ids) or result.accepted_path:
                raise Internal(f"the verifier accepted {result.num_accepted} of a {len(self.ids)}-token chain")
            return list(range(result.num_accepted))
        path = list(result.accepted_path)
        if len(path) != result.num_accepted or any(not 0 <= n < len(self.ids) for n in path) or (
                path and path_to(self.parents, path[-1]) != path):
            raise Internal("the verifier's accepted_nodes are not a root path of the draft tree")
        return path

    def is_leaf(self, nodes: list[int]) -> bool:
        """True when the accepted path ends where nothing more was drafted (the verifier's token is a bonus)."""
        kids = children(self.parents) if self.parents is not None else None
        if kids is None:
            return len(nodes) == len(self.ids)
        return not kids[(nodes[-1] if nodes else ROOT) + 1]

    def ranks_seen(self, nodes: list[int], token: int) -> list[int | None]:
        """Where the target's tokens stood among the drafter's choices along the accepted path and at
        the node where it stopped (1 = its first choice, None = outside its ranked choices); nothing
        where the drafter's choices are unknown (past a leaf, or a drafter that does not rank)."""
        if self.ranked is None:
            return []
        seen = [_rank(self.ranked[n], self.ids[n]) for n in nodes]
        if self.parents is None:
            after = len(nodes) if len(nodes) < len(self.ids) else None
        else:
            kids = children(self.parents)[(nodes[-1] if nodes else ROOT) + 1]
            after = kids[0] if kids else None
        if after is not None:
            seen.append(_rank(self.ranked[after], token))
        return seen

    def main_nodes(self) -> list[int]:
        """The drafter's most likely root path, every node's first child (a chain: all of it)."""
        if self.parents is None:
            return list(range(len(self.ids)))
        kids, nodes, node = children(self.parents), [], ROOT
        while kids[node + 1]:
            node = kids[node + 1][0]
            nodes.append(node)
        return nodes

    def main_path(self) -> Proposal:
        """The main path as a chain: what the pipelined drafter drafts ahead of."""
        if self.parents is None:
            return self
        return Proposal([self.ids[n] for n in self.main_nodes()], None, self.fell_back, self.drafted_ahead)

    def head(self, n: int) -> Proposal:
        """The first `n` tokens (the fallback flag holds only if the cut keeps the block's end)."""
        return Proposal(self.ids[:n], None if self.dists is None else self.dists[:n],
                        self.fell_back and len(self.ids) <= n, self.drafted_ahead,
                        ranked=None if self.ranked is None else self.ranked[:n])

    def tail(self, start: int) -> Proposal:
        """The proposal without its first `start` tokens."""
        return Proposal(self.ids[start:], None if self.dists is None else self.dists[start:], self.fell_back,
                        self.drafted_ahead, ranked=None if self.ranked is None else self.ranked[start:])


def _rank(ranked: tuple[int, ...], token: int) -> int | None:
    return ranked.index(token) + 1 if token in ranked else None


class Drafter(Protocol):
    """Anything that can propose the next tokens after a committed context and learn the verdict."""

    def propose(self, context: list[int], max_tokens: int, *, interrupt: Interrupt | None = None,
                fallback: bool = True) -> Proposal:
        """Draft up to `max_tokens` tokens after `context`; stop early when `interrupt()` turns true.
        fallback=False drafts without the BiLD confidence test (drafting alone, shadow guesses)."""
        ...

    def observe(self, accepted: list[int], token: int) -> None:
        """The verifier kept the tokens `accepted` of the last proposal (its accepted root path) and
        added `token`."""
        ...
