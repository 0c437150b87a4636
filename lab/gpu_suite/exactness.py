"""Part (c): does speculative decoding emit exactly the tokens cloud-only decoding does, on the same
engine? Greedy, on random weights (any weights would do: the question is arithmetic).

Cloud-only decoding is the verifier's own decode step (a round with no draft). Hybrid rounds draft
from that reference with a set agreement, as chains of a varying length or as trees with a decoy
sibling at every level, so every pass mixes block sizes, tree shapes and batch sizes (sessions
finish at different rounds). Every token the hybrid run commits is compared with the reference.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from ...cloud.core.verifier import Verifier
from ...common.protocol.errors import HybridSpecError
from ...common.protocol.wire import DraftBlock, SessionSpec


@dataclass
class _Run:
    sid: str
    prompt: list[int]
    committed: list[int]
    round: int = 0


def prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]


def _open(verifier: Verifier, tag: str, prompt_ids: list[list[int]]) -> list[_Run]:
    runs = []
    for i, prompt in enumerate(prompt_ids):
        sid = f"{tag}-{i}"
        verifier.open_session(SessionSpec(sid, tuple(prompt)))
        runs.append(_Run(sid, prompt, list(prompt)))
    return runs


def _drive(verifier: Verifier, runs: list[_Run], new_tokens: int, draft) -> list[list[int]]:
    """Rounds for every unfinished session in one batch per step until each has `new_tokens`."""
    while True:
        live = [run for run in runs if len(run.committed) - len(run.prompt) < new_tokens]
        if not live:
            break
        blocks = [draft(run) for run in live]
        for run, block, result in zip(live, blocks, verifier.verify_batch(blocks)):
            if isinstance(result, HybridSpecError):
                raise result
            nodes = result.accepted_path if block.is_tree else range(result.num_accepted)
            run.committed += [block.draft_ids[n] for n in nodes] + [result.next_token]
            run.round += 1
    for run in runs:
        verifier.close_session(run.sid)
    return [run.committed[len(run.prompt):len(run.prompt) + new_tokens] for run in runs]


def reference(verifier: Verifier, prompt_ids: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Cloud-only greedy decoding: one token per session per step."""
    return _drive(verifier, _open(verifier, "ref", prompt_ids), new_tokens,
                  lambda run: DraftBlock(run.sid, run.round, len(run.committed), ()))


def hybrid(verifier: Verifier, prompt_ids: list[list[int]], refs: list[list[int]], trees: bool, agree: float,
           max_draft: int, seed: int) -> list[list[int]]:
    """Speculative rounds whose drafts follow the reference with probability `agree` per token."""
    rng = random.Random(seed)
    vocab = verifier.info.vocab_size
    by_sid = {}

    def guess(run: _Run, at: int) -> int:
        ref = by_sid[run.sid]
        right = ref[at] if at < len(ref) else rng.randrange(vocab)
        return right if rng.random() < agree else (right + 1 + rng.randrange(vocab - 1)) % vocab

    def draft(run: _Run) -> DraftBlock:
        at = len(run.committed) - len(run.prompt)
        depth = rng.randint(1, max_draft)
        if not trees:
            return DraftBlock(run.sid, run.round, len(run.committed), tuple(guess(run, at + d) for d in range(depth)))
        ids, parents, parent = [], [], -1
        for d in range(depth):  # a main path plus a decoy sibling at every level
            main = guess(run, at + d)
            decoy = (main + 1 + rng.randrange(vocab - 1)) % vocab
            ids += [main, decoy]
            parents += [parent, parent]
            parent = len(ids) - 2
        return DraftBlock(run.sid, run.round, len(run.committed), tuple(ids), parents=tuple(parents))

    runs = _open(verifier, "tree" if trees else "chain", prompt_ids)
    for run, ref in zip(runs, refs):
        by_sid[run.sid] = ref
    return _drive(verifier, runs, len(refs[0]), draft)


def differences(refs: list[list[int]], outs: list[list[int]]) -> dict:
    """Tokens that differ from the reference, and the sessions where any does."""
    differing = sum(a != b for ref, out in zip(refs, outs) for a, b in zip(ref, out))
    return {"tokens": sum(len(r) for r in refs), "differing_tokens": differing,
            "sessions_differing": sum(ref != out for ref, out in zip(refs, outs))}


def exactness(verifier: Verifier, sessions: int, new_tokens: int, prompt_len: int, agree: float,
              max_draft: int, seed: int = 0) -> dict:
    """Hybrid chains and trees against cloud-only, `sessions` at once."""
    ids = prompts(sessions, prompt_len, verifier.info.vocab_size, seed)
    refs = reference(verifier, ids, new_tokens)
    return {"sessions": sessions, "tokens_per_session": new_tokens,
            "chains": differences(refs, hybrid(verifier, ids, refs, False, agree, max_draft, seed + 1)),
            "trees": differences(refs, hybrid(verifier, ids, refs, True, agree, max_draft, seed + 2))}
