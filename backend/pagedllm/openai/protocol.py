"""OpenAI request bodies as pydantic models, and errors in OpenAI's format.

The models are strict (a number sent as "0.5", or 1 for a boolean, is refused) and forbid unknown keys: a field
this server cannot honour gets a 400 that names it, never a silent default. Fields are never unions other than
with None, so a validation error's location is the field's own path (`messages[0].role`), which becomes the
error's `param`. Ranges are left to the model: its messages name the field, and the bridge maps them back.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class OpenAIError(Exception):
    """An error answered with `status` and OpenAI's body: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    @property
    def type(self) -> str:
        # OpenAI's own types: 4xx are the caller's (model_not_found included), 5xx the server's.
        return "invalid_request_error" if self.status < 500 else "server_error"

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param)


class FieldError(ValueError):
    """Raised by a model validator about a field other than the one it validates (pydantic would locate it at
    the body): carries the field's name for the error's `param`."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    name: str
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None  # the output always follows the schema here, strict or not


class ResponseFormat(_Strict):
    """OpenAI's response_format: text, any JSON object, or a JSON schema (structured output)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise FieldError("response_format.json_schema", "is required with type json_schema, and only then")
        return self


class RequestBase(_Strict):
    """What both endpoints take: OpenAI's sampling fields, plus the vLLM extras our engine supports."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] | None = None  # a single string is accepted too (see _one_or_many)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # metadata only
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool | None = None
    truncate_prompt_tokens: int | None = None
    stream_interval: int | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _one_or_many(cls, v):
        return [v] if isinstance(v, str) else v

    @model_validator(mode="after")
    def _options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "only allowed when stream is true")
        return self


class CompletionRequest(RequestBase):
    prompt: list[str]  # one string; a list of exactly one string is accepted too
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v):
        v = [v] if isinstance(v, str) else v
        if isinstance(v, list) and len(v) != 1:
            raise ValueError("exactly one prompt (a string) is supported")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v):
        if v:
            raise ValueError("true is not supported")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        if v is not None:
            raise ValueError("is not supported")
        return v


class ChatCompletionRequest(RequestBase):
    # Each message is passed to the model as given: its chat template code checks roles and contents and
    # names the offending message (`messages[2].content: ...`), so the rules live in one place.
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "only allowed when logprobs is true")
        return self


def parse(model: type[BaseModel], raw: bytes):
    """The request body, whatever its Content-Type says (`curl -d` sends a form type), validated as JSON."""
    try:
        return model.model_validate_json(raw or b"")
    except ValidationError as e:
        raise validation_error(e.errors()) from None


def validation_error(errors: list[dict]) -> OpenAIError:
    """Validation errors (bad JSON, a wrong type, an unknown key, a refused value; locations from the body's
    root) as a 400 that names the field, from the first error."""
    e = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    if e.get("type") == "json_invalid":
        return invalid(f"request body is not valid JSON: {e.get('ctx', {}).get('error', e['msg'])}")
    ctx_error = e.get("ctx", {}).get("error")
    if isinstance(ctx_error, FieldError):
        return invalid(str(ctx_error), ctx_error.param)
    param = _path(e["loc"]) or None
    if e.get("type") == "extra_forbidden":
        return invalid(f"{param}: unknown field, or not supported by this server", param)
    msg = e["msg"].removeprefix("Value error, ")
    if param is None:
        return invalid(f"request body: {msg}" + (" (expected a JSON object)" if "dictionary" in msg else ""))
    return invalid(f"{param}: {msg}", param)


def _path(loc) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out
