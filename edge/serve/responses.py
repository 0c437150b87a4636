"""The two endpoints' bodies, whole and as server-sent events: chat completions and text completions
differ only in how a choice carries its text."""
from __future__ import annotations

import json
import secrets
import time

from ..generation import Generation
from .errors import APIError
from .schema import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChoice,
    Delta,
    SpeculativeUsage,
    Usage,
)

DONE = "data: [DONE]\n\n"


def usage(prompt_tokens: int, generation: Generation) -> Usage:
    """Token counts, and how the edge and the cloud made the tokens."""
    s = generation.stats
    completion = len(generation.token_ids)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion, total_tokens=prompt_tokens + completion,
                 speculative=SpeculativeUsage(
                     accepted_tokens=s.accepted, drafted_tokens=s.drafted, rounds=s.rounds,
                     acceptance_rate=round(s.acceptance_rate, 4), cloud_only_tokens=s.cloud_only_tokens,
                     unverified_tokens=s.unverified, uplink_bytes=s.uplink_bytes, downlink_bytes=s.downlink_bytes))


def event(body) -> str:
    """One server-sent event carrying a pydantic body or an error body."""
    data = body.model_dump_json() if hasattr(body, "model_dump_json") else json.dumps(body, ensure_ascii=False)
    return f"data: {data}\n\n"


def comment(progress) -> str:
    """An SSE comment saying how far the cloud got with a long prompt (`generation.Progress`): clients
    skip comments, and the bytes keep proxies from timing the stream out."""
    return f": prefill {progress.cached}/{progress.total} tokens\n\n"


def error_event(error: APIError) -> str:
    """The event that ends a stream whose generation failed (OpenAI's clients raise it)."""
    return event(error.body())


class ChatFormat:
    """`chat.completion` bodies and `chat.completion.chunk` events."""

    prefix = "chatcmpl"

    def __init__(self, model: str, fingerprint: str) -> None:
        self.id = f"{self.prefix}-{secrets.token_hex(12)}"
        self.created = int(time.time())
        self.model = model
        self.fingerprint = fingerprint

    def whole(self, text: str, finish_reason: str, use: Usage) -> ChatCompletion:
        """The non-streamed response."""
        return ChatCompletion(id=self.id, created=self.created, model=self.model, system_fingerprint=self.fingerprint,
                              choices=[ChatChoice(message=AssistantMessage(content=text), finish_reason=finish_reason)],
                              usage=use)

    def opening(self) -> ChatCompletionChunk | None:
        """The chunk a stream starts with (the assistant's role), if any."""
        return self._chunk(Delta(role="assistant", content=""))

    def text(self, text: str) -> ChatCompletionChunk:
        """A chunk carrying newly final text."""
        return self._chunk(Delta(content=text))

    def closing(self, finish_reason: str) -> ChatCompletionChunk:
        """The chunk that says why the generation ended."""
        return self._chunk(Delta(), finish_reason)

    def usage(self, use: Usage) -> ChatCompletionChunk:
        """The last chunk when the client asked for `stream_options.include_usage`."""
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                   system_fingerprint=self.fingerprint, choices=[], usage=use)

    def _chunk(self, delta: Delta, finish_reason: str | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                   system_fingerprint=self.fingerprint,
                                   choices=[ChatChunkChoice(delta=delta, finish_reason=finish_reason)])


class CompletionFormat(ChatFormat):
    """`text_completion` bodies; a streamed one is a series of the same objects."""

    prefix = "cmpl"

    def whole(self, text: str, finish_reason: str, use: Usage) -> Completion:
        return self._completion(text, finish_reason, use)

    def opening(self) -> None:
        return None

    def text(self, text: str) -> Completion:
        return self._completion(text, None, None)

    def closing(self, finish_reason: str) -> Completion:
        return self._completion("", finish_reason, None)

    def usage(self, use: Usage) -> Completion:
        return Completion(id=self.id, created=self.created, model=self.model, system_fingerprint=self.fingerprint,
                          choices=[], usage=use)

    def _completion(self, text: str, finish_reason: str | None, use: Usage | None) -> Completion:
        return Completion(id=self.id, created=self.created, model=self.model, system_fingerprint=self.fingerprint,
                          choices=[CompletionChoice(text=text, finish_reason=finish_reason)], usage=use)

