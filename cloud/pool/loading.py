"""A replica's verifier loaded from its spec, whichever backend serves it (a Ray actor, a process of its
own, the front door's process): its target on the engine its settings pick, batching as they say, and its
pass-cost curve."""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from ...common.protocol.wire import ModelInfo
from ..core import cost_cache
from ..core.costs import CurveMeasurement, measure_in_background
from .specs import ReplicaSpec

if TYPE_CHECKING:  # imported where a model is loaded: the front door of a Ray pool never imports torch
    from ..core.verifier import Verifier

log = logging.getLogger(__name__)


def load_verifier(spec: ReplicaSpec, measured: Callable[[ModelInfo], None] | None = None) -> Verifier:
    """A replica's verifier (a Ray replica's, and `cloud serve --backend inprocess` or `process`'s): its
    target loaded on the engine its settings pick, batching as they say, and its pass-cost curve, which the
    start never waits for. The curve kept from an earlier start with the same key is reported at once
    (cloud/core/cost_cache.py); else it is measured on the model thread once that runs, a pass at a time
    while no session is open (cloud/core/costs.py), then reported and kept. `measured(info)` runs once
    `info` holds it (never with pass_cost_tokens 0). An edge that connects before it sizes blocks from its
    own rounds until then."""
    from ..core.verifier import Verifier
    from ..engine.factory import load_engine

    settings = spec.settings
    target, engine = load_engine(spec.target, settings.engine, settings.device, settings.dtype,
                                 settings.torch_threads, spec.limits)
    verifier = Verifier(target, spec.limits, engine, max_batch=settings.max_batch_size,
                        max_wait_ms=settings.max_wait_ms, prefill_budget_ms=settings.prefill_budget_ms,
                        hold=settings.hold, fair_share=settings.fair_share)
    if settings.pass_cost_tokens:
        _pass_costs(verifier, verifier.pass_cost_measurement(settings.pass_cost_tokens), measured)
    return verifier


def _pass_costs(verifier: Verifier, measurement: CurveMeasurement,
                measured: Callable[[ModelInfo], None] | None) -> None:
    """The curve kept for this key reported now, or `measurement` queued on the verifier's stepping thread."""
    key = cost_cache.curve_key(verifier.info.model_fingerprint, verifier.engine, measurement.max_tokens,
                               measurement.batch_sessions)
    kept = cost_cache.load(key) if key is not None else None
    if kept is not None:
        verifier.publish_pass_costs(*kept)
        log.info("pass costs of %d sizes kept from an earlier start on this machine", len(kept[0]))
        if measured is not None:
            measured(verifier.info)
        return

    def done(finished: CurveMeasurement) -> None:
        verifier.publish_pass_costs(*finished.curves)
        log.info("pass costs of %d sizes measured", len(finished.curves[0]))
        if key is not None:
            cost_cache.store(key, finished.curves)
        if measured is not None:
            measured(verifier.info)

    log.info("measuring pass costs while no session is open (no curve kept for this model, engine and machine)")
    measure_in_background(measurement, verifier.submit_call, done, verifier.idle)
