"""The OpenAI API's request bodies, as pydantic models: the fields we serve, their ranges and
defaults, and the fields we refuse rather than ignore (they would change the result)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ref_server.services.messages import BadRequest

MAX_STOPS, MAX_N = 16, 16


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data):
        """OpenAI's fields are nullable, and clients send null for "not given": the default."""
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int = Field(default=0, ge=-1, lt=2**31)  # -1 or 0: all (vLLM's -1 too); int32
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = []
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stream: bool = False
    stream_options: dict | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None

    def unsupported(self) -> str | None:
        if self.presence_penalty or self.frequency_penalty:
            return "presence_penalty and frequency_penalty are not supported"
        if self.logit_bias:
            return "logit_bias is not supported"
        return None

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOPS:
            raise BadRequest(f"at most {MAX_STOPS} stop strings, got {len(stops)}")
        return stops


class CompletionBody(_Body):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> str | None:
        if self.logprobs is not None:
            return "logprobs is not supported"
        if (self.best_of or 1) > 1 or self.suffix:
            return "best_of and suffix are not supported"
        return super().unsupported()


class Message(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]  # developer: OpenAI's new system
    content: str | list[dict]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        if any(part.get("type") != "text" for part in self.content):
            raise BadRequest("only text content parts are supported")
        return "".join(str(part.get("text", "")) for part in self.content)


class ChatBody(_Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    tools: list | None = None

    def unsupported(self) -> str | None:
        if self.logprobs:
            return "logprobs is not supported"
        if self.tools:
            return "tools are not supported"
        return super().unsupported()
