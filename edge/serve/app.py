"""The FastAPI app: OpenAI's chat and text completion endpoints (whole or streamed), the model list,
health and metrics, in front of one already-built EdgeWorker.

Each request is its own generation (generation.Job) on a worker thread. A streamed response starts
once its first text is final, or once the cloud first reports how far it got with a long prompt
(each report is an SSE comment, `: prefill CACHED/TOTAL tokens`, which clients ignore and proxies
see as traffic), so a generation that cannot start (the cloud is unreachable, a bad value) still gets
its HTTP status; after that, a failure ends the stream with an error event. A client that goes away
stops its generation.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from ...common.security.credentials import CredentialStore
from ...common.protocol.errors import HybridSpecError, Unavailable
from ...common.protocol.wire import ModelInfo
from ..config import EdgeConfig
from ..prompt import codec_messages, codec_text
from ..worker import EdgeWorker
from . import errors
from .auth import APIKeys
from .config import ServeOptions
from .errors import APIError, api_error
from .generation import Job, Outcome, Progress, Text
from .limits import Admission, BodyLimit
from .metrics import RequestMetrics, ServeMetrics
from .responses import DONE, ChatFormat, CompletionFormat, comment, error_event, event, usage
from .schema import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    Sampling,
)

SEED_SPACE = 1 << 64  # the wire's seeds are uint64; OpenAI's are any int64
HEALTH_TIMEOUT_S = 2.0  # a health probe must answer even when the cloud does not
HEALTH_CACHE_S = 2.0  # probes within this long share one ping of the cloud
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def model_id(model_name: str) -> str:
    """The id clients name: the target's directory or file name, without the path to it."""
    name = Path(model_name.rstrip("/")).name
    return name.removesuffix(".gguf") or model_name


class CloudHealth:
    """Whether the cloud answers a ping, checked at most every HEALTH_CACHE_S."""

    def __init__(self, worker: EdgeWorker) -> None:
        self.worker = worker
        self._lock = asyncio.Lock()
        self._checked = float("-inf")
        self._status: dict = {}

    async def status(self) -> dict:
        """address, reachable, rtt_ms or error, and how old the answer is."""
        async with self._lock:
            if time.monotonic() - self._checked > HEALTH_CACHE_S:
                status: dict = {"address": self.worker.config.link.cloud}
                client = self.worker.lease()  # not one a generation counts its bytes on
                try:
                    rtt = await anyio.to_thread.run_sync(client.ping, HEALTH_TIMEOUT_S)
                    status.update(reachable=True, rtt_ms=round(rtt * 1e3, 2))
                except HybridSpecError as exc:
                    status.update(reachable=False, error=str(exc))
                finally:
                    self.worker.release(client)
                self._status, self._checked = status, time.monotonic()
            return {**self._status, "checked_s_ago": round(time.monotonic() - self._checked, 3)}


class Service:
    """The endpoints' shared state: the worker, the limits, the metrics."""

    def __init__(self, worker: EdgeWorker, options: ServeOptions) -> None:
        self.worker = worker
        self.options = options
        self.codec = worker.codec  # torch-free where the drafter's tokenizer allows: --cloud-only loads no drafter
        if worker.info is None and not options.served_model_name:  # allow_unverified, the cloud never answered
            raise Unavailable(f"the cloud at {worker.config.link.cloud} did not answer, so the target's name is unknown; "
                              "name the model with --served-model-name to serve before it answers")
        self.model = options.served_model_name or model_id(worker.info.model_name)
        self.fingerprint = f"hybridspec-{self.info.model_fingerprint[:12]}"
        self.started = time.time()
        self.metrics = ServeMetrics()
        self.admission = Admission(options.max_concurrent, options.max_queued)
        self.health = CloudHealth(worker)

    @property
    def info(self) -> ModelInfo:
        """The verifier's model info, or what the edge assumes while the cloud has never answered."""
        return self.worker.info or self.worker.local_info()

    # ---- requests to configs --------------------------------------------------------------------

    def check(self, body: Sampling) -> None:
        """404 for another model, 400 for a feature this server does not have."""
        if body.model != self.model:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves {self.model!r}",
                           param="model", code="model_not_found")
        field = body.unsupported()
        if field is not None:
            raise APIError(400, f"{field} is not supported by this server (one choice of plain text per request)",
                           param=field, code="unsupported_parameter")

    def request_config(self, body: Sampling, prompt_tokens: int, prompt_field: str) -> EdgeConfig:
        """The worker's config with this request's fields; the server's flags are the defaults."""
        limit = self.info.max_context  # 0 while the cloud has never answered: nothing to check against
        max_new = body.max_new_tokens
        default = self.worker.config.generation.max_new_tokens
        if limit:
            room = limit - prompt_tokens
            if room < 1:
                raise APIError(400, f"the prompt is {prompt_tokens} tokens; the model's context holds {limit}",
                               param=prompt_field, code="context_length_exceeded")
            if max_new is not None and max_new > room:
                raise APIError(400, f"the prompt ({prompt_tokens} tokens) plus max_tokens ({max_new}) exceeds the "
                                    f"model's context of {limit} tokens", param="max_tokens",
                               code="context_length_exceeded")
            default = min(default, room)
        # A seed asks for reproducible text (the coupled rule, EdgeConfig.resolved_mode). No seed in the
        # request nor from the server's flags: each generation draws its own, as unseeded OpenAI requests differ.
        seed = None if body.seed is None else body.seed % SEED_SPACE
        fields = {"max_new_tokens": max_new or default, "seed": seed,
                  "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
                  "frequency_penalty": body.frequency_penalty, "presence_penalty": body.presence_penalty,
                  "repetition_penalty": body.repetition_penalty, "stop": body.stop_strings or None}
        try:
            return self.worker.config.updated(**{k: v for k, v in fields.items() if v is not None})
        except (ValueError, HybridSpecError) as exc:
            raise api_error(exc, "configuring a generation") from None

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        """The conversation in the chat template."""
        try:
            return codec_messages(self.codec, body.conversation())
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages", code="invalid_value") from None

    def completion_prompt(self, body: CompletionRequest) -> list[int]:
        """The prompt's token ids: its text encoded, or the ids it gave."""
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            vocab = self.info.vocab_size
            if not all(0 <= t < vocab for t in prompt):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt", code="invalid_value")
            return list(prompt)
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise APIError(400, "prompt must be one prompt (a string, a list of one string, or token ids)",
                               param="prompt", code="unsupported_parameter")
            prompt = prompt[0]
        try:
            return codec_text(self.codec, prompt)
        except ValueError as exc:
            raise APIError(400, str(exc), param="prompt", code="invalid_value") from None

    # ---- running a generation -------------------------------------------------------------------

    async def complete(self, request: Request, body: Sampling, prompt: list[int], fmt: ChatFormat,
                       prompt_field: str) -> Response:
        """Run one generation and answer with its whole body or its event stream."""
        config = self.request_config(body, len(prompt), prompt_field)
        self.admission.admit()
        self.metrics.in_flight.inc()
        job = Job(self.worker, prompt, config, self.admission.limiter, self.metrics.running.inc)
        job.start(on_done=lambda done: self._finished(done, request.url.path))
        try:
            items, outcome = await self._until(job, request, stop_at_text=body.stream)
        except BaseException:  # cancelled (the server is stopping): nobody will read the rest
            job.cancel()
            raise
        if outcome is None and not items:
            raise APIError(499, "the client closed the request", code="client_closed_request")
        if outcome is not None and (outcome.error is not None or not body.stream):
            return self._whole(fmt, outcome, len(prompt))
        stream = self._events(job, fmt, items, outcome, len(prompt), body.include_usage)
        return StreamingResponse(stream, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def _finished(self, job: Job, endpoint: str) -> None:
        """A job's thread is done (or it never got one): free its slot, count what it did."""
        self.admission.release()
        self.metrics.in_flight.dec()
        outcome = job.outcome
        gen = outcome.generation if outcome is not None else None
        if outcome is None or outcome.cancelled:
            kind = "cancelled"
        elif outcome.error is not None or gen is None:
            kind = "error"
        else:
            kind = gen.finish_reason
        self.metrics.observe_generation(endpoint, kind, len(job.prompt_ids), gen.stats if gen else None, job.ttft_s,
                                        job.itl_s(gen.stats.new_tokens) if gen else None)

    async def _until(self, job: Job, request: Request,
                     stop_at_text: bool) -> tuple[list[Text | Progress], Outcome | None]:
        """The job's text (and, with stop_at_text, progress reports) until its Outcome, or with
        stop_at_text until its first text or report; cancels the job and returns no Outcome if the
        client disconnects first."""
        items: list[Text | Progress] = []
        outcome = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._on_disconnect, request, job, tg.cancel_scope)
            while not (stop_at_text and items):
                item = await job.next()
                if isinstance(item, Outcome):
                    outcome = item
                    break
                if isinstance(item, Text) or stop_at_text:
                    items.append(item)
            tg.cancel_scope.cancel()
        return items, outcome

    @staticmethod
    async def _on_disconnect(request: Request, job: Job, scope: anyio.CancelScope) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        job.cancel()
        scope.cancel()

    def _whole(self, fmt: ChatFormat, outcome: Outcome, prompt_tokens: int) -> Response:
        gen = outcome.generation
        if outcome.error is not None:
            error = api_error(outcome.error, "a generation")
            if gen is not None and error.status == 503:  # the cloud went away mid-generation
                error.extra["partial_text"] = gen.text
            raise error
        assert gen is not None
        return JSONResponse(fmt.whole(gen.text, gen.finish_reason, usage(prompt_tokens, gen)).model_dump())

    async def _events(self, job: Job, fmt: ChatFormat, items: list[Text | Progress], outcome: Outcome | None,
                      prompt_tokens: int, include_usage: bool) -> AsyncIterator[str]:
        try:
            opening = fmt.opening()
            if opening is not None:
                yield event(opening)
            for item in items:
                yield event(fmt.text(item.text)) if isinstance(item, Text) else comment(item)
            while outcome is None:
                item = await job.next()
                if isinstance(item, Text):
                    yield event(fmt.text(item.text))
                elif isinstance(item, Progress):
                    yield comment(item)
                else:
                    outcome = item
            gen = outcome.generation
            if outcome.error is not None:
                yield error_event(api_error(outcome.error, "a generation"))
            else:
                assert gen is not None  # only a job cancelled by its own (gone) reader has none
                yield event(fmt.closing(gen.finish_reason))
                if include_usage:
                    yield event(fmt.usage(usage(prompt_tokens, gen)))
            yield DONE
        finally:
            if outcome is None:  # the client went away mid-stream
                job.cancel()


def create_app(worker: EdgeWorker, options: ServeOptions | None = None, api_keys: CredentialStore | None = None,
               ) -> FastAPI:
    """The HTTP app in front of `worker` (built and connected; warm it up first, generation.warm_up).
    api_keys: every /v1/ request must carry one of its keys (None: open)."""
    options = options or ServeOptions()
    service = Service(worker, options)
    app = FastAPI(title="hybridspec edge", summary="OpenAI-compatible edge-cloud speculative decoding",
                  docs_url=None, redoc_url=None)
    app.state.service = service
    errors.install(app)

    @app.post(CHAT)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        service.check(body)
        prompt = await anyio.to_thread.run_sync(service.chat_prompt, body)
        return await service.complete(request, body, prompt, ChatFormat(service.model, service.fingerprint),
                                      "messages")

    @app.post(COMPLETIONS)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        service.check(body)
        prompt = await anyio.to_thread.run_sync(service.completion_prompt, body)
        return await service.complete(request, body, prompt, CompletionFormat(service.model, service.fingerprint),
                                      "prompt")

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=service.model, created=int(service.started))])

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> ModelCard:
        if model != service.model:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {service.model!r}",
                           param="model", code="model_not_found")
        return ModelCard(id=service.model, created=int(service.started))

    @app.get("/health")
    async def health() -> JSONResponse:
        """Liveness: 200 while the process serves HTTP; the body says whether generations can run."""
        return JSONResponse(await _health(service))

    @app.get("/health/ready")
    async def ready() -> JSONResponse:
        """Readiness: 503 while no generation could run (the cloud is unreachable and
        allow_unverified is off), so a load balancer sends requests elsewhere."""
        status = await _health(service)
        return JSONResponse(status, status_code=200 if status["ready"] else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(service.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    endpoints = {route.path for route in app.routes if hasattr(route, "path")}
    app.add_middleware(BodyLimit, max_bytes=options.max_body_bytes)
    if api_keys is not None:  # outside BodyLimit: an unknown caller's body is never read
        app.add_middleware(APIKeys, store=api_keys)
    app.add_middleware(RequestMetrics, metrics=service.metrics, endpoints=endpoints)
    return app


async def _health(service: Service) -> dict:
    cloud = await service.health.status()
    allow = service.worker.config.link.allow_unverified
    ready = cloud["reachable"] or allow
    return {"status": "ok" if cloud["reachable"] else "degraded" if allow else "unavailable", "ready": ready,
            "model": service.model, "cloud": cloud, "allow_unverified": allow,
            "generations": {"admitted": service.admission.admitted, "capacity": service.admission.capacity},
            "uptime_s": round(time.time() - service.started, 1)}
