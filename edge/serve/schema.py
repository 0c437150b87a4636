"""Request and response bodies of the OpenAI-compatible endpoints.

Requests accept the OpenAI fields this server can honour, plus `top_k` and `repetition_penalty` as
extensions, and ignore unknown fields as OpenAI does. Fields the server cannot honour (`n` > 1,
log probabilities, tools, ...) are declared only so that `unsupported()` can name them: a client
that sets one gets a 400, never a silently different answer.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from .errors import APIError

INT64 = 1 << 63

Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class StreamOptions(BaseModel):
    """What a streamed response adds."""

    include_usage: bool = False  # a last chunk with `usage` and no choices


class Sampling(BaseModel):
    """The fields both endpoints share: they map onto EdgeConfig (app.py `request_config`)."""

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None  # extension; 0 = off
    seed: Annotated[int, Field(ge=-INT64, lt=INT64)] | None = None
    stop: str | list[str] | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None  # extension; 1 = off
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored
    n: Annotated[int, Field(ge=1)] = 1
    logit_bias: dict[str, float] | None = None
    logprobs: Any = None
    top_logprobs: Any = None

    def unsupported(self) -> str | None:
        """The first field set to something this server cannot do, or None."""
        return next((name for name, used in self._features().items() if used), None)

    def _features(self) -> dict[str, bool]:
        """Per field this server cannot honour: whether this request asks for it."""
        return {"n": self.n != 1, "logprobs": self.logprobs not in (None, False, 0),
                "top_logprobs": self.top_logprobs is not None, "logit_bias": bool(self.logit_bias)}

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """`stop` as a tuple (a lone string is one stop string)."""
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage


class TextPart(BaseModel):
    """One part of a message's content; only text parts can be served."""

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """One message of a conversation."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None
    name: str | None = None  # accepted and ignored, as most chat templates have no place for it


class ChatCompletionRequest(Sampling):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None

    @property
    def max_new_tokens(self) -> int | None:
        """`max_completion_tokens`, or the older `max_tokens`."""
        return self.max_completion_tokens or self.max_tokens

    def conversation(self) -> list[dict[str, str]]:
        """The messages as the chat template takes them: text content only, `developer` as `system`
        (templates know no other), no tool messages. APIError names the first message it cannot use."""
        out = []
        for i, message in enumerate(self.messages):
            if message.role in ("tool", "function"):
                raise APIError(400, f"messages[{i}] has role {message.role!r}: tool calls are not supported",
                               param=f"messages[{i}].role", code="unsupported_parameter")
            if isinstance(message.content, list):
                if any(part.type != "text" or part.text is None for part in message.content):
                    raise APIError(400, f"messages[{i}].content: only text parts are supported",
                                   param=f"messages[{i}].content", code="invalid_value")
                content = "".join(part.text or "" for part in message.content)
            elif message.content is None:
                raise APIError(400, f"messages[{i}].content is missing", param=f"messages[{i}].content",
                               code="invalid_value")
            else:
                content = message.content
            out.append({"role": "system" if message.role == "developer" else message.role, "content": content})
        return out

    def _features(self) -> dict[str, bool]:
        return {**super()._features(), "tools": bool(self.tools), "functions": bool(self.functions),
                "function_call": self.function_call not in (None, "none"),
                "tool_choice": self.tool_choice not in (None, "none", "auto"),
                "response_format": self.response_format not in (None, {"type": "text"}),
                "modalities": self.modalities not in (None, ["text"]), "audio": self.audio is not None,
                "prediction": self.prediction is not None}


class CompletionRequest(Sampling):
    """POST /v1/completions: one prompt, as text or token ids."""

    prompt: str | list[str] | list[int]
    best_of: Annotated[int, Field(ge=1)] = 1
    echo: bool = False
    suffix: str | None = None

    @property
    def max_new_tokens(self) -> int | None:
        """`max_tokens`."""
        return self.max_tokens

    def _features(self) -> dict[str, bool]:
        return {**super()._features(), "best_of": self.best_of != 1, "echo": self.echo, "suffix": bool(self.suffix)}


# ---- responses ------------------------------------------------------------------------------------

FinishReason = Literal["stop", "length"]


class SpeculativeUsage(BaseModel):
    """How the tokens were made: the edge's drafting and the cloud's verification."""

    accepted_tokens: int  # drafted on the edge and accepted by the verifier
    drafted_tokens: int
    rounds: int  # verify round trips
    acceptance_rate: float  # accepted / drafted
    cloud_only_tokens: int  # decoded by the cloud alone
    unverified_tokens: int  # drafted while the cloud was unreachable and never verified (allow_unverified)
    uplink_bytes: int
    downlink_bytes: int


class Usage(BaseModel):
    """Token counts, as OpenAI reports them, plus `speculative`."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    speculative: SpeculativeUsage


class AssistantMessage(BaseModel):
    """The reply of a chat completion."""

    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    """The one choice of a chat completion."""

    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: None = None


class ChatCompletion(BaseModel):
    """The body of a non-streamed chat completion."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    """What one chunk adds to the reply."""

    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    """The one choice of a streamed chat chunk."""

    index: int = 0
    delta: Delta
    finish_reason: FinishReason | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    """One `data:` event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    """The one choice of a (streamed or not) text completion."""

    index: int = 0
    text: str
    finish_reason: FinishReason | None = None
    logprobs: None = None


class Completion(BaseModel):
    """The body of a text completion, and of each chunk of a streamed one."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    """The one model this server serves."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "hybridspec"


class ModelList(BaseModel):
    """GET /v1/models."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
