"""The OpenAI request bodies the server accepts, and what each option becomes.

Every option is either honoured exactly or refused with a 400 that names it: an option the engine cannot honour
(``n > 1``, presence and frequency penalties, ``logit_bias``, tools ...) is accepted only at the value that means
"off", and an unknown field is refused, never silently dropped. Beyond OpenAI's names, vLLM's request
extensions with a meaning here are honoured as vLLM honours them: ``top_k``, ``min_p``, ``repetition_penalty``
(transformers' meanings), ``presence_penalty``, ``frequency_penalty`` and ``logit_bias`` (OpenAI's meanings),
``ignore_eos``, ``min_tokens``, ``stop_token_ids``, ``include_stop_str_in_output``,
``skip_special_tokens``, ``stream_options.continuous_usage_stats`` and ``echo`` on completions; ``model`` may be
omitted (the served model). OpenAI's ``prediction`` (Predicted Outputs) is drafted, never changing a token. Log-probabilities (``logprobs``/``top_logprobs`` on chat, ``logprobs`` on completions) are
those of plain decoding, exactly (see :mod:`draftwise.decoding.logprobs`); with ``echo`` on completions, the
prompt's too.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..decoding.logprobs import MAX_TOP_LOGPROBS
from ..decoding.sampling import SamplingParams
from ..errors import InvalidRequestError, UnsupportedOptionError

#: Options accepted only at their "off" value: name -> the values that mean off.
OFF_ONLY: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "response_format": (None, {"type": "text"}),
}
#: Why each of :data:`OFF_ONLY` is refused beyond its "off" value.
REFUSAL_REASONS: dict[str, str] = {
    "n": "one answer per request: send n requests (they share the running batch, each with exactly its own tokens)",
    "best_of": "one answer per request; none is ranked by likelihood",
    "echo": "echo applies to text completions",
    "suffix": "inserting text before a suffix needs the model's fill-in-the-middle format, which is not built here",
    "tools": "tool calls need the model's tool-call format and constrained output, neither of which is done here",
    "tool_choice": "tool calls need the model's tool-call format and constrained output, neither of which is done here",
    "functions": "function calls need the model's call format and constrained output, neither of which is done here",
    "response_format": "structured output needs constrained decoding, which is not done here",
}

#: OpenAI's default temperature (1.0: sampling); send 0 for greedy decoding.
DEFAULT_TEMPERATURE = 1.0


class StreamOptions(BaseModel):
    """``include_usage``: a last chunk with the usage; with ``continuous_usage_stats`` too, every chunk carries the
    usage so far (vLLM's extension)."""

    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class Prediction(BaseModel):
    """OpenAI's Predicted Outputs: the text the answer is expected to be (``{"type": "content", "content": ...}``),
    drafted wherever the answer follows it; the answer is plain decoding's whatever it says."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["content"]
    content: str | list[ContentPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class _Request(BaseModel):
    """Fields common to both endpoints."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None  # None: the served model (vLLM's rule)
    max_tokens: int | None = None
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None  # token id (as a string, OpenAI's form) -> bias in [-100, 100]
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id: nothing to honour
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)  # vLLM's: tokens before an EOS, a stop token or a stop string may end it
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prediction: Prediction | None = None  # OpenAI's Predicted Outputs
    # Accepted only at their "off" values (see OFF_ONLY).
    n: int | None = None
    best_of: int | None = None
    echo: bool | None = None

    def refuse_unsupported(self) -> None:
        """Refuse every option set to a value the engine cannot honour."""
        for name, off in self._off_only().items():
            value = getattr(self, name, None)
            if value not in off:
                raise UnsupportedOptionError(
                    f"'{name}' = {value!r} is not supported by this server: {REFUSAL_REASONS[name]} (allowed: "
                    f"{', '.join(map(repr, off))})"
                )
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed with stream: true")

    def logprobs_asked(self) -> int | None:
        """Alternatives per token to return with each token's log-probability (``None``: no log-probabilities)."""
        return None

    def _off_only(self) -> dict[str, tuple[Any, ...]]:
        return OFF_ONLY

    def sampling(self) -> SamplingParams:
        """The sampling options (OpenAI's default temperature is 1.0; 0 means greedy)."""
        values: dict[str, Any] = {
            "temperature": DEFAULT_TEMPERATURE if self.temperature is None else self.temperature,
            "seed": self.seed,
        }
        if self.top_p is not None:
            values["top_p"] = self.top_p
        if self.top_k is not None:
            values["top_k"] = max(self.top_k, 0)  # vLLM's -1 means "off", as 0 does here
        if self.min_p is not None:
            values["min_p"] = self.min_p
        if self.repetition_penalty is not None:
            values["repetition_penalty"] = self.repetition_penalty
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) is not None:
                values[name] = getattr(self, name)
        if self.logit_bias:
            values["logit_bias"] = self.logit_bias
        try:
            return SamplingParams(**values)
        except (TypeError, ValueError) as error:
            raise InvalidRequestError(str(error)) from None

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return [text for text in stops if text]


class CompletionRequest(_Request):
    """``POST /v1/completions``: ``prompt`` is a string or a list of token ids."""

    prompt: str | list[int]
    suffix: str | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    def logprobs_asked(self) -> int | None:
        return self.logprobs

    def prompt_logprobs_asked(self) -> bool:
        """``echo`` with ``logprobs``: the prompt's tokens come with their log-probabilities too."""
        return bool(self.echo) and self.logprobs is not None

    def _off_only(self) -> dict[str, tuple[Any, ...]]:
        # ``echo`` is honoured for completions (the prompt's text before the answer), not for chat.
        return {name: off for name, off in OFF_ONLY.items() if name != "echo"}

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, prompt: str | list[int]) -> str | list[int]:
        if (isinstance(prompt, str) and not prompt.strip()) or (isinstance(prompt, list) and not prompt):
            raise ValueError("the prompt is empty")
        return prompt


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[ContentPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``: ``messages`` go through the model's chat template."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        if not messages:
            raise ValueError("messages is empty")
        if not any(message.text().strip() for message in messages):
            raise ValueError("every message is empty")
        return messages

    def logprobs_asked(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None

    def chat(self) -> list[dict[str, str]]:
        return [{"role": message.role, "content": message.text()} for message in self.messages]


def max_new_tokens(request: _Request, default: int, room: int) -> int:
    """The request's token limit (``max_completion_tokens`` or ``max_tokens``), else ``default`` cut to the room
    left in the context window."""
    asked = getattr(request, "max_completion_tokens", None)
    asked = asked if asked is not None else request.max_tokens
    if asked is None:
        if room <= 0:
            raise InvalidRequestError("the prompt fills the model's context window: no room for any new token")
        return min(default, room)
    if asked <= 0:
        raise InvalidRequestError(f"max_tokens must be a positive integer, got {asked}")
    return asked


#: Our finish reasons as OpenAI names them.
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
