"""``/openapi.json`` as the server behaves, so that clients generated from it and fuzzers read the truth.

FastAPI's document left alone would promise what the server does not do: a 422 for a bad body (the server
answers 400 with an OpenAI-style error object), any string as a prompt (a blank one is refused), any token id
(ids must be in the vocabulary), any drafter or verifier name (only those the server runs).  The constraints that
depend on the loaded model and the drafters served are written in when the document is built; those that the
request models check by hand (to keep their error messages) are declared on the fields (``protocol.py``).
"""

from __future__ import annotations

import itertools
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

#: What each error status means, for the operations that take a request body.
ERROR_STATUSES = {
    400: "The request is malformed or a value is out of range (the message names the field).",
    401: "The server was started with an API key and the request did not carry it (`Authorization: Bearer`).",
    404: "The request names a model this server does not serve.",
    429: "The queue of waiting requests is full; retry after the `Retry-After` seconds.",
    500: "The engine failed while decoding this request.",
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """Every 4xx and 5xx answer: ``{"error": {"message", "type", "param", "code"}}``, as OpenAI's API."""

    error: ErrorDetail


def reset_responses() -> dict[int | str, dict[str, Any]]:
    """The error answers of ``POST /reset_prefix_cache``."""
    busy = "Requests are in the engine: reset the prefix cache when the server is idle."
    return {
        401: {"model": ErrorResponse, "description": ERROR_STATUSES[401]},
        409: {"model": ErrorResponse, "description": busy},
    }


def completion_responses() -> dict[int | str, dict[str, Any]]:
    """The ``responses=`` of a completion route: a JSON object, or with ``"stream": true`` server-sent events; and the
    error statuses."""
    event = {"type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}
    said = "The completion, or with `stream` its chunks as server-sent events."
    ignored = {
        "description": "The request's fields this server does not know and ignored, comma-separated (not with "
        "`--strict-api`, which refuses them)",
        "schema": {"type": "string"},
    }
    answer = {
        200: {
            "description": said,
            "content": {"text/event-stream": {"schema": event}},
            "headers": {"X-Ignored-Fields": ignored},
        }
    }
    errors = {status: {"model": ErrorResponse, "description": text} for status, text in ERROR_STATUSES.items()}
    return answer | errors


def below(limit: int) -> str:
    """A pattern matching exactly the decimal integers from 0 to ``limit`` - 1 (leading zeros allowed): a token id
    written as a JSON object's key, as ``logit_bias`` has them."""
    top = str(limit - 1)
    shorter = f"[0-9]{{1,{len(top) - 1}}}" if len(top) > 1 else None
    same_length = [top]
    for at, digit in enumerate(top):
        lowest = "1" if at == 0 and len(top) > 1 else "0"
        if digit > lowest:
            rest = f"[0-9]{{{len(top) - at - 1}}}" if at < len(top) - 1 else ""
            same_length.append(f"{top[:at]}[{lowest}-{chr(ord(digit) - 1)}]{rest}")
    choices = [*([shorter] if shorter else []), *same_length]
    return f"^0*({'|'.join(choices)})$"


def _given(field: str, value: dict | None = None) -> dict:
    """An object whose ``field`` is there and not null (and matches ``value``, if given)."""
    return {"required": [field], "properties": {field: value or {"not": {"type": "null"}}}}


def _two_of(asks: dict[str, dict]) -> dict:
    """Any two of ``asks`` at once (what a request may not do)."""
    return {"anyOf": [{"allOf": [asks[a], asks[b]]} for a, b in itertools.combinations(asks, 2)]}


#: vLLM's ``structured_outputs`` keys in the document (``json_object`` asks only when true; ``grammar`` is left out).
_CONSTRAINT_KINDS = ("json", "regex", "choice", "json_object")
#: The fields that ask for a structured output: a request may use one (``_Common.constraint_fields``).
_STRUCTURED_OUTPUTS = {
    "response_format": _given("response_format", {"properties": {"type": {"enum": ["json_object", "json_schema"]}}}),
    "structured_outputs": _given(
        "structured_outputs",
        {"anyOf": [_given(key, {"const": True} if key == "json_object" else None) for key in _CONSTRAINT_KINDS]},
    ),
    **{field: _given(field) for field in ("guided_json", "guided_regex", "guided_choice")},
}


#: What the server takes that the document leaves out, and why.
_TEXT_UNDOCUMENTED = (
    "Also taken, and left out of the properties: `guided_grammar` and `structured_outputs.grammar`, a Lark or GBNF "
    "grammar's text, and `guided_json` and `structured_outputs.json` given as a schema's JSON text rather than an "
    "object (docs/structured-outputs.md). No JSON Schema tells a text that parses from one that does not, and one that "
    "does not is a 400 naming the field."
)


def _objects_only(field: dict) -> None:
    """A schema field as an object (or null): its JSON-text form left to the description."""
    field["anyOf"] = [choice for choice in field["anyOf"] if choice.get("type") != "string"]


def api_document(
    app: FastAPI,
    vocab_size: int,
    drafters: list[str],
    verifiers: list[str],
    strict: bool = False,
    most_choices: int | None = None,
    tools: bool = True,
) -> dict[str, Any]:
    """The OpenAPI document of ``app``: FastAPI's, less its 422 answers, plus what the loaded model and the served
    drafters and verifiers allow, and the most choices (``n``) the server's queue holds; ``strict``
    (``--strict-api``): unknown fields are refused, not ignored; ``tools``: the model's chat template renders tools
    (else a request with tools is refused)."""
    document = get_openapi(title=app.title, version=app.version, routes=app.routes)
    for operations in document["paths"].values():
        for operation in operations.values():
            operation["responses"].pop("422", None)
    schemas = document.get("components", {}).get("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        fields = schemas.get(name, {}).get("properties", {})
        if "verifier" in fields:
            fields["verifier"] = {"anyOf": [{"enum": verifiers}, {"type": "null"}], "title": "Verifier"}
        if name == "CompletionRequest":
            for choice in fields["prompt"]["anyOf"]:
                if choice.get("type") == "array":
                    choice["items"]["maximum"] = vocab_size - 1
        if name == "ChatCompletionRequest" and not tools:  # no tool to call: no choice may force one
            fields["tools"] = {"anyOf": [{"type": "array", "maxItems": 0}, {"type": "null"}], "title": "Tools"}
            fields["tool_choice"] = {"anyOf": [{"enum": ["none", "auto"]}, {"type": "null"}], "title": "Tool Choice"}
        if most_choices is not None and "n" in fields:
            fields["n"]["maximum"] = min(fields["n"]["maximum"], most_choices)
        if "stop_token_ids" in fields:
            fields["stop_token_ids"]["anyOf"][0]["items"]["maximum"] = vocab_size - 1
        if "logit_bias" in fields:
            bias = {"type": "number", "minimum": -100, "maximum": 100}
            token = {"pattern": below(vocab_size)}
            by_token = {"type": "object", "propertyNames": token, "additionalProperties": bias}
            fields["logit_bias"]["anyOf"][0] = by_token
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        if name in schemas:
            schemas[name]["not"] = _two_of(_STRUCTURED_OUTPUTS)
            schemas[name]["properties"].pop("guided_grammar", None)
            _objects_only(schemas[name]["properties"]["guided_json"])
            schemas[name]["description"] = _TEXT_UNDOCUMENTED
    if "StructuredOutputs" in schemas:
        schemas["StructuredOutputs"]["properties"].pop("grammar", None)
        _objects_only(schemas["StructuredOutputs"]["properties"]["json"])
        schemas["StructuredOutputs"]["not"] = _two_of(
            {key: _given(key, {"const": True} if key == "json_object" else None) for key in _CONSTRAINT_KINDS}
        )
    for name in ("CompletionRequest", "ChatCompletionRequest", "StreamOptions", "ChatMessage", "StructuredOutputs"):
        if name in schemas:
            schemas[name]["additionalProperties"] = not strict
    for name in ("VerifyOpenRequest", "VerifyStepRequest"):  # /v1/verify (server/sled.py): drafts are token ids
        fields = schemas.get(name, {}).get("properties", {})
        for token_ids in ("draft_token_ids", "stop_token_ids", "prompt"):
            for choice in fields.get(token_ids, {}).get("anyOf", [fields.get(token_ids, {})]):
                if choice.get("type") == "array":
                    choice["items"]["maximum"] = vocab_size - 1
        if "draft_probs" in fields:
            weight = {"type": "number", "minimum": 0}
            row = {"type": "object", "propertyNames": {"pattern": below(vocab_size)}, "additionalProperties": weight}
            fields["draft_probs"]["anyOf"][0]["items"] = row
    options = schemas.get("SpeculativeOptions", {}).get("properties", {})
    if "drafter" in options:
        options["drafter"] = {"anyOf": [{"enum": drafters}, {"type": "null"}], "title": "Drafter"}
    return document
