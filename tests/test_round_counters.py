"""The front door's round counters (cloud/api/metrics.py `RoundCounters`) export exactly what
prometheus_client's own Counter and Histogram would for the same rounds: same names, labels, buckets
and values."""
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram

from hybridspec.cloud.api.metrics import BATCH_BUCKETS, LATENCY_BUCKETS, Metrics
from hybridspec.cloud.core.telemetry import RoundSample


def reference(samples: list[RoundSample], generated: int) -> CollectorRegistry:
    """The same rounds counted with a lock per increment, as the front door did before."""
    r = CollectorRegistry()
    drafts = Counter("hybridspec_spec_decode_num_drafts", "", registry=r)
    draft_tokens = Counter("hybridspec_spec_decode_num_draft_tokens", "", registry=r)
    accepted = Counter("hybridspec_spec_decode_num_accepted_tokens", "", registry=r)
    accepted_at = Counter("hybridspec_spec_decode_num_accepted_tokens_per_pos", "", ["position"], registry=r)
    drafted_at = Counter("hybridspec_spec_decode_num_draft_tokens_per_pos", "", ["position"], registry=r)
    generation = Counter("hybridspec_generation_tokens", "", registry=r)
    generate = Counter("hybridspec_generate_tokens", "", registry=r)
    feature_bytes = Counter("hybridspec_feature_bytes", "", registry=r)
    batch = Histogram("hybridspec_batch_size", "", buckets=BATCH_BUCKETS, registry=r)
    verify = Histogram("hybridspec_verify_seconds", "", buckets=LATENCY_BUCKETS, registry=r)
    queue = Histogram("hybridspec_request_queue_time_seconds", "", buckets=LATENCY_BUCKETS, registry=r)
    for s in samples:
        if s.gamma:
            drafts.inc()
            draft_tokens.inc(s.gamma)
        accepted.inc(s.num_accepted)
        generation.inc(s.num_accepted + 1)
        for position in range(s.gamma):  # a position's two series both appear once a draft reaches it
            drafted_at.labels(str(position)).inc()
            accepted_at.labels(str(position)).inc(1 if position < s.num_accepted else 0)
        batch.observe(s.batch_size)
        verify.observe(s.seconds)
        queue.observe(s.queue_ms / 1e3)
        feature_bytes.inc(s.feature_bytes)
    generate.inc(generated)
    generation.inc(generated)
    return r


def exported(registry: CollectorRegistry, names: set[str]) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): round(s.value, 9)
            for family in registry.collect() if family.name in names for s in family.samples
            if not s.name.endswith("_created")}


samples = st.lists(st.builds(
    lambda gamma, accepted, batch, seconds, queue_ms, nbytes: RoundSample(gamma, min(accepted, gamma), batch, seconds,
                                                                          queue_ms, nbytes),
    st.integers(0, 9), st.integers(0, 9), st.integers(1, 128), st.floats(0, 6, allow_nan=False),
    st.floats(0, 6000, allow_nan=False), st.integers(0, 4096)), max_size=40)


@settings(max_examples=60, deadline=None)
@given(samples, st.integers(0, 50))
def test_the_round_counters_export_what_prometheus_clients_own_metrics_would(rounds, generated):
    metrics = Metrics()
    for sample in rounds:
        metrics.rounds.count(sample)
    metrics.observe_generated(generated)
    want = reference(rounds, generated)
    names = {family.name for family in want.collect()}
    assert exported(metrics.registry, names) == exported(want, names)
