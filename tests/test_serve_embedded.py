"""`edge serve` in front of the real embedded pair: a chat completion answered exactly as the target
alone would."""
from __future__ import annotations

import openai
import pytest

from hybridspec.cloud.api.server import BackgroundServer
from hybridspec.cloud.core.verifier import Verifier
from hybridspec.common.models.embedded import default_paths
from hybridspec.common.models.loading import load_model
from hybridspec.edge.prompt import encode_messages

from conftest import require_embedded
from test_serve import make_worker, serving
from tinymodels import greedy_reference


@pytest.mark.embedded
@pytest.mark.slow
def test_embedded_pair_answers_a_chat_completion_exactly():
    require_embedded()
    target = load_model(default_paths()["target"], device="cpu")
    cloud = BackgroundServer(Verifier(target))
    try:
        worker = make_worker(cloud.address, load_model(default_paths()["drafter"], device="cpu"))
        with serving(worker) as (base, model):
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
            messages = [{"role": "user", "content": "What is the capital of France?"}]
            reply = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
        prompt = encode_messages(target.tokenizer, messages)
        ref = greedy_reference(target, prompt, 12)
        assert model == "smollm2-135m-instruct"
        assert reply.choices[0].message.content == target.tokenizer.decode(ref, skip_special_tokens=True)
        assert "Paris" in reply.choices[0].message.content
        assert reply.usage.prompt_tokens == len(prompt)
    finally:
        cloud.stop()
