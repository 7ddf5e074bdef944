"""Tool calling on ``/v1/chat/completions``: the request's tools and tool choice, the model's calls read back.

The tools go to the model through its chat template (transformers' ``apply_chat_template(..., tools=...)``), which
also renders earlier calls (an assistant message's ``tool_calls``) and their results (``tool`` messages); a template
that renders no tools is a 400, since the model would never learn of them.  The model writes each call as the
Hermes / Qwen2.5 templates teach it, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, and
:class:`ToolCallStream` turns that text, chunk by chunk, into OpenAI's ``tool_calls``.

``tool_choice``: ``none`` renders no tools and reads no calls; ``auto`` (the default with tools) lets the model choose;
``required`` and a named function are only kept by a grammar — the output constrained to the JSON of the allowed
calls (:func:`forced_call_schema`), as vLLM constrains them — which :func:`constrain_to_tool_calls` applies.
``parallel_tool_calls: false`` keeps the first call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from specdecode.config import GenerationConfig
from specdecode.constraints import Constraint
from specdecode.errors import SpecDecodeError

#: Tool definitions and calls carry what clients put in them (a ``strict`` flag, a title): kept, not refused.
_OPEN = ConfigDict(extra="allow", strict=True)
OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"


class FunctionDefinition(BaseModel):
    model_config = _OPEN
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments


class ToolDefinition(BaseModel):
    model_config = _OPEN
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = _OPEN
    name: Annotated[str, Field(min_length=1)]


class NamedToolChoice(BaseModel):
    """``{"type": "function", "function": {"name": ...}}``: the model must call this function."""

    model_config = _OPEN
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(BaseModel):
    model_config = _OPEN
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    """A call an earlier assistant message made (``messages[i].tool_calls``)."""

    model_config = _OPEN
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


def check_tool_choice(tools: list[ToolDefinition] | None, choice: ToolChoice | None) -> None:
    """Refuse a tool choice the tools cannot meet (a ValueError, which the request model reports as a 400)."""
    if choice in (None, "none", "auto"):
        return
    if not tools:
        raise ValueError("tool_choice other than 'none' or 'auto' needs tools")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in tools}:
        raise ValueError(f"tool_choice names function {choice.function.name!r}, which is not among the tools")


def template_tools(tools: list[ToolDefinition]) -> list[dict]:
    """The tools as chat templates read them (OpenAI's objects, unset fields left out)."""
    return [tool.model_dump(exclude_none=True) for tool in tools]


def template_message(message: dict) -> dict:
    """A chat message as templates read it: an earlier call's arguments as an object (the Qwen2.5 and Hermes templates
    write them with ``tojson``), as vLLM hands them over; arguments that are not JSON stay text."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    rendered = []
    for call in calls:
        function = dict(call["function"])
        with contextlib.suppress(json.JSONDecodeError):
            function["arguments"] = json.loads(function["arguments"])
        rendered.append({**call, "function": function})
    return {**message, "tool_calls": rendered}


def _openai_call(name: str, arguments: object) -> dict:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def _read_call(body: str) -> dict | None:
    """One ``<tool_call>`` block's JSON as an OpenAI call, or None when it is not a call."""
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    return _openai_call(call["name"], arguments)


class ToolCallStream:
    """A model's answer read into text and calls as it comes: :meth:`feed` returns what can go out now — text, once
    it cannot be the start of a call, and each call once its block is closed — and :meth:`finish` the rest.  A block
    that does not hold a call stays text, as written; without ``parallel``, calls after the first are dropped."""

    def __init__(self, parallel: bool = True) -> None:
        self.parallel = parallel
        self.pending = ""  # text held back: a call being written, or what may begin one
        self.calls = 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """(text to send, calls to send) after ``text``."""
        self.pending += text
        said, calls = [], []
        while True:
            start = self.pending.find(OPEN_TAG)
            if start < 0:
                keep = _partial_tag(self.pending)
                said.append(self.pending[: len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep :]
                break
            said.append(self.pending[:start])
            self.pending = self.pending[start:]
            end = self.pending.find(CLOSE_TAG)
            if end < 0:
                break
            block, self.pending = self.pending[: end + len(CLOSE_TAG)], self.pending[end + len(CLOSE_TAG) :]
            call = _read_call(block[len(OPEN_TAG) : -len(CLOSE_TAG)])
            if call is None:
                said.append(block)
            else:
                calls.append(call)
        return "".join(said), self._allowed(calls)

    def finish(self) -> tuple[str, list[dict]]:
        """What is held back at the end: an unclosed block that holds a call is a call, anything else text."""
        rest, self.pending = self.pending, ""
        if rest.startswith(OPEN_TAG) and (call := _read_call(rest[len(OPEN_TAG) :])) is not None:
            return "", self._allowed([call])
        return rest, []

    def _allowed(self, calls: list[dict]) -> list[dict]:
        if not self.parallel:
            calls = calls[: max(0, 1 - self.calls)]
        self.calls += len(calls)
        return calls


def _partial_tag(text: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``<tool_call>``."""
    for size in range(min(len(OPEN_TAG) - 1, len(text)), 0, -1):
        if OPEN_TAG.startswith(text[-size:]):
            return size
    return 0


def forced_call_schema(tools: list[ToolDefinition], choice: ToolChoice, parallel: bool) -> dict:
    """The JSON schema a ``required`` or named choice's output is held to, as vLLM holds it: for a named function,
    its arguments (an object of its ``parameters``); for ``required``, an array of calls (one at most without
    ``parallel``), each ``{"name": <one of the tools>, "parameters": <its arguments>}``."""

    def arguments(function: FunctionDefinition) -> dict:
        return function.parameters or {"type": "object"}

    if isinstance(choice, NamedToolChoice):
        named = next(t.function for t in tools if t.function.name == choice.function.name)
        return arguments(named)
    call = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": t.function.name}, "parameters": arguments(t.function)},
                "required": ["name", "parameters"],
            }
            for t in tools
        ]
    }
    return {"type": "array", "items": call, "minItems": 1, **({} if parallel else {"maxItems": 1})}


def forced_calls(text: str, choice: ToolChoice) -> list[dict]:
    """The calls of an output held to :func:`forced_call_schema`; none when it was cut short (the token limit)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return []
    if isinstance(choice, NamedToolChoice):
        return [_openai_call(choice.function.name, value)]
    calls = value if isinstance(value, list) else []
    if not all(isinstance(call, dict) and {"name", "parameters"} <= set(call) for call in calls):
        return []
    return [_openai_call(call["name"], call["parameters"]) for call in calls]


def constrain_to_tool_calls(config: GenerationConfig, schema: dict, choice: ToolChoice) -> GenerationConfig:
    """``config`` with its output held to ``schema`` by the structured-outputs grammar engine (a JSON-schema
    :class:`~specdecode.constraints.Constraint`), so that a ``required`` or named tool choice always gives calls that
    parse; speculation stays lossless under it as under any constraint.  A request that asks for another structured
    output too is refused: its output cannot be held to both."""
    if config.constraint is not None:
        wanted = "'required'" if choice == "required" else "naming a function"
        raise SpecDecodeError(
            f"tool_choice {wanted} holds the output to the calls' JSON: drop the other structured output"
        )
    return dataclasses.replace(config, constraint=Constraint.json_schema(schema))
