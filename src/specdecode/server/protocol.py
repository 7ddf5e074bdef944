"""Request bodies of the OpenAI-compatible endpoints and the response objects.

Following OpenAI and vLLM: ``max_tokens`` (or ``max_completion_tokens``), ``temperature``, ``top_p``,
``top_k``, ``min_p``, ``presence_penalty``, ``frequency_penalty``, ``repetition_penalty``, ``logit_bias``, ``seed``,
``stop``, ``stop_token_ids``, ``ignore_eos``, ``min_tokens``, ``skip_special_tokens``, ``include_stop_str_in_output``,
``n``, ``stream`` and ``stream_options`` (``include_usage``, ``continuous_usage_stats``), chat's ``tools``,
``tool_choice`` and ``parallel_tool_calls`` (:mod:`specdecode.server.tools`), plus our
``speculative`` object choosing the drafter and draft length per request, ``coupled`` (false: a seeded request is
verified by rejection sampling, not Gumbel-max coupling) and ``verifier`` (``exact``, the default, or a relaxed,
lossy one: ``fly``, ``typical``, ``judge``).  A field of the wrong type or a value out of range is a 400 with an
OpenAI-style error object, never a 500; so is a field we know but cannot honour for its value (``tools`` where
the chat template renders none or on completions, a ``tool_choice`` that forces a call, ``best_of`` > 1,
``suffix``), with the reason.  Structured output: OpenAI's ``response_format`` (``json_object``, ``json_schema``)
and vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``) or its older
``guided_json``, ``guided_regex``, ``guided_choice`` and ``guided_grammar``, one per request
(:meth:`_Common.constraint_fields`).  ``logprobs`` (and chat's ``top_logprobs``) are the target's, after bias and
penalties (:meth:`ResponseShape.logprobs`); completions' ``echo`` puts the prompt first, its tokens'
log-probabilities the target's raw ones.  A field we
do not know is ignored and named (:meth:`_Common.ignored_fields`), as vLLM does, unless the server runs with
``--strict-api``.
"""

from __future__ import annotations

import copy
import time
import uuid
from collections.abc import Callable
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema, field_validator, model_validator
from pydantic_core import PydanticCustomError

from specdecode.config import MAX_FIXED_DRAFT_LENGTH, MAX_TOP_LOGPROBS, DraftLength, parse_draft_length
from specdecode.errors import SpecDecodeError
from specdecode.sampling_params import REPETITION_PENALTY_RANGE
from specdecode.server.tools import (
    ToolCall,
    ToolChoice,
    ToolDefinition,
    check_tool_choice,
    template_message,
)
from specdecode.types import TokenLogprob
from specdecode.verify.registry import check_verifier

_STRICT = ConfigDict(extra="forbid", strict=True)
#: What clients send: fields we do not know are kept aside (``model_extra``), to be named and ignored.
_LENIENT = ConfigDict(extra="allow", strict=True)


def _whole_number(value: object) -> object:
    """JSON Schema counts 3.0 as an integer, as the API document promises; the strict models would refuse it."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


WHOLE = BeforeValidator(_whole_number)  # after a field's constraints, which the API document then shows as such
Count = Annotated[int, Field(ge=1), WHOLE]
#: Rules the server checks by hand, with its own messages ("prompt is blank", "stop strings must be non-empty"),
#: declared in the API document so that it describes what is accepted (``server/openapi.py``).
NonBlank = Annotated[str, Field(json_schema_extra={"minLength": 1, "pattern": r"\S"})]
NonEmpty = Annotated[str, Field(json_schema_extra={"minLength": 1})]
_SAYS_SOMETHING = {
    "type": "object",
    "required": ["content"],
    "properties": {
        "content": {
            "anyOf": [
                {"type": "string", "pattern": r"\S"},
                {"type": "array", "contains": {"type": "object", "properties": {"text": {"pattern": r"\S"}}}},
            ]
        }
    },
}

_DRAFT_LENGTH_SCHEMA = {
    "anyOf": [
        {"type": "integer", "minimum": 0, "maximum": MAX_FIXED_DRAFT_LENGTH},
        {"enum": ["auto", "heuristic"]},
        {"type": "null"},
    ]
}


class SpeculativeOptions(BaseModel):
    """``"speculative": {...}``: one of the drafters the server was started with (or ``"none"``) and how
    deep it drafts (as ``--num-draft-tokens``: an integer from 0 to 64, ``"auto"`` or ``"heuristic"``)."""

    model_config = _STRICT
    drafter: str | None = None
    num_draft_tokens: Annotated[DraftLength | None, WithJsonSchema(_DRAFT_LENGTH_SCHEMA)] = None

    @field_validator("num_draft_tokens", mode="plain")
    @classmethod
    def _draft_length(cls, value: object) -> DraftLength | None:
        if value is None:
            return None
        try:
            return parse_draft_length(_whole_number(value))  # type: ignore[arg-type]
        except SpecDecodeError as exc:  # the CLI's message, not pydantic's "Value error, ..."
            raise PydanticCustomError("draft_length", "{message}", {"message": str(exc)}) from None


class StreamOptions(BaseModel):
    model_config = _LENIENT
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk (with include_usage)


Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
TokenId = Annotated[int, Field(ge=0), WHOLE]  # below the vocabulary's size: written in by server/openapi.py
#: A ``logit_bias`` key: a token id as text (JSON object keys are strings).
BiasKey = Annotated[str, Field(pattern=r"^[0-9]+$")]
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]
TopCount = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS), WHOLE]  # log-probabilities' alternatives per token

#: The most choices one request may ask for (``n``), as OpenAI's API allows.
MAX_CHOICES = 128


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: OpenAI's named schema (``strict`` or not, the output is held to it)."""

    model_config = _LENIENT
    name: str
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextFormat(BaseModel):
    """``response_format: {"type": "text"}``: no constraint."""

    model_config = _STRICT
    type: Literal["text"]


class JsonObjectFormat(BaseModel):
    """``response_format: {"type": "json_object"}``: one JSON object, any keys."""

    model_config = _STRICT
    type: Literal["json_object"]


class JsonSchemaResponseFormat(BaseModel):
    """``response_format: {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``."""

    model_config = _STRICT
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaResponseFormat, Field(discriminator="type")]
Choices = Annotated[list[NonEmpty], Field(min_length=1)]
#: vLLM's fields before ``structured_outputs``, and the constraint each asks for.
_GUIDED = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: one of ``json`` (a schema), ``regex``, ``choice``, ``grammar`` (Lark or GBNF),
    ``json_object``."""

    model_config = _LENIENT
    json_: dict | str | None = Field(default=None, alias="json")
    regex: NonEmpty | None = None
    choice: Choices | None = None
    grammar: NonBlank | None = None
    json_object: bool | None = None


def _unless(asked: bool, why: str) -> None:
    """Refuse a field set to a value this server cannot honour (a 400 naming the field, and ``why``)."""
    if asked:
        raise ValueError(why)


class _Common(BaseModel):
    model_config = _LENIENT
    model: str | None = None
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1), WHOLE] | None = None  # -1 or 0: off (vLLM uses -1)
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: (
        Annotated[float, Field(ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])] | None
    ) = None
    logit_bias: dict[BiasKey, Bias] | None = None
    seed: Annotated[int, WHOLE] | None = None
    coupled: bool | None = None  # with a seed: Gumbel-max coupled (default) or rejection sampling (false)
    stop: NonEmpty | list[NonEmpty] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = None
    min_tokens: Annotated[int, Field(ge=0), WHOLE] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES), WHOLE] = 1  # choices, each its own seed stream (seed + index)
    best_of: Annotated[int, WHOLE, WithJsonSchema({"anyOf": [{"const": 1}, {"type": "null"}]})] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | str | None = None  # vLLM's names before structured_outputs
    guided_regex: NonEmpty | None = None
    guided_choice: Choices | None = None
    guided_grammar: NonBlank | None = None
    speculative: SpeculativeOptions | None = None
    verifier: str | None = None  # exact (default, lossless) or a relaxed, lossy one (verify/registry.py)

    @field_validator("verifier")
    @classmethod
    def _known_verifier(cls, name: str | None) -> str | None:
        try:
            return None if name is None else check_verifier(name)
        except SpecDecodeError as exc:  # as a ValueError, pydantic reports it as this field's 400
            raise ValueError(str(exc)) from exc

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, best_of: int | None) -> int | None:
        _unless(best_of not in (None, 1), "best_of is not supported by this server; n > 1 returns n choices, unranked")
        return best_of

    def constraint_fields(self) -> dict[str, dict]:
        """Each field of the request that asks for a structured output, by its path, with what it asks for as
        :func:`specdecode.constraints.parse_constraint` reads it (the server refuses more than one)."""
        found: dict[str, dict] = {}
        form = self.response_format
        if isinstance(form, JsonObjectFormat):
            found["response_format"] = {"json_object": True}
        elif isinstance(form, JsonSchemaResponseFormat):
            schema = form.json_schema.schema_
            found["response_format.json_schema"] = {"json_object": True} if schema is None else {"json_schema": schema}
        if self.structured_outputs is not None:
            given = self.structured_outputs
            dump = given.model_dump(by_alias=True, exclude_none=True, exclude=set(given.model_extra or {}))
            asked = {key: item for key, item in dump.items() if item is not False}  # json_object: false asks nothing
            if asked:
                found["structured_outputs"] = asked
        for name, kind in _GUIDED.items():
            if getattr(self, name) is not None:
                found[name] = {kind: getattr(self, name)}
        return found

    @property
    def logprobs_top(self) -> int | None:
        """None, or the log-probabilities asked for and how many alternatives each lists."""
        return None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage in every chunk: vLLM's ``continuous_usage_stats``, which it honours with ``include_usage`` only."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def ignored_fields(self) -> list[str]:
        """The fields of the request this server does not know, by their path (``stream_options.x``,
        ``messages.0.x``)."""
        names = list(self.model_extra or {})
        for name in ("stream_options", "structured_outputs"):
            part = getattr(self, name)
            if part is not None:
                names += [f"{name}.{extra}" for extra in part.model_extra or {}]
        return names


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


#: A message has content, unless it is an assistant's that made tool calls (:meth:`ChatMessage._says_something`).
_CONTENT_OR_CALLS = [
    {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
    {
        "required": ["role", "tool_calls"],
        "properties": {"role": {"const": "assistant"}, "tool_calls": {"type": "array", "minItems": 1}},
    },
]


class ChatMessage(BaseModel):
    """One message; its content a string or a list of text parts (``[{"type": "text", "text": ...}]``, as the
    OpenAI clients send it), which are joined with newlines as vLLM joins them.  Other parts (images) are a 400.
    ``developer`` (what OpenAI's clients now send for instructions) is given to the chat template as ``system``.
    An assistant message may carry the ``tool_calls`` it made instead of content, and a ``tool`` message answers
    one (``tool_call_id``)."""

    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra={"anyOf": _CONTENT_OR_CALLS})
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], Field(min_length=1)] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("content")
    @classmethod
    def _joined(cls, content: str | list[TextPart] | None) -> str | None:
        return content if not isinstance(content, list) else "\n".join(part.text for part in content)

    @model_validator(mode="after")
    def _says_something(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is missing (only an assistant message with tool_calls may leave it out)")
        return self

    def for_template(self) -> dict:
        """The message as chat templates read it."""
        fields = {"role", "content", "name", "tool_calls", "tool_call_id"}
        return template_message(self.model_dump(include=fields, exclude_none=True))


class ChatCompletionRequest(_Common):
    messages: Annotated[
        list[ChatMessage],
        Field(min_length=1, json_schema_extra={"contains": {"anyOf": [_SAYS_SOMETHING, _CONTENT_OR_CALLS[1]]}}),
    ]
    logprobs: bool | None = None
    top_logprobs: TopCount | None = None  # with logprobs (without, nothing is returned)
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _tool_choice_met(self) -> ChatCompletionRequest:
        check_tool_choice(self.tools, self.tool_choice)
        return self

    @property
    def offered_tools(self) -> list[ToolDefinition]:
        """The tools the model is told of: none with ``tool_choice: "none"``."""
        return [] if self.tool_choice == "none" else list(self.tools or [])

    @property
    def parallel(self) -> bool:
        return self.parallel_tool_calls is not False

    @property
    def forced_tool_choice(self) -> bool:
        """Whether the model must call a tool (``required`` or a named function), not merely may."""
        return bool(self.offered_tools) and self.tool_choice not in (None, "auto")

    @property
    def logprobs_top(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def ignored_fields(self) -> list[str]:
        extra = [f"messages.{i}.{name}" for i, m in enumerate(self.messages) for name in m.model_extra or {}]
        return super().ignored_fields() + extra


class CompletionRequest(_Common):
    tools: Annotated[list[dict], WithJsonSchema({"type": "array", "maxItems": 0})] | None = None
    tool_choice: Annotated[str | dict, WithJsonSchema({"enum": ["none"]})] | None = None
    prompt: NonBlank | Annotated[list[Annotated[int, Field(ge=0), WHOLE]], Field(min_length=1)]
    echo: bool = False  # the prompt before the completion (and its tokens' log-probabilities, with logprobs)
    logprobs: TopCount | None = None
    suffix: Annotated[str, WithJsonSchema({"const": ""})] | None = None

    @property
    def logprobs_top(self) -> int | None:
        return self.logprobs

    @field_validator("tools", "tool_choice")
    @classmethod
    def _no_tools(cls, asked: list[dict] | str | dict | None) -> list[dict] | str | dict | None:
        _unless(asked not in (None, [], "none"), "tool calling is on /v1/chat/completions only")
        return asked

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        _unless(bool(suffix), "a suffix (fill in the middle) is not supported by this server")
        return suffix


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def finish_reason(reason: str) -> str:
    """Ours ("eos", "stop", "length", "abort") → OpenAI's ("stop", "length", "abort")."""
    return "stop" if reason in {"eos", "stop"} else reason


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None, code=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class ResponseShape:
    """Builds one endpoint's response objects: ``chat`` for ``/v1/chat/completions``, else ``/v1/completions``.
    ``token_text``: a token id's text, as log-probabilities name tokens.  One shape per choice (:meth:`choice`): the
    choices of a request share its id and time and each counts its own text offsets."""

    def __init__(self, chat: bool, model: str, token_text: Callable[[int], str] = str) -> None:
        self.chat = chat
        self.model = model
        self.token_text = token_text
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self.index = 0
        self.text_offset = 0  # where the next token's text starts (completions' text_offset, as vLLM counts it)

    def choice(self, index: int) -> ResponseShape:
        """The shape of the request's choice ``index``."""
        shape = copy.copy(self)
        shape.index, shape.text_offset = index, 0
        return shape

    def logprobs(self, entries: list[TokenLogprob] | None, lead: int | None = None) -> dict | None:
        """OpenAI's log-probabilities object for these tokens (None when not asked for): chat's ``content`` list, or
        completions' parallel lists; there ``lead`` is a token before them that has none (an echoed prompt's first),
        its log-probability and alternatives null as OpenAI gives them."""
        if entries is None:
            return None
        if self.chat:
            return {"content": [dict(self._token(e.token, e.logprob), top_logprobs=self._top(e)) for e in entries]}
        tokens = [self.token_text(token) for token in ([] if lead is None else [lead])]
        tokens += [self.token_text(e.token) for e in entries]
        offsets = []
        for token in tokens:
            offsets.append(self.text_offset)
            self.text_offset += len(token)
        none: list[None] = [] if lead is None else [None]
        tops = [{self.token_text(t): lp for t, lp in ((e.token, e.logprob), *e.top)} for e in entries]
        return {
            "tokens": tokens,
            "token_logprobs": none + [e.logprob for e in entries],
            "top_logprobs": none + tops,
            "text_offset": offsets,
        }

    def _token(self, token: int, logprob: float) -> dict:
        text = self.token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _top(self, entry: TokenLogprob) -> list[dict]:
        return [self._token(token, logprob) for token, logprob in entry.top]

    def _envelope(self, object_name: str, choices: list) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model, "choices": choices}

    def complete_choice(
        self,
        text: str | None,
        reason: str,
        logprobs: list[TokenLogprob] | None = None,
        lead: int | None = None,
        tool_calls: list[dict] | None = None,
    ) -> dict:
        """This choice of a non-streamed response (``lead``: see :meth:`logprobs`; ``tool_calls``: the calls the
        model made, each with its ``index``, which the message leaves out)."""
        shaped = self.logprobs(logprobs, lead)
        if self.chat:
            message: dict = {"role": "assistant", "content": text}
            if tool_calls:
                message["tool_calls"] = [{k: v for k, v in call.items() if k != "index"} for call in tool_calls]
            return {"index": self.index, "message": message, "logprobs": shaped, "finish_reason": reason}
        return {"index": self.index, "text": text, "logprobs": shaped, "finish_reason": reason}

    def complete(self, choices: list[dict], prompt_tokens: int, completion_tokens: int, extra: dict) -> dict:
        """The non-streamed response: its choices, and usage (the prompt counted once, as OpenAI counts it)."""
        body = self._envelope("chat.completion" if self.chat else "text_completion", choices)
        body["usage"] = usage(prompt_tokens, completion_tokens)
        body.update(extra)
        return body

    def chunk(
        self,
        text: str | None,
        reason: str | None = None,
        first: bool = False,
        logprobs: list[TokenLogprob] | None = None,
        lead: int | None = None,
        tool_calls: list[dict] | None = None,
    ) -> dict:
        shaped = self.logprobs(logprobs, lead)
        if self.chat:
            delta: dict = {"role": "assistant"} if first else {}
            if text:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice = {"index": self.index, "delta": delta, "finish_reason": reason}
            if shaped is not None:
                choice["logprobs"] = shaped
            return self._envelope("chat.completion.chunk", [choice])
        return self._envelope(
            "text_completion", [{"index": self.index, "text": text or "", "logprobs": shaped, "finish_reason": reason}]
        )

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, extra: dict) -> dict:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = usage(prompt_tokens, completion_tokens)
        body.update(extra)
        return body
