"""What a request's output must match: a JSON schema, any JSON object, a regular expression, one of a list of strings,
or a context-free grammar (Lark, or GBNF / EBNF as llama.cpp writes it).

A :class:`Constraint` is parsed and checked once where a request enters (the command line, the Python API, the
server), and an invalid one is refused there with the grammar engine's message (:class:`SpecDecodeError`: exit 2,
HTTP 400); :mod:`specdecode.grammar` compiles it for a tokenizer, once per distinct constraint.  Build one in code
with the class methods (``Constraint.json_schema({...})``, ``Constraint.choice(["yes", "no"])``) or from a mapping of
one kind to its value (:func:`parse_constraint`: ``{"regex": "[0-9]+"}``, vLLM's ``structured_outputs`` shape).

JSON is written in one line with ``", "`` and ``": "`` between items (Python's ``json.dumps`` layout, what models
mostly write), with no other whitespace: every key, quote, comma and bracket the schema fixes is then a forced token,
which speculation proposes for free (:mod:`specdecode.grammar`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from specdecode.errors import SpecDecodeError

ConstraintKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[ConstraintKind, ...] = ("json_schema", "json_object", "regex", "choice", "grammar")

#: How JSON is laid out (llguidance's JSON compile options): one line, Python's separators.
JSON_LAYOUT = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}

#: Any JSON object (OpenAI's ``{"type": "json_object"}``).
_ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class Constraint:
    """One request's constraint: its ``kind`` and the text that defines it (the schema as JSON text, the regex, the
    choices as a JSON list, the grammar's source); ``engine_grammar`` is what the grammar engine compiles.  Equal
    constraints compile once (:mod:`specdecode.grammar` caches by this value)."""

    kind: ConstraintKind
    text: str
    engine_grammar: str

    @classmethod
    def json_schema(cls, schema: Mapping | str) -> Constraint:
        """Output that is JSON valid under ``schema`` (a mapping, or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise SpecDecodeError(f"JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, Mapping):
            raise SpecDecodeError(f"a JSON schema must be a JSON object, got {type(schema).__name__}")
        text = json.dumps(schema)
        return cls("json_schema", text, _compile("JSON schema", "json_schema", text))

    @classmethod
    def json_object(cls) -> Constraint:
        """Output that is one JSON object, any keys and values."""
        text = json.dumps(_ANY_OBJECT)
        return cls("json_object", text, _compile("JSON object", "json_schema", text))

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        """Output that matches ``pattern`` whole (Rust ``regex`` syntax, which Python's mostly is)."""
        if not isinstance(pattern, str) or not pattern:
            raise SpecDecodeError(f"a regex must be a non-empty string, got {pattern!r}")
        return cls("regex", pattern, _compile("regex", "regex", pattern))

    @classmethod
    def choice(cls, choices: Sequence[str]) -> Constraint:
        """Output that is exactly one of ``choices``."""
        if isinstance(choices, str) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise SpecDecodeError(f"choices must be a non-empty list of non-empty strings, got {choices!r}")
        text = json.dumps(list(choices))
        return cls("choice", text, _compile("choice", "choice", text))

    @classmethod
    def grammar(cls, source: str) -> Constraint:
        """Output in the language of a context-free grammar: Lark (``start: ...``) or GBNF (``root ::= ...``)."""
        if not isinstance(source, str) or not source.strip():
            raise SpecDecodeError("a grammar must be non-empty text")
        return cls("grammar", source, _compile("grammar", "grammar", source))

    def to_json(self) -> dict:
        """The constraint as :func:`parse_constraint` reads it back."""
        if self.kind == "json_object":
            return {"json_object": True}
        if self.kind in ("json_schema", "choice"):
            return {self.kind: json.loads(self.text)}
        return {self.kind: self.text}


def parse_constraint(value: Constraint | Mapping | None) -> Constraint | None:
    """A constraint, or a mapping of one kind to its value: ``{"json_schema": {...}}``, ``{"json_object": True}``,
    ``{"regex": "..."}``, ``{"choice": [...]}``, ``{"grammar": "..."}`` (``"json"`` is read as ``"json_schema"``, as
    vLLM's ``structured_outputs`` names it); None when it asks for none."""
    if value is None or isinstance(value, Constraint):
        return value
    if not isinstance(value, Mapping):
        raise SpecDecodeError(f"a constraint must be a Constraint or a mapping of one kind to its value, got {value!r}")
    # A kind given as null (json_object as false) is not asked for, as vLLM's structured_outputs reads it.
    asked = {key: item for key, item in value.items() if item is not None and item is not False}
    given = {("json_schema" if key == "json" else key): item for key, item in asked.items()}
    unknown = sorted(set(given) - set(KINDS))
    if unknown:
        raise SpecDecodeError(f"unknown constraint kind(s) {', '.join(unknown)}; the kinds: {', '.join(KINDS)}")
    if not given:
        return None
    if len(given) > 1:
        raise SpecDecodeError(f"a request takes one constraint, got {len(given)}: {', '.join(sorted(given)) or '-'}")
    ((kind, item),) = given.items()
    if kind == "json_object":
        if item is not True:
            raise SpecDecodeError(f"json_object takes true, got {item!r}")
        return Constraint.json_object()
    return getattr(Constraint, kind)(item)


def _compile(what: str, kind: str, text: str) -> str:
    """The grammar engine's definition of ``text``, checked: an invalid one is refused with the engine's message."""
    import llguidance

    try:
        if kind == "json_schema":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_LAYOUT)
        else:
            grammar = llguidance.grammar_from(kind, text)  # type: ignore[arg-type]
    except ValueError as exc:
        raise SpecDecodeError(f"invalid {what}: {exc}") from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise SpecDecodeError(f"invalid {what}: {_one_line(messages[0])}")
    return grammar


def _one_line(message: str) -> str:
    """The engine's message on one line: its first line, and the line that names the error when it draws the source
    with a caret below (a regex's "error: unclosed group")."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    named = next((line.removeprefix("error:").strip() for line in lines[1:] if line.startswith("error:")), None)
    return f"{lines[0]} {named}" if named else lines[0]
