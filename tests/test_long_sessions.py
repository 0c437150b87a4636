"""Every session may grow to max_context, on both engines, at the default 4,096 and at 8,192: a prompt
just under it opens, rounds take the session to exactly max_context, and the next round is refused
(RESOURCE_EXHAUSTED) as is a longer prompt (INVALID_ARGUMENT naming both numbers), before any work.
llama.cpp runs the embedded drafter's GGUF (a small model of the target's vocabulary), torch the tiny
random target."""
import pytest

from conftest import random_ids, require_embedded
from hybridspec.cloud.core.limits import PrefixScope, VerifierLimits
from hybridspec.cloud.core.verifier import Verifier
from hybridspec.common.protocol.errors import InvalidArgument, ResourceExhausted
from hybridspec.common.protocol.wire import DraftBlock, SessionSpec
from tinymodels import VOCAB, greedy_reference

LENGTHS = [4096, 8192]
TAIL = 3  # tokens decoded after the prompt, the last of them at position max_context - 1


def limits(max_context: int) -> VerifierLimits:
    return VerifierLimits(max_context=max_context, kv_cache_tokens=max_context, kv_streams=1, max_sessions=1,
                          max_tree_nodes=0, prefix_scope=PrefixScope.OFF)


def grow_to_the_limit(verifier: Verifier, prompt: list[int], max_context: int) -> list[int]:
    """Open `prompt` (max_context - TAIL tokens), decode up to max_context, check both refusals; the
    decoded tokens."""
    with pytest.raises(InvalidArgument, match=f"{max_context + 1} tokens.*max_context is {max_context}"):
        verifier.open_session(SessionSpec("long", tuple(prompt) + (5,) * (TAIL + 1)))
    sid = "long"
    verifier.open_session(SessionSpec(sid, tuple(prompt)))
    tokens = []
    for i in range(TAIL):
        tokens.append(verifier.verify(DraftBlock(sid, i, len(prompt) + i, ())).next_token)
    assert verifier.stats().cached_tokens >= max_context - 1
    with pytest.raises(ResourceExhausted, match=f"past max_context {max_context}"):
        verifier.verify(DraftBlock(sid, TAIL, max_context, ()))
    verifier.close_session(sid)
    return tokens


@pytest.mark.slow
@pytest.mark.parametrize("max_context", LENGTHS)
def test_torch_sessions_grow_to_max_context(target, max_context):
    prompt = [4 + (i * 37) % (VOCAB - 4) for i in range(max_context - TAIL)]
    tokens = grow_to_the_limit(Verifier(target, limits(max_context)), prompt, max_context)
    assert tokens == greedy_reference(target, prompt, TAIL)


@pytest.mark.embedded
@pytest.mark.slow
@pytest.mark.parametrize("max_context", LENGTHS)
def test_llamacpp_sessions_grow_to_max_context(max_context, tmp_path):
    require_embedded()
    from hybridspec.cloud.engine.llamacpp_engine import LlamaCppEngine
    from hybridspec.common.models.embedded import default_paths
    from hybridspec.common.models.gguf import GGUF_FILE, GgufTarget

    # The drafter's weights under the target's tokenizer: a target directory as a pull lays it out.
    paths = default_paths()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (tmp_path / name).symlink_to(paths["target"] / name)
    gguf = tmp_path / GGUF_FILE
    gguf.symlink_to(next(paths["plain"].glob("*.gguf")))
    engine = LlamaCppEngine.serving(gguf, limits(max_context), 1)
    verifier = Verifier(GgufTarget(str(tmp_path), gguf, engine.vocab_size), limits(max_context), engine)
    prompt = [100 + t % (engine.vocab_size - 100) for t in random_ids(max_context, max_context - TAIL)]
    assert len(grow_to_the_limit(verifier, prompt, max_context)) == TAIL
