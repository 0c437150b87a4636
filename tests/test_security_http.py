"""The edge's HTTP side on the internet: `edge serve` over HTTPS with API keys from a credentials file,
in front of a worker that talks TLS and a token to the cloud."""
from __future__ import annotations

import time

import pytest

from hybridspec.edge.client import VerifierClient
from hybridspec.edge.config import EdgeConfig
from hybridspec.edge.worker import EdgeWorker

from test_security import NEW_TOKENS, PROMPT, edge_access, pki, secure_server, tokens  # noqa: F401 (fixtures)
from tinymodels import EVERY_ROUND, greedy_reference

def test_edge_serve_over_https_with_api_keys(secure_server, pki, tokens, target, model_dirs):
    """The edge's HTTP side: HTTPS with a throw-away certificate, /v1/ only with a key from a
    credentials file (401 in OpenAI's shape otherwise), health and metrics open; the worker behind it
    talks TLS and a token to the cloud. Output still exactly the target's."""
    import ssl
    import threading

    import httpx2
    import openai
    import uvicorn

    from hybridspec.common.security.credentials import CredentialStore
    from hybridspec.common.models.loading import load_model
    from hybridspec.edge.serve.app import create_app
    from hybridspec.edge.serve.config import ServeOptions

    keys_path = tokens[0]  # the same file format as the cloud's; here the very same identities
    options = ServeOptions(http_tls_cert=pki["cert"], http_tls_key=pki["key"], api_keys=keys_path, warmup_tokens=0)
    config = EdgeConfig.of(cloud=secure_server.address, max_new_tokens=NEW_TOKENS, max_draft=4,
                           fallback_threshold=0.0, **EVERY_ROUND)
    worker = EdgeWorker(load_model(model_dirs["target"], device="cpu"),
                        VerifierClient(secure_server.address, config.link.timeout_s,
                                       edge_access(pki, tokens[1]["alice"])), config)
    app = create_app(worker, options, CredentialStore(keys_path))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off",
                                           ssl_certfile=pki["cert"], ssl_keyfile=pki["key"]))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        port = server.servers[0].sockets[0].getsockname()[1]
        base = f"https://127.0.0.1:{port}"
        trusted = ssl.create_default_context(cafile=pki["ca"])
        model = app.state.service.model
        body = {"model": model, "prompt": PROMPT, "max_tokens": NEW_TOKENS}
        with httpx2.Client(verify=trusted) as http:
            for headers in ({}, {"Authorization": "Bearer hs_made-up"}, {"Authorization": "Basic eDp5"}):
                refused = http.post(f"{base}/v1/completions", json=body, headers=headers)
                assert refused.status_code == 401, headers
                assert refused.json()["error"]["code"] == "invalid_api_key"
            assert http.get(f"{base}/health").status_code == 200  # open, as are /metrics
            assert http.get(f"{base}/metrics").status_code == 200
        with pytest.raises(httpx2.ConnectError):  # a client that does not trust the CA never gets in
            httpx2.get(f"{base}/health", verify=ssl.create_default_context(cafile=pki["other_ca"]))
        with openai.OpenAI(base_url=f"{base}/v1", api_key=tokens[1]["bob"], max_retries=0,
                           http_client=httpx2.Client(verify=trusted)) as client:  # closed: uvicorn waits for it
            reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=NEW_TOKENS)
        assert reply.choices[0].text == target.tokenizer.decode(greedy_reference(target, PROMPT, NEW_TOKENS),
                                                                 skip_special_tokens=True)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        worker.close()
