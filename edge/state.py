"""One generation's tokens, like a serving engine's sequence: what is committed (and where each token
came from), the unverified tail drafted while the cloud was away, the round counter and whether an
end-of-sequence token was reached. Only the operations here change it.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from .proposal import Proposal

if TYPE_CHECKING:
    from ..common.maths.sparse import SparseDist
    from .stops import TextTracker


class Origin(str, Enum):
    """Where a generated token came from."""

    ACCEPTED = "accepted"  # drafted on the edge and accepted by the verifier
    CORRECTED = "corrected"  # the verifier's correction after a rejected draft token
    BONUS = "bonus"  # the verifier's extra token after a fully accepted block
    CLOUD = "cloud"  # decoded by the cloud alone (cloud-only mode)
    UNVERIFIED = "unverified"  # drafted while the cloud was unreachable and never verified


class EventKind(str, Enum):
    """What an Event reports."""

    COMMIT = "commit"  # `tokens` are final
    DRAFT = "draft"  # a block is being verified; `provisional` shows it
    UNVERIFIED = "unverified"  # offline: `tokens` were drafted alone; `provisional` holds all such tokens
    ROLLBACK = "rollback"  # unverified `tokens` were rejected and are withdrawn
    NOTICE = "notice"  # a change of mode, in `message`


@dataclass(frozen=True)
class Event:
    """One step of a generation, for streaming to a user."""

    kind: EventKind
    tokens: tuple[int, ...] = ()
    origins: tuple[Origin, ...] = ()
    provisional: tuple[int, ...] = ()  # tokens shown but not final after this event (drafts, unverified)
    message: str = ""
    text: str = ""  # COMMIT: text that became final (joined, they give the generated text)


def verdict_origins(num_accepted: int, bonus: bool) -> list[Origin]:
    """Origins of what a round commits: the accepted drafts, then the verifier's own token (a bonus
    when nothing more was drafted after them, else a correction)."""
    return [Origin.ACCEPTED] * num_accepted + [Origin.BONUS if bonus else Origin.CORRECTED]


class GenerationState:
    """Committed tokens never change; the unverified tail is either verified or rolled back."""

    def __init__(self, prompt: list[int], max_new_tokens: int, stop_ids: frozenset[int],
                 text: TextTracker | None = None) -> None:
        """text: turns committed tokens into final text and ends the generation at a stop string."""
        self.prompt = list(prompt)
        self.text = text
        self.max_new_tokens = max_new_tokens
        self.stop_ids = stop_ids
        self.committed = list(prompt)
        self.origins: list[Origin] = []
        self.unverified: list[int] = []
        self.unverified_q: list[SparseDist | None] = []  # the q each unverified token was sampled from
        self.round = 0  # the next verify round of this generation
        self.eos = False

    @property
    def generated(self) -> int:
        """Committed tokens after the prompt."""
        return len(self.committed) - len(self.prompt)

    @property
    def room(self) -> int:
        """Tokens the budget still allows, counting the unverified tail as spent."""
        return self.max_new_tokens - self.generated - len(self.unverified)

    @property
    def done(self) -> bool:
        """An end-of-sequence token or a stop string was committed, or the budget is spent."""
        return self.eos or self.generated >= self.max_new_tokens or (self.text is not None and self.text.stopped)

    def commit(self, tokens: list[int], origins: list[Origin]) -> Event:
        """Append final tokens, stopping after an end-of-sequence token or a stop string."""
        for i, token in enumerate(tokens):
            if token in self.stop_ids:
                tokens, origins = tokens[: i + 1], origins[: i + 1]
                self.eos = True
                break
        text = ""
        if self.text is not None:
            keep, text = self.text.add(list(tokens))
            tokens, origins = tokens[:keep], origins[:keep]
        self.committed += tokens
        self.origins += origins
        if self.done:
            self.unverified, self.unverified_q = [], []
        return Event(EventKind.COMMIT, tuple(tokens), tuple(origins), tuple(self.unverified), text=text)

    def commit_verdict(self, proposal: Proposal, nodes: list[int], token: int) -> Event:
        """Commit the nodes a verify round kept of `proposal` (its accepted root path), then the
        verifier's token; next round."""
        self.round += 1
        return self.commit([*(proposal.ids[n] for n in nodes), token],
                           verdict_origins(len(nodes), proposal.is_leaf(nodes)))

    def add_unverified(self, proposal: Proposal) -> Event:
        """Keep tokens drafted while the cloud is away, with the q each was sampled from."""
        self.unverified += proposal.ids
        self.unverified_q += proposal.dists or [None] * len(proposal.ids)
        return Event(EventKind.UNVERIFIED, tuple(proposal.ids), (Origin.UNVERIFIED,) * len(proposal.ids),
                     tuple(self.unverified))

    def unverified_block(self, cap: int, with_q: bool) -> Proposal:
        """The next block of the unverified tail to verify (room left for the verifier's token)."""
        n = min(cap, self.max_new_tokens - self.generated - 1, len(self.unverified))
        return Proposal(self.unverified[:n], self.unverified_q[:n] if with_q else None, False)

    def reconcile(self, block: Proposal, num_accepted: int, token: int) -> list[Event]:
        """Apply a verdict on a block of the unverified tail: keep the accepted prefix and the
        verifier's token; the tail after the block survives only if the token confirms its first."""
        del self.unverified[:len(block.ids)], self.unverified_q[:len(block.ids)]
        keep_rest = num_accepted == len(block.ids) and self.unverified and self.unverified[0] == token
        if keep_rest:
            del self.unverified[0], self.unverified_q[0]
        rejected = list(block.ids[num_accepted:]) + ([] if keep_rest else self.unverified)
        if not keep_rest:
            self.unverified, self.unverified_q = [], []
        events = [Event(EventKind.ROLLBACK, tuple(rejected), provisional=tuple(self.unverified))] if rejected else []
        return events + [self.commit_verdict(block, list(range(num_accepted)), token)]

    def result(self) -> tuple[list[int], list[Origin]]:
        """Generated tokens (committed, then any unverified tail) and their origins."""
        tokens = self.committed[len(self.prompt):] + self.unverified
        return tokens, self.origins + [Origin.UNVERIFIED] * len(self.unverified)
