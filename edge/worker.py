"""The edge worker: what its generations share — the drafter (loading in the background, possibly), the
measured rates, the verifier's identity and the pair check, a pool of connections — and starting one.

Each generation (edge/generation.py `Generation`) owns its own state and runs its own loop; the worker
leases it a connection, checks its prompt against the verifier before any work, and keeps what it
measured for the next one.
"""
from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from ..common.protocol.errors import FailedPrecondition, HybridSpecError, Unavailable
from ..common.protocol.wire import ModelInfo, check_context
from .client import VerifierClient
from .config import EdgeConfig
from .estimates import Estimates
from .generation import Generation
from .startup import DrafterLoad
from .textcodec import HFCodec, TextCodec

if TYPE_CHECKING:
    from ..common.models.loading import LoadedModel

# A cloud serves before its pass-cost curve is measured (cloud/core/costs.py) and reports it once it
# is: while the edge has none, a generation's start asks for it again, at most this often.
CURVE_ASK_S = 5.0


class EdgeWorker:
    """Runs generations against one verifier pool with one drafter; keeps its measurements across them.

    Generations may run concurrently from several threads: each leases a connection of its own (a
    session's rounds share one gRPC stream) and builds its own drafter state; the drafter's weights
    and the measured rates are shared.
    """

    def __init__(self, drafter: LoadedModel | DrafterLoad, client: VerifierClient, config: EdgeConfig,
                 fallback_model: LoadedModel | None = None, codec: TextCodec | HFCodec | None = None,
                 require_cloud: bool = True) -> None:
        """drafter: a loaded model, or one still loading (generations start cloud-only meanwhile);
        fallback_model: for an eagle head, the plain drafter used while it has no features (else n-gram);
        codec: the tokenizer without torch (default: the drafter's own, once loaded);
        require_cloud: fail now if the cloud is unreachable, unless `config.link.allow_unverified`."""
        self.load = drafter if isinstance(drafter, DrafterLoad) else DrafterLoad.loaded(drafter, fallback_model)
        self.codec = codec or HFCodec(self.load.get()[0].tokenizer)
        self.tokenizer_fp = self.codec.fingerprint()
        self.client = client
        self.config = config
        self._lock = threading.Lock()
        self._clients = [client]  # every connection opened, closed by close()
        self._idle = [client]  # connections no generation holds right now
        self.info: ModelInfo | None = None  # the verifier's, once it answered
        self.cap = config.policy.max_draft
        self._curve_asked = float("-inf")  # when the cloud was last asked for a curve it had not yet
        # Rates carry over between generations: the link, the drafter and the cloud stay the same.
        self.estimates = Estimates(self.cap + 1)
        try:
            self.connect()
        except Unavailable:
            if require_cloud and not config.link.allow_unverified:
                raise

    @property
    def drafter_model(self) -> LoadedModel:
        """The drafter (waits for it while it loads)."""
        return self.load.get()[0]

    @property
    def fallback_model(self) -> LoadedModel | None:
        """An eagle head's plain fallback drafter, if one was loaded."""
        return self.load.get()[1]

    @property
    def connected(self) -> bool:
        """The verifier answered at least once."""
        return self.info is not None

    def connect(self, client: VerifierClient | None = None) -> ModelInfo:
        """Ask the verifier what it serves and check the drafter matches it; Unavailable if it does not answer."""
        client = client or self.client
        info = client.model_info()
        if self.tokenizer_fp != info.tokenizer_fingerprint:
            raise FailedPrecondition(
                f"the drafter's tokenizer ({self.tokenizer_fp}) differs from the verifier's "
                f"({info.tokenizer_fingerprint}); drafter and target must share one tokenizer")
        if self.load.ready():
            model = self.drafter_model
            if model.is_eagle and info.feature_dim not in (0, model.model.hidden_size):
                raise FailedPrecondition(
                    f"the eagle head reads features of size {model.model.hidden_size}; the verifier's target "
                    f"has {info.feature_dim}: the head was trained for another target")
        self.estimates.rtt_s.add(client.ping())  # the first call above also set the connection up
        self.estimates.use_pass_costs(info.pass_costs, info.batch_pass_costs)
        self.info, self.cap = info, min(self.config.policy.max_draft, info.max_draft)
        self._curve_asked = time.monotonic()
        return info

    def _ask_for_curve(self) -> None:
        """While the cloud has reported no pass-cost curve (it is still measuring it), ask again on a
        thread of its own, at most every CURVE_ASK_S: the generation starting meanwhile sizes its
        blocks from its own rounds (edge/estimates.py), and the next ones use the curve."""
        now = time.monotonic()
        with self._lock:
            if self.info is None or self.info.pass_costs or now - self._curve_asked < CURVE_ASK_S:
                return
            self._curve_asked = now

        def ask() -> None:
            client = self.lease()
            try:
                info = client.model_info()
            except HybridSpecError:
                return  # the generation meets an unreachable cloud itself
            finally:
                self.release(client)
            current = self.info
            if info.pass_costs and current is not None and info.model_fingerprint == current.model_fingerprint:
                self.estimates.use_pass_costs(info.pass_costs, info.batch_pass_costs)
                self.info = info

        threading.Thread(target=ask, daemon=True, name="curve-ask").start()

    def local_info(self) -> ModelInfo:
        """What the edge assumes about the target while the cloud has never answered: the drafter's
        vocabulary and end-of-sequence tokens (they share the tokenizer); with no drafter at all
        (--cloud-only), the tokenizer's."""
        if self.load.ready() or self.load.pending():
            model = self.drafter_model
            vocab, eos = max(model.vocab_size, len(model.tokenizer)), model.eos_token_ids
        else:  # only a TextCodec skips the drafter (cli/edge_options.py build_worker)
            vocab, eos = self.codec.vocab_size, self.codec.eos_token_ids
        return ModelInfo(model_name="", vocab_size=vocab, tokenizer_fingerprint=self.tokenizer_fp, model_fingerprint="",
                         max_context=0, max_draft=self.config.policy.max_draft, max_sessions=0, idle_timeout_s=0,
                         eos_token_ids=eos)

    def generate(self, prompt_ids: list[int], config: EdgeConfig | None = None) -> Generation:
        """Generate up to config.generation.max_new_tokens tokens after `prompt_ids`; the generation,
        ended (its `token_ids`, `text`, `stats`)."""
        generation = self.stream(prompt_ids, config)
        for _ in generation:
            pass
        return generation

    def stream(self, prompt_ids: list[int], config: EdgeConfig | None = None) -> Generation:
        """The same generation, to be iterated for its Events. config: this generation's settings
        (default: the worker's). Checks the prompt against the verifier before any work (a refusal
        opens nothing); if the cloud never answered and `allow_unverified` is on, the generation
        starts offline with the drafter's own view of the target."""
        cfg = (config or self.config).resolved()  # the rule named, a seed drawn if none was given
        client = self.lease()
        try:
            info = self.info if self.connected else self.connect(client)
            check_context(len(prompt_ids), cfg.generation.max_new_tokens, info.max_context)  # before any work
            self._ask_for_curve()
        except Unavailable:
            if not cfg.link.allow_unverified:
                self.release(client)
                raise
            info = self.local_info()  # offline from the start: the drafter's own view
        except BaseException:
            self.release(client)
            raise
        return Generation(self, client, list(prompt_ids), cfg, info)

    def lease(self) -> VerifierClient:
        """A connection for one generation (give it back with `release`)."""
        with self._lock:
            if self._idle:
                return self._idle.pop()
            client = VerifierClient(self.client.address, self.client.timeout_s, self.client.access)
            self._clients.append(client)
            return client

    def release(self, client: VerifierClient) -> None:
        """A generation is done with its connection."""
        with self._lock:
            self._idle.append(client)

    def close(self) -> None:
        """Close every connection."""
        with self._lock:
            for client in self._clients:
                client.close()
