"""`edge serve`: a real uvicorn server on localhost in front of a real worker and verifier (tiny
models), driven by the official OpenAI client and by raw HTTP."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx2
import openai
import pytest
import uvicorn
from hybridspec.cli.serve_cmd import parse_ready_line
from hybridspec.cloud.api.server import BackgroundServer
from hybridspec.common.protocol.errors import HybridSpecError
from hybridspec.common.protocol.wire import SessionSpec
from hybridspec.common.models.loading import load_model
from hybridspec.edge.client import VerifierClient
from hybridspec.edge.config import EdgeConfig
from hybridspec.edge.prompt import encode_messages
from hybridspec.edge.serve.app import create_app
from hybridspec.edge.serve.config import ServeOptions
from hybridspec.edge.serve.generation import warm_up
from hybridspec.edge.worker import EdgeWorker
from hybridspec.netem.relay import BackgroundLink
from hybridspec.netem.shaping import LinkSpec
from tinymodels import EOS_ID, EVERY_ROUND, greedy_reference

CHAT = [{"role": "system", "content": "w9 w10"}, {"role": "user", "content": "w5 w17 w33"}]
NEW = 16


@contextlib.contextmanager
def serving(worker: EdgeWorker, **options):
    """The app on a free localhost port, served by uvicorn on a thread: (base URL, model id)."""
    app = create_app(worker, ServeOptions(**options))
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", app.state.service.model
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        worker.close()


def make_worker(address: str, drafter, **cfg) -> EdgeWorker:
    config = EdgeConfig.of(**{"cloud": address, "max_new_tokens": NEW, "max_draft": 4, **EVERY_ROUND, **cfg})
    return EdgeWorker(drafter, VerifierClient(address, config.link.timeout_s), config)


def expected(target, prompt: list[int], n: int) -> tuple[str, list[int], str]:
    """(text, tokens, finish_reason) of the target's own greedy decoding."""
    ref = greedy_reference(target, prompt, n)
    if EOS_ID in ref:
        ref = ref[: ref.index(EOS_ID) + 1]
    return target.tokenizer.decode(ref, skip_special_tokens=True), ref, "stop" if EOS_ID in ref else "length"


@pytest.fixture(scope="module")
def drafter(model_dirs):
    """A second copy of the target as the drafter: it always agrees, so rounds accept tokens."""
    return load_model(model_dirs["target"], device="cpu")


@pytest.fixture(scope="module")
def api(server, drafter):
    """(base URL, model id, OpenAI client) of a server in front of the shared verifier."""
    worker = make_worker(server.address, drafter, fallback_threshold=0.0)
    warm_up(worker, 8)
    with serving(worker) as (base, model):
        yield base, model, openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


def test_chat_completion_is_the_targets_greedy_output_with_the_chat_template(api, target):
    _, model, client = api
    reply = client.chat.completions.create(model=model, messages=CHAT, max_tokens=NEW)
    prompt = encode_messages(target.tokenizer, CHAT)
    text, tokens, finish = expected(target, prompt, NEW)
    assert reply.choices[0].message.content == text
    assert reply.choices[0].finish_reason == finish
    assert reply.model == model and reply.object == "chat.completion"
    usage = reply.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), len(tokens))
    assert usage.total_tokens == len(prompt) + len(tokens)
    spec = usage.model_extra["speculative"]
    assert spec["rounds"] > 0 and spec["drafted_tokens"] >= spec["accepted_tokens"] > 0
    assert spec["uplink_bytes"] > 0 and spec["downlink_bytes"] > 0 and spec["unverified_tokens"] == 0


def test_streamed_chat_adds_up_to_the_whole_reply_and_ends_with_usage(api, target):
    _, model, client = api
    chunks = list(client.chat.completions.create(model=model, messages=CHAT, max_tokens=NEW, stream=True,
                                                 stream_options={"include_usage": True}))
    text, tokens, finish = expected(target, encode_messages(target.tokenizer, CHAT), NEW)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == finish
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == len(tokens)
    assert len({c.id for c in chunks}) == 1


def test_text_completions_whole_streamed_and_from_token_ids(api, target):
    _, model, client = api
    text, _, finish = expected(target, [5, 17, 33], NEW)
    whole = client.completions.create(model=model, prompt="w5 w17 w33", max_tokens=NEW)
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == (text, finish)
    assert whole.usage.prompt_tokens == 3
    streamed = client.completions.create(model=model, prompt=[5, 17, 33], max_tokens=NEW, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text


def test_stop_string_ends_the_text_before_it(api, target):
    _, model, client = api
    text, _, _ = expected(target, [5, 17, 33], NEW)
    stop = text.split()[3]
    reply = client.completions.create(model=model, prompt="w5 w17 w33", max_tokens=NEW, stop=[stop, "w999"])
    assert reply.choices[0].text == text[: text.index(stop)]
    assert reply.choices[0].finish_reason == "stop"


def test_sampling_fields_reach_the_worker_and_a_seed_makes_it_reproducible(server, drafter):
    # A seed selects the coupled rule: the same text whatever γ, pipelining or timing did.
    worker = make_worker(server.address, drafter)
    with serving(worker) as (base, model):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        fields = {"model": model, "prompt": "w5 w17 w33", "max_tokens": NEW, "temperature": 0.9, "top_p": 0.95,
                  "presence_penalty": 0.3, "frequency_penalty": 0.2,
                  "extra_body": {"top_k": 50, "repetition_penalty": 1.1}}
        first, again = (client.completions.create(seed=7, **fields).choices[0].text for _ in range(2))
        assert first == again
        unseeded = {client.completions.create(**fields).choices[0].text for _ in range(3)}
        assert len(unseeded) > 1  # no seed: a fresh one per request, as with OpenAI


def test_concurrent_requests_each_get_their_own_exact_output(api, target):
    _, model, client = api
    prompts = [[5, 17, 33], [9, 200, 31], [7], [40, 41, 42, 43]]
    results: dict[int, str] = {}

    def one(i: int) -> None:
        stream = i % 2 == 1
        reply = client.completions.create(model=model, prompt=prompts[i], max_tokens=NEW, stream=stream)
        results[i] = "".join(c.choices[0].text for c in reply) if stream else reply.choices[0].text

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == {i: expected(target, p, NEW)[0] for i, p in enumerate(prompts)}


@pytest.mark.parametrize(("body", "status", "param", "code"), [
    ({"n": 2}, 400, "n", "unsupported_parameter"),
    ({"logprobs": True}, 400, "logprobs", "unsupported_parameter"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools", "unsupported_parameter"),
    ({"max_tokens": -1}, 400, "max_tokens", "invalid_value"),
    ({"max_tokens": 10_000}, 400, "max_tokens", "context_length_exceeded"),
    ({"temperature": "hot"}, 400, "temperature", "invalid_value"),
    ({"stop": 5}, 400, "stop", "invalid_value"),
    ({"messages": "w5"}, 400, "messages", "invalid_value"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages[0].content",
     "invalid_value"),
    ({"model": "gpt-4o"}, 404, "model", "model_not_found"),
], ids=["n", "logprobs", "tools", "negative-max-tokens", "over-context", "wrong-type", "stop-type", "messages-type",
        "image", "unknown-model"])
def test_bad_requests_get_the_openai_error_shape(api, body, status, param, code):
    base, model, _ = api
    request = {"model": model, "messages": [{"role": "user", "content": "w5"}], **body}
    r = httpx2.post(f"{base}/v1/chat/completions", json=request, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == (param, code), error
    assert error["message"] and error["type"] == ("invalid_request_error" if status in (400, 404) else error["type"])


def test_malformed_bodies_routes_and_sizes(api):
    base, model, client = api
    r = httpx2.post(f"{base}/v1/chat/completions", content=b'{"model": ', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx2.post(f"{base}/v1/completions", json=[1, 2])
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_body"
    r = httpx2.get(f"{base}/v1/engines")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx2.post(f"{base}/v1/completions", json={"model": model, "prompt": "w5 " * 600_000})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx2.post(f"{base}/v1/completions", json={"model": model, "prompt": "w5", "max_tokens": 2, "foo": {"x": 1}})
    assert r.status_code == 200, r.text  # unknown fields are ignored, as OpenAI does
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=model, prompt=["w5", "w6"], max_tokens=2)
    assert raised.value.status_code == 400 and raised.value.param == "prompt"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="w5")


def test_an_oversized_body_always_gets_its_413(api):
    """The 413 is sent before the body is read; the server used to close the connection with the
    rest of the body unread, and the kernel's reset could reach the client before the answer did
    (a connection reset in CI instead of a 413)."""
    base, model, _ = api
    body = {"model": model, "prompt": "w5 " * 600_000}
    for _ in range(20):
        r = httpx2.post(f"{base}/v1/completions", json=body)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_models_health_and_metrics(api):
    base, model, client = api
    assert [m.id for m in client.models.list()] == [model]
    assert client.models.retrieve(model).id == model
    health = httpx2.get(f"{base}/health").json()
    assert health["status"] == "ok" and health["ready"] and health["cloud"]["reachable"]
    assert health["generations"]["admitted"] == 0 and health["model"] == model
    assert httpx2.get(f"{base}/health/ready").status_code == 200
    client.completions.create(model=model, prompt="w5", max_tokens=4)
    metrics = httpx2.get(f"{base}/metrics").text
    for name in ("hybridspec_edge_prompt_tokens_total", "hybridspec_edge_completion_tokens_total",
                 "hybridspec_edge_spec_decode_num_accepted_tokens_total",
                 "hybridspec_edge_spec_decode_num_draft_tokens_total",
                 "hybridspec_edge_spec_decode_num_drafts_total", "hybridspec_edge_uplink_bytes_total",
                 "hybridspec_edge_inter_token_latency_seconds_bucket",
                 "hybridspec_edge_time_to_first_token_seconds_bucket", "hybridspec_edge_requests_in_flight",
                 "hybridspec_edge_http_request_duration_seconds_bucket"):
        assert name in metrics, name
    assert 'hybridspec_edge_http_requests_total{endpoint="/v1/completions",status="200"}' in metrics
    assert 'hybridspec_edge_http_requests_total{endpoint="other",status="404"}' in metrics
    assert _metric(metrics, "hybridspec_edge_completion_tokens_total") >= 4


def _metric(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith((name + " ", name + "{")))


def _long_prompt(target, n: int) -> list[int]:
    """A prompt whose greedy continuation runs n tokens without an end-of-sequence token."""
    for first in range(4, 256):
        if EOS_ID not in greedy_reference(target, [first, 7], n):
            return [first, 7]
    pytest.fail(f"every prompt of the tiny target reaches EOS within {n} tokens: the test needs a long one")


def test_over_the_limit_429_and_a_disconnect_stops_the_generation(server, target, random_drafter):
    prompt = _long_prompt(target, 400)
    worker = make_worker(server.address, random_drafter, max_draft=1)
    with serving(worker, max_concurrent=1, max_queued=0) as (base, model):
        request = {"model": model, "prompt": prompt, "max_tokens": 400, "stream": True}
        with httpx2.stream("POST", f"{base}/v1/completions", json=request, timeout=30) as first:
            assert first.status_code == 200
            lines = first.iter_lines()  # kept: an iterator that is dropped closes the response
            next(lines)  # generating now
            busy = httpx2.post(f"{base}/v1/completions", json={**request, "stream": False})
            assert busy.status_code == 429 and busy.json()["error"]["code"] == "too_many_requests"
        # The client went away mid-stream: its generation stops and its slot frees.
        _wait_until_idle(base)
        # So does a client that gives up waiting for a whole reply.
        with pytest.raises(httpx2.ReadTimeout):
            httpx2.post(f"{base}/v1/completions", json={**request, "stream": False},
                        timeout=httpx2.Timeout(30, read=0.3))
        _wait_until_idle(base)
        metrics = httpx2.get(f"{base}/metrics").text
        assert _metric(metrics, 'hybridspec_edge_generations_total{outcome="cancelled"}') == 2
        assert _metric(metrics, "hybridspec_edge_completion_tokens_total") < 400


def _wait_until_idle(base: str) -> None:
    deadline = time.monotonic() + 20
    while httpx2.get(f"{base}/health").json()["generations"]["admitted"]:
        assert time.monotonic() < deadline, "the generation did not stop"
        time.sleep(0.05)


@pytest.fixture
def link(server):
    """An emulated link in front of the shared server, which a test can cut."""
    with BackgroundLink(LinkSpec(), server.address) as link:
        yield link


def test_cloud_lost_mid_stream_ends_it_with_an_error_event(link, target, random_drafter):
    prompt = _long_prompt(target, 400)
    text, _, _ = expected(target, prompt, 400)
    worker = make_worker(link.address, random_drafter, max_draft=1, timeout_s=3)
    with serving(worker) as (base, model):
        request = {"model": model, "prompt": prompt, "max_tokens": 400, "stream": True}
        with httpx2.stream("POST", f"{base}/v1/completions", json=request, timeout=30) as r:
            lines = r.iter_lines()
            streamed = json.loads(next(line for line in lines if line)[6:])["choices"][0]["text"]
            link.set_down(True)
            events = [line[6:] for line in lines if line]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "cloud_unavailable"
        streamed += "".join(json.loads(e)["choices"][0]["text"] for e in events[:-2])
        assert streamed and text.startswith(streamed)  # what was verified before the cut stays
        health = httpx2.get(f"{base}/health").json()
        assert health["status"] == "unavailable" and not health["cloud"]["reachable"]
        assert httpx2.get(f"{base}/health/ready").status_code == 503


@pytest.mark.slow
def test_cloud_lost_mid_generation_gives_503_with_the_partial_text(link, target, random_drafter):
    prompt = _long_prompt(target, 400)
    text, _, _ = expected(target, prompt, 400)
    worker = make_worker(link.address, random_drafter, max_draft=1, timeout_s=3)
    answer = worker.client.wait

    def cut_after_round_3(round_, *args, **kwargs):  # mid-generation: some text is verified, most is not
        result = answer(round_, *args, **kwargs)
        if result.round == 3:
            link.set_down(True)
        return result

    worker.client.wait = cut_after_round_3
    with serving(worker) as (base, model):
        request = {"model": model, "prompt": prompt, "max_tokens": 400}
        r = httpx2.post(f"{base}/v1/completions", json=request, timeout=30)
        assert r.status_code == 503 and r.headers["retry-after"]
        error = r.json()["error"]
        assert error["code"] == "cloud_unavailable" and error["type"] == "service_unavailable"
        assert error["partial_text"] and text.startswith(error["partial_text"])
        r = httpx2.post(f"{base}/v1/completions", json=request, timeout=30)  # the cloud is still away
        assert r.status_code == 503 and r.json()["error"]["partial_text"] == ""


def test_allow_unverified_keeps_generating_and_says_so_in_usage(link, target, model_dirs):
    prompt = _long_prompt(target, 48)
    text, _, _ = expected(target, prompt, 48)
    drafter = load_model(model_dirs["target"], device="cpu")  # its unverified tokens are the target's own
    worker = make_worker(link.address, drafter, timeout_s=1, reconnect_s=0.2, allow_unverified=True)
    with serving(worker) as (base, model):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        chunks = client.completions.create(model=model, prompt=prompt, max_tokens=48, stream=True,
                                           stream_options={"include_usage": True})
        got = next(chunks).choices[0].text
        link.set_down(True)
        rest = list(chunks)
        got += "".join(c.choices[0].text for c in rest if c.choices)
        assert got == text
        assert rest[-1].usage.model_extra["speculative"]["unverified_tokens"] > 0
        assert httpx2.get(f"{base}/health").json()["status"] == "degraded"
        link.set_down(False)


@pytest.mark.slow
def test_the_cli_serves_and_drains_on_sigterm(server, model_dirs):
    env = {**os.environ, "HYBRIDSPEC_HOME": "/nonexistent-hybridspec-home"}
    proc = subprocess.Popen([sys.executable, "-m", "hybridspec.cli.main", "edge", "serve", "--cloud", server.address,
                             "--drafter", str(model_dirs["random"]), "--port", "0", "--warmup-tokens", "4",
                             "--max-new-tokens", "8", "--torch-threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        base = parse_ready_line(line)
        assert base, (line, proc.stderr.read() if proc.poll() is not None else "")
        models = httpx2.get(f"{base}/v1/models").json()["data"]
        reply = httpx2.post(f"{base}/v1/completions", json={"model": models[0]["id"], "prompt": "w5 w6"}, timeout=30)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 8
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def _series_names(text: str) -> set[str]:
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_every_series_the_grafana_dashboard_reads_is_exported(verifier, drafter):
    """deploy/grafana/hybridspec.json only reads series a real cloud and a real edge export after
    serving a request: a renamed metric breaks this test, not a dashboard nobody looks at."""
    sys.path.insert(0, os.path.dirname(__file__))
    from test_deploy_monitoring import dashboard_metric_names

    cloud = BackgroundServer(verifier, metrics_port=0)
    try:
        worker = make_worker(cloud.address, drafter, fallback_threshold=0.0)
        with serving(worker) as (base, model):
            assert httpx2.post(f"{base}/v1/completions", json={"model": model, "prompt": "w5 w6",
                                                                "max_tokens": 8}).status_code == 200
            assert httpx2.get(f"{base}/nowhere").status_code == 404
            edge_text = httpx2.get(f"{base}/metrics").text
        client = VerifierClient(cloud.address, 5)
        with pytest.raises(HybridSpecError, match="vocabulary"):  # one refused call: the error counter has a series
            client.open_session(SessionSpec(session_id="", committed_ids=(5, 10**6)))
        client.close()
        cloud.call(cloud.running.refresh_metrics())
        cloud_text = httpx2.get(f"http://127.0.0.1:{cloud.running.metrics_port}/metrics").text
    finally:
        cloud.stop()
    missing = dashboard_metric_names() - _series_names(cloud_text) - _series_names(edge_text)
    assert not missing, f"the dashboard reads series nobody exports: {sorted(missing)}"
