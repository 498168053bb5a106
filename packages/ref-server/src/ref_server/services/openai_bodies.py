"""The OpenAI API's request bodies, as pydantic models: the fields we serve, their ranges and
defaults, and the fields we refuse rather than ignore (they would change the result)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    FailFast,
    Field,
    TypeAdapter,
    ValidationError,
    model_validator,
)

from ref_server.services.messages import DEFAULT_MAX_TOKENS, DEFAULT_TEMPERATURE, BadRequest

# A prompt list's validator by the type of its first item: a union of the three would try each
# and collect an error per item of the others (a third of a second for 200,000 items).
PROMPT_LISTS = {
    first: TypeAdapter(Annotated[list[item], FailFast()])
    for first, item in ((str, str), (int, int), (list, list[int]))
}
PROMPT_SHAPES = (
    "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists"
)


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
    temperature: float = Field(default=DEFAULT_TEMPERATURE, ge=0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int = Field(default=0, ge=-1, lt=2**31)  # -1 or 0: all (vLLM's -1 too); int32
    n: int = Field(default=1, ge=1)  # prompts x n: max_choices
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = []
    seed: int | None = None  # any integer, as OpenAI's: taken modulo 2**63
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
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionBody(_Body):
    # any list here: its length is checked (max_prompts) before its items (`prompts`), whose
    # validation would cost seconds for a list of 200,000
    prompt: str | list
    max_tokens: int | None = Field(default=DEFAULT_MAX_TOKENS, ge=1)
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

    def prompts(self, max_prompts: int) -> list[str] | list[list[int]]:
        """The prompts (a string or a list of token ids is one), or BadRequest."""
        prompt = self.prompt
        if isinstance(prompt, str) or not prompt:
            return [prompt]
        first = type(prompt[0])
        if first not in PROMPT_LISTS:
            raise BadRequest(PROMPT_SHAPES, "prompt")
        if first is not int and len(prompt) > max_prompts:
            message = f"{len(prompt)} prompts, over the limit of {max_prompts} (max_prompts)"
            raise BadRequest(message, "prompt")
        try:
            prompt = PROMPT_LISTS[first].validate_python(prompt)
        except ValidationError:
            raise BadRequest(PROMPT_SHAPES, "prompt") from None
        return [prompt] if first is int else prompt


class Message(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]  # developer: OpenAI's new system
    content: str | list[dict] | None = None  # null: an assistant turn that only called tools

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(part.get("type") != "text" for part in self.content):
            raise BadRequest("only text content parts are supported", "messages")
        return "".join(str(part.get("text", "")) for part in self.content)


class ChatBody(_Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    tools: list | None = None
    tool_choice: str | dict | None = None
    functions: list | None = None
    function_call: str | dict | None = None
    response_format: dict | None = None

    def unsupported(self) -> str | None:
        if self.logprobs:
            return "logprobs is not supported"
        if self.tools or self.functions:
            return "tools and functions are not supported"
        if self.tool_choice not in (None, "none") or self.function_call not in (None, "none"):
            return 'tool_choice and function_call are not supported (only "none")'
        if (self.response_format or {}).get("type", "text") != "text":
            return 'response_format is not supported (only {"type": "text"})'
        return super().unsupported()
