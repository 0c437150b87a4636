"""Protobuf <-> wire dataclasses. The only module that knows both; it never touches tensors."""
from __future__ import annotations

import math

from .errors import InvalidArgument
from .proto import verifier_pb2 as pb
from .wire import (DEFAULT_LENIENCE, DEFAULT_ROLLBACK_THRESHOLD, DecodeSpec, DraftBlock, FeatureBlock, FeatureFormat,
                   GenerateSpec, Mode, ModelInfo, OpenProgress, SamplingParams, SessionOpened, SessionSpec,
                   VerifyResult)

_MODE_TO_PB = {Mode.GREEDY: pb.MODE_GREEDY, Mode.SPECULATIVE: pb.MODE_SPECULATIVE,
               Mode.BILD: pb.MODE_BILD, Mode.LENIENT: pb.MODE_LENIENT, Mode.COUPLED: pb.MODE_COUPLED}
_PB_TO_MODE = {v: k for k, v in _MODE_TO_PB.items()}
_FEATURES_TO_PB = {FeatureFormat.NONE: pb.FEATURES_NONE, FeatureFormat.INT8: pb.FEATURES_INT8,
                   FeatureFormat.FP16: pb.FEATURES_FP16}
_PB_TO_FEATURES = {v: k for k, v in _FEATURES_TO_PB.items()}


def _feature_format(value: int, field: str) -> FeatureFormat:
    if value not in _PB_TO_FEATURES:
        raise InvalidArgument(f"{field} {value} is not a known FeatureFormat")
    return _PB_TO_FEATURES[value]


def features_to_pb(b: FeatureBlock) -> pb.Features:
    """Encode a block of features (bytes as they are: the codec never touches tensors)."""
    return pb.Features(start=b.start, count=b.count, dim=b.dim, format=_FEATURES_TO_PB[b.format], data=b.data,
                       scales=b.scales)


def features_from_pb(m: pb.Features) -> FeatureBlock:
    """Decode a block of features; its byte lengths are checked by FeatureBlock.validate."""
    return FeatureBlock(start=m.start, count=m.count, dim=m.dim, format=_feature_format(m.format, "features.format"),
                        data=m.data, scales=m.scales)


def _optional_features(b: FeatureBlock | None) -> pb.Features | None:
    return None if b is None else features_to_pb(b)


def sampling_to_pb(s: SamplingParams) -> pb.SamplingParams:
    """Encode sampling parameters."""
    return pb.SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                             repetition_penalty=s.repetition_penalty, frequency_penalty=s.frequency_penalty,
                             presence_penalty=s.presence_penalty)


def sampling_from_pb(m: pb.SamplingParams) -> SamplingParams:
    """Decode sampling parameters; top_p and repetition_penalty 0 mean "not set" (proto3 default)."""
    return SamplingParams(temperature=m.temperature, top_k=m.top_k, top_p=m.top_p or 1.0,
                          repetition_penalty=m.repetition_penalty or 1.0, frequency_penalty=m.frequency_penalty,
                          presence_penalty=m.presence_penalty)


def model_info_to_pb(i: ModelInfo) -> pb.ModelInfo:
    """Encode a server's model description."""
    return pb.ModelInfo(model_name=i.model_name, vocab_size=i.vocab_size,
                        tokenizer_fingerprint=i.tokenizer_fingerprint,
                        model_fingerprint=i.model_fingerprint, max_context=i.max_context,
                        max_draft=i.max_draft, max_sessions=i.max_sessions,
                        idle_timeout_s=i.idle_timeout_s, eos_token_ids=list(i.eos_token_ids),
                        device=i.device, dtype=i.dtype, feature_dim=i.feature_dim,
                        pass_costs=[pb.PassCost(tokens=m, ms=ms) for m, ms in i.pass_costs],
                        max_tree_nodes=i.max_tree_nodes,
                        batch_pass_costs=[pb.PassCost(sessions=b, tokens=m, ms=ms) for b, m, ms in i.batch_pass_costs])


def model_info_from_pb(m: pb.ModelInfo) -> ModelInfo:
    """Decode a server's model description."""
    return ModelInfo(model_name=m.model_name, vocab_size=m.vocab_size,
                     tokenizer_fingerprint=m.tokenizer_fingerprint,
                     model_fingerprint=m.model_fingerprint, max_context=m.max_context,
                     max_draft=m.max_draft, max_sessions=m.max_sessions,
                     idle_timeout_s=m.idle_timeout_s, eos_token_ids=tuple(m.eos_token_ids),
                     device=m.device, dtype=m.dtype, feature_dim=m.feature_dim,
                     pass_costs=_pass_costs(m.pass_costs), max_tree_nodes=m.max_tree_nodes,
                     batch_pass_costs=_batch_pass_costs(m.batch_pass_costs))


def _pass_costs(points) -> tuple[tuple[int, float], ...]:
    """A server's cost curve as the edge may use it: nothing unless every point is finite and positive
    and M strictly increases (a broken or hostile server cannot steer the policy with a bad shape)."""
    curve = tuple((int(p.tokens), float(p.ms)) for p in points)
    sane = all(m >= 1 and math.isfinite(ms) and ms > 0 for m, ms in curve) and all(
        a[0] < b[0] for a, b in zip(curve, curve[1:]))
    return curve if sane else ()


def _batch_pass_costs(points) -> tuple[tuple[int, int, float], ...]:
    """Passes of several sessions, as the edge may use them: nothing unless every group of one B is a
    sane curve (as _pass_costs) and B > 1."""
    groups: dict[int, list] = {}
    for p in points:
        groups.setdefault(int(p.sessions), []).append(p)
    if any(b < 2 or not _pass_costs(group) for b, group in groups.items()):
        return ()
    return tuple((b, m, ms) for b, group in groups.items() for m, ms in _pass_costs(group))


def session_to_pb(s: SessionSpec) -> pb.OpenSessionRequest:
    """Encode an open/re-open request."""
    return pb.OpenSessionRequest(
        session_id=s.session_id, committed_ids=list(s.committed_ids), sampling=sampling_to_pb(s.sampling),
        mode=_MODE_TO_PB[s.mode], seed=s.seed, rollback_threshold=s.rollback_threshold,
        lenience=s.lenience, tokenizer_fingerprint=s.tokenizer_fingerprint,
        model_fingerprint=s.model_fingerprint, next_round=s.next_round, features=_FEATURES_TO_PB[s.features],
        prompt_len=s.prompt_len)


def session_from_pb(m: pb.OpenSessionRequest) -> SessionSpec:
    """Decode an open/re-open request; MODE_UNSPECIFIED picks Mode.default_for the temperature."""
    sampling = sampling_from_pb(m.sampling)
    if m.mode == pb.MODE_UNSPECIFIED:
        mode = Mode.default_for(sampling.temperature)
    elif m.mode in _PB_TO_MODE:
        mode = _PB_TO_MODE[m.mode]
    else:
        raise InvalidArgument(f"mode {m.mode} is not a known Mode")
    features = _feature_format(m.features, "features")
    return SessionSpec(
        session_id=m.session_id, committed_ids=tuple(m.committed_ids), sampling=sampling, mode=mode,
        seed=m.seed, rollback_threshold=m.rollback_threshold or DEFAULT_ROLLBACK_THRESHOLD,
        lenience=m.lenience or DEFAULT_LENIENCE,
        tokenizer_fingerprint=m.tokenizer_fingerprint, model_fingerprint=m.model_fingerprint,
        next_round=m.next_round, features=features, prompt_len=m.prompt_len)


def opened_to_pb(o: SessionOpened) -> pb.OpenSessionReply:
    """Encode the answer to OpenSession."""
    return pb.OpenSessionReply(session_id=o.session_id, committed_len=o.committed_len,
                               verify_address=o.verify_address, features=_optional_features(o.features))


def opened_from_pb(m: pb.OpenSessionReply) -> SessionOpened:
    """Decode the answer to OpenSession."""
    return SessionOpened(session_id=m.session_id, committed_len=m.committed_len, verify_address=m.verify_address,
                         features=features_from_pb(m.features) if m.HasField("features") else None)


def progress_to_pb(item: OpenProgress | SessionOpened) -> pb.OpenSessionProgress:
    """Encode one message of OpenSessionStream: progress, or the last one with the reply."""
    if isinstance(item, SessionOpened):
        return pb.OpenSessionProgress(opened=opened_to_pb(item))
    return pb.OpenSessionProgress(cached_tokens=item.cached, prompt_tokens=item.total)


def progress_from_pb(m: pb.OpenSessionProgress) -> OpenProgress | SessionOpened:
    """Decode one message of OpenSessionStream."""
    if m.HasField("opened"):
        return opened_from_pb(m.opened)
    return OpenProgress(cached=m.cached_tokens, total=m.prompt_tokens)


def block_to_pb(b: DraftBlock) -> pb.VerifyRequest:
    """Encode a draft block."""
    return pb.VerifyRequest(
        session_id=b.session_id, round=b.round, committed_len=b.committed_len,
        draft_ids=list(b.draft_ids),
        draft_probs=[pb.DraftPosition(support_ids=list(ids), probs=list(ps))
                     for ids, ps in zip(b.support_ids, b.probs)],
        draft_parents=list(b.parents))


def block_from_pb(m: pb.VerifyRequest, owner: str = "") -> DraftBlock:
    """Decode a draft block (validation happens in DraftBlock.validate); `owner` is the identity that sent
    it, as the server that took it authenticated it (never on the wire)."""
    return DraftBlock(
        session_id=m.session_id, round=m.round, committed_len=m.committed_len,
        draft_ids=tuple(m.draft_ids),
        support_ids=tuple(tuple(d.support_ids) for d in m.draft_probs),
        probs=tuple(tuple(d.probs) for d in m.draft_probs),
        parents=tuple(m.draft_parents), owner=owner)


def result_to_pb(r: VerifyResult) -> pb.VerifyReply:
    """Encode a verification result."""
    return pb.VerifyReply(round=r.round, num_accepted=r.num_accepted, next_token=r.next_token,
                          committed_len=r.committed_len, verify_ms=r.verify_ms, batch_size=r.batch_size,
                          queue_ms=r.queue_ms, features=_optional_features(r.features),
                          accepted_nodes=list(r.accepted_path))


def result_from_pb(m: pb.VerifyReply) -> VerifyResult:
    """Decode a verification result."""
    return VerifyResult(round=m.round, num_accepted=m.num_accepted, next_token=m.next_token,
                        committed_len=m.committed_len, verify_ms=m.verify_ms, batch_size=m.batch_size,
                        queue_ms=m.queue_ms,
                        features=features_from_pb(m.features) if m.HasField("features") else None,
                        accepted_path=tuple(m.accepted_nodes))


def generate_to_pb(g: GenerateSpec) -> pb.GenerateRequest:
    """Encode a cloud-only generation request."""
    return pb.GenerateRequest(prompt_ids=list(g.prompt_ids), sampling=sampling_to_pb(g.sampling),
                              max_new_tokens=g.max_new_tokens, seed=g.seed,
                              tokenizer_fingerprint=g.tokenizer_fingerprint, prompt_len=g.prompt_len)


def generate_from_pb(m: pb.GenerateRequest) -> GenerateSpec:
    """Decode a cloud-only generation request."""
    return GenerateSpec(prompt_ids=tuple(m.prompt_ids), sampling=sampling_from_pb(m.sampling),
                        max_new_tokens=m.max_new_tokens, seed=m.seed,
                        tokenizer_fingerprint=m.tokenizer_fingerprint, prompt_len=m.prompt_len)


def decode_to_pb(d: DecodeSpec) -> pb.DecodeRequest:
    """Encode a cloud-only stream on an open session."""
    return pb.DecodeRequest(session_id=d.session_id, round=d.round, committed_len=d.committed_len,
                            max_new_tokens=d.max_new_tokens)


def decode_from_pb(m: pb.DecodeRequest) -> DecodeSpec:
    """Decode a cloud-only stream on an open session."""
    return DecodeSpec(m.session_id, m.round, m.committed_len, m.max_new_tokens)
