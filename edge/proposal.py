"""What every drafter hands the loop: a `Proposal` (a block and the q each token was sampled from),
the `Drafter` interface, and the `DraftSettings` every drafter is built with. Free of torch, so the loop around drafting imports nothing heavy."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ..common.config import Choice
from ..common.protocol.wire import DraftBlock, SamplingParams

if TYPE_CHECKING:
    from ..common.maths.sparse import SparseDist



class DrafterKind(Choice):
    """What drafts."""

    MODEL = "model"  # the drafter checkpoint, whatever it is (an LM or an eagle head)
    NGRAM = "ngram"  # prompt lookup: no model
Interrupt = Callable[[], bool]


@dataclass(frozen=True)
class DraftSettings:
    """Everything fixed for one generation's drafting."""

    sampling: SamplingParams
    vocab_size: int  # the target's; drafter logits are cut or padded to it so ids always agree
    stop_ids: frozenset[int]  # a block ends after one of these
    fallback_threshold: float = 0.6  # BiLD α_FB: a block ends at the first token drafted with max q below it
    # When the fallback ends a block, keep the token that triggered it (as Hugging Face assisted
    # generation does: the verifier scores it at almost no cost) or drop it (as BiLD does).
    keep_low_confidence: bool = True
    wire_top_k: int = 64  # q is truncated to this many tokens before sampling and sending; 0 = full
    seed: int = 0  # seeds the drafter's sampling
    ngram_max: int = 3  # prompt lookup: longest suffix looked up
    # Tokens of the prompt at the head of every context (penalties count only what follows as
    # generated); 0 = all of the first context drafted after is prompt, as SessionSpec.prompt_len 0 is.
    prompt_len: int = 0
    # Draw each token by Gumbel-max with the noise of its position (mode coupled: docs/design.md §2.2)
    # instead of from a generator.
    coupled: bool = False


@dataclass(frozen=True)
class Proposal:
    """A draft block."""

    ids: list[int]
    dists: list[SparseDist] | None  # the q each token was sampled from; None at temperature 0
    fell_back: bool  # the block ended because the drafter's confidence dropped below α_FB
    drafted_ahead: bool = False  # drafted during the previous round's wait (pipelining)

    def block(self, session_id: str, round_index: int, committed_len: int, with_probs: bool) -> DraftBlock:
        """This proposal as a verify request; with_probs: send q (the modes that read it)."""
        dists = self.dists if with_probs else None
        return DraftBlock(session_id=session_id, round=round_index, committed_len=committed_len,
                          draft_ids=tuple(self.ids),
                          support_ids=tuple(tuple(d.ids.tolist()) for d in dists or ()),
                          probs=tuple(tuple(d.probs.tolist()) for d in dists or ()))

    def head(self, n: int) -> Proposal:
        """The first `n` tokens (the fallback flag holds only if the cut keeps the block's end)."""
        return Proposal(self.ids[:n], None if self.dists is None else self.dists[:n],
                        self.fell_back and len(self.ids) <= n, self.drafted_ahead)

    def tail(self, start: int) -> Proposal:
        """The proposal without its first `start` tokens."""
        return Proposal(self.ids[start:], None if self.dists is None else self.dists[start:], self.fell_back,
                        self.drafted_ahead)



class Drafter(Protocol):
    """Anything that can propose the next tokens after a committed context and learn the verdict."""

    def propose(self, context: list[int], max_tokens: int, *, interrupt: Interrupt | None = None,
                fallback: bool = True) -> Proposal:
        """Draft up to `max_tokens` tokens after `context`; stop early when `interrupt()` turns true.
        fallback=False drafts without the BiLD confidence test (drafting alone, shadow guesses)."""
        ...

    def observe(self, num_accepted: int, token: int) -> None:
        """The verifier kept `num_accepted` tokens of the last proposal and added `token`."""
        ...
