"""The edge worker's main loop: draft, verify remotely, commit, repeat."""
from __future__ import annotations

import time
import uuid
from dataclasses import asdict, dataclass, replace
from enum import Enum

from ..common.errors import FailedPrecondition, HybridSpecError
from ..common.models import LoadedModel, tokenizer_fingerprint
from ..common.sampling import round_generator
from ..common.wire import DraftBlock, SessionSpec
from .client import VerifierClient
from .config import EdgeConfig
from .drafter import Drafter, ModelDrafter


class Origin(str, Enum):
    """Where a committed token came from."""

    ACCEPTED = "accepted"  # drafted on the edge and accepted by the verifier
    CORRECTED = "corrected"  # the verifier's correction after a rejected draft token
    BONUS = "bonus"  # the verifier's extra token after a fully accepted block


@dataclass
class Stats:
    """Counters of one generation; the derived rates are filled in by `finish`."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    fallbacks: int = 0  # blocks ended early by the BiLD fallback test
    reopens: int = 0  # sessions re-opened after the verifier lost them
    new_tokens: int = 0
    uplink_bytes: int = 0
    downlink_bytes: int = 0
    draft_s: float = 0.0  # time spent drafting
    cloud_s: float = 0.0  # time waiting for verify replies (network + verification)
    wall_s: float = 0.0
    acceptance_rate: float = 0.0  # accepted / drafted
    mean_tokens_per_round: float = 0.0  # new tokens / rounds
    tokens_per_s: float = 0.0
    bytes_per_token: float = 0.0  # uplink + downlink per new token

    def finish(self, wall_s: float) -> None:
        """Fill in the derived rates."""
        self.wall_s = wall_s
        self.acceptance_rate = self.accepted / self.drafted if self.drafted else 0.0
        self.mean_tokens_per_round = self.new_tokens / self.rounds if self.rounds else 0.0
        self.tokens_per_s = self.new_tokens / wall_s if wall_s > 0 else 0.0
        total = self.uplink_bytes + self.downlink_bytes
        self.bytes_per_token = total / self.new_tokens if self.new_tokens else 0.0

    def to_dict(self) -> dict:
        """Plain dict for JSON output."""
        return asdict(self)


@dataclass
class Generation:
    """What `EdgeWorker.generate` returns."""

    token_ids: list[int]  # generated tokens only, EOS included when reached
    origins: list[Origin]  # one per token
    stats: Stats
    text: str = ""
    finished_by_eos: bool = False


class EdgeWorker:
    """Runs generations against one verifier with one drafter model."""

    def __init__(self, drafter_model: LoadedModel, client: VerifierClient, config: EdgeConfig) -> None:
        self.drafter_model = drafter_model
        self.client = client
        self.config = config
        self.info = client.model_info()
        fp = tokenizer_fingerprint(drafter_model.tokenizer)
        if fp != self.info.tokenizer_fingerprint:
            raise FailedPrecondition(
                f"the drafter's tokenizer ({fp}) differs from the verifier's ({self.info.tokenizer_fingerprint}); "
                "drafter and target must share one tokenizer")
        self.tokenizer_fp = fp

    def generate(self, prompt_ids: list[int], session_id: str | None = None) -> Generation:
        """Generate up to config.max_new_tokens tokens after `prompt_ids`.

        session_id: the verifier-side name of this generation; a fresh UUID when None.
        """
        cfg = self.config
        drafter: Drafter = ModelDrafter(
            self.drafter_model, cfg.sampling, self.info.vocab_size, cfg.wire_top_k,
            None if cfg.sampling.greedy else round_generator(cfg.seed, -1))
        stop_ids = frozenset(self.info.eos_token_ids)
        max_draft = min(cfg.max_draft, self.info.max_draft)
        committed = list(prompt_ids)
        generated: list[int] = []
        origins: list[Origin] = []
        stats = Stats()
        up0, down0 = self.client.uplink_bytes, self.client.downlink_bytes
        start = time.perf_counter()
        spec = SessionSpec(session_id=session_id if session_id is not None else uuid.uuid4().hex, committed_ids=tuple(committed), sampling=cfg.sampling,
                           mode=cfg.resolved_mode, seed=cfg.seed, rollback_threshold=cfg.rollback_threshold,
                           lenience=cfg.lenience, tokenizer_fingerprint=self.tokenizer_fp)
        self.client.open_session(spec)
        eos = False
        try:
            while len(generated) < cfg.max_new_tokens and not eos:
                # 1. Draft. The verifier always adds one token, so leave room for it.
                t0 = time.perf_counter()
                budget = min(max_draft, cfg.max_new_tokens - len(generated) - 1)
                proposal = drafter.propose(committed, budget, cfg.fallback_threshold, stop_ids)
                t1 = time.perf_counter()
                dists = proposal.dists if spec.mode.uses_draft_probs else None
                block = DraftBlock(
                    session_id=spec.session_id, round=stats.rounds, committed_len=len(committed),
                    draft_ids=tuple(proposal.ids),
                    support_ids=tuple(tuple(d.ids.tolist()) for d in dists or ()),
                    probs=tuple(tuple(d.probs.tolist()) for d in dists or ()))
                # 2. Verify; if the verifier lost the session, re-open it from what we hold.
                try:
                    result = self.client.verify(block)
                except FailedPrecondition:
                    stats.reopens += 1
                    self.client.open_session(replace(spec, committed_ids=tuple(committed), next_round=stats.rounds))
                    result = self.client.verify(block)
                t2 = time.perf_counter()
                # 3. Commit the accepted prefix and the verifier's token.
                k = result.num_accepted
                new = [*proposal.ids[:k], result.next_token]
                kinds = [Origin.ACCEPTED] * k + [Origin.BONUS if k == len(proposal.ids) else Origin.CORRECTED]
                for token, kind in zip(new, kinds):
                    committed.append(token)
                    generated.append(token)
                    origins.append(kind)
                    if token in stop_ids:
                        eos = True
                        break
                stats.rounds += 1
                stats.drafted += len(proposal.ids)
                stats.accepted += k
                stats.fallbacks += proposal.fell_back
                stats.draft_s += t1 - t0
                stats.cloud_s += t2 - t1
        finally:
            try:
                self.client.close_session(spec.session_id)
            except HybridSpecError:
                pass  # the session is a soft cache that the verifier expires on its own

        stats.new_tokens = len(generated)
        stats.uplink_bytes = self.client.uplink_bytes - up0
        stats.downlink_bytes = self.client.downlink_bytes - down0
        stats.finish(time.perf_counter() - start)
        text = self.drafter_model.tokenizer.decode(generated, skip_special_tokens=True)
        return Generation(token_ids=generated, origins=origins, stats=stats, text=text, finished_by_eos=eos)

