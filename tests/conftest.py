"""Shared fixtures: tiny random models on disk and a real gRPC verifier on localhost."""
from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Callable
from typing import TypeVar

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch
import transformers

from hybridspec.cloud.api.server import BackgroundServer
from hybridspec.cloud.core.verifier import Verifier, VerifierLimits
from hybridspec.common.models.loading import LoadedModel, load_model
from hybridspec.edge.client import VerifierClient
from hybridspec.edge.config import EdgeConfig
from hybridspec.edge.worker import EdgeWorker

from tinymodels import EVERY_ROUND, make_model, save_model

transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """Paths of a tiny target, an unrelated random drafter, and a drafter with another tokenizer."""
    root = tmp_path_factory.mktemp("models")
    return {
        "target": save_model(make_model(seed=0), root / "target"),
        "random": save_model(make_model(seed=1, layers=1), root / "random"),
        "alien": save_model(make_model(seed=2, layers=1), root / "alien", tokenizer_prefix="v"),
    }


@pytest.fixture(scope="session")
def target(model_dirs) -> LoadedModel:
    """The tiny target, loaded through the production loader."""
    return load_model(model_dirs["target"], device="cpu")


@pytest.fixture(scope="session")
def random_drafter(model_dirs) -> LoadedModel:
    """A drafter that (almost) never agrees with the target."""
    return load_model(model_dirs["random"], device="cpu")


@pytest.fixture(scope="session")
def verifier(target) -> Verifier:
    """The verifier core behind the shared server."""
    return Verifier(target, VerifierLimits(max_context=512, max_draft=16, max_sessions=32, idle_timeout_s=600))


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster for the pool tests; replicas ask for fractions of its CPUs."""
    import ray

    from hybridspec.cloud.pool.cluster import start_local
    from hybridspec.cloud.pool.ray_pool import WORKER_ENV

    start_local(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": WORKER_ENV})
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def server(verifier):
    """A real gRPC server on a free localhost port."""
    srv = BackgroundServer(verifier)
    yield srv
    srv.stop()


@contextlib.contextmanager
def started(verifier: Verifier):
    """The verifier's model thread running for the block's duration, as a pool starts and stops it."""
    asyncio.run(verifier.start())
    try:
        yield verifier
    finally:
        asyncio.run(verifier.stop())


T = TypeVar("T")
# A bounded wait's deadline, for an event that comes within a second or two on a quiet machine: generous,
# so that load never fails a test that would pass, while an event that never comes still fails it.
EVENT_TIMEOUT_S = 60.0
REPLICA_RESTART_S = 120.0  # Ray restarting a killed replica, and the pool counting it alive again


def eventually(condition: Callable[[], T], what: str, timeout_s: float = EVENT_TIMEOUT_S, poll_s: float = 0.02) -> T:
    """Poll `condition` until it returns something true, and return that; fail naming `what` (the event
    waited for) if it has not within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout_s:g} s", pytrace=False)
        time.sleep(poll_s)
    return value


def require_embedded() -> None:
    """Fail, naming the fix, when the embedded models are missing: `make test` pulls them first, so a
    test of the real model that silently skipped would hide a broken pull. Without them, deselect
    these tests explicitly: `pytest -m "not embedded"`."""
    from hybridspec.common.models.embedded import models_home
    from hybridspec.fetch.embedded import is_pulled

    if not is_pulled():
        pytest.fail(f"embedded models not pulled into {models_home()}: run `make models` "
                    "(or deselect these tests with -m 'not embedded')", pytrace=False)


# A target `cloud serve` cannot load: a check it makes before loading the model fails with its own
# message, while one made after (or a start that loads the model first) fails on the target instead.
UNLOADABLE = "/nonexistent/hybridspec-target"

LLAMA_CAPACITY = 4096  # the llama.cpp engine fixture's cache: four sessions' streams of 1,024 tokens


@pytest.fixture(scope="module")
def llama_engine():
    """The embedded target on the llama.cpp engine, one thread; a fresh one per test module."""
    require_embedded()
    from hybridspec.cloud.engine.llamacpp_engine import LlamaCppEngine
    from hybridspec.common.models.embedded import default_paths
    from hybridspec.common.models.gguf import find_gguf

    return LlamaCppEngine(find_gguf(default_paths()["target"]), LLAMA_CAPACITY, max_sequences=4, threads=1)


def random_ids(seed: int, n: int) -> list[int]:
    """n token ids of the embedded vocabulary's ordinary range, fixed by `seed`."""
    import numpy as np

    return np.random.default_rng(seed).integers(100, 40000, n).tolist()


def run_edges(address: str, drafters: list[LoadedModel], prompts: list[list[int]], new_tokens: int, **cfg) -> list:
    """One edge worker per prompt (drafters taken in turn), all at once, each on its own channel: their
    generations, every round sent (`EVERY_ROUND`) unless `cfg` says otherwise."""
    results, errors = [None] * len(prompts), []

    def one(i):
        try:
            config = EdgeConfig.of(cloud=address, max_new_tokens=new_tokens, **{**EVERY_ROUND, **cfg})
            with VerifierClient(address) as client:
                results[i] = EdgeWorker(drafters[i % len(drafters)], client, config).generate(prompts[i])
        except Exception as exc:  # surfaced by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    return results
