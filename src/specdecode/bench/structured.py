"""``specdecode bench structured``: structured outputs with speculation, on a JSON-extraction and a classification
suite (:mod:`specdecode.data.structured`: each prompt with its schema).

Every prompt is decoded greedily by each contestant, in turns (a prompt by every contestant, then the next): plain
decoding unconstrained, plain decoding under the schema with the grammar's forced tokens drafted and without, and each
method under the schema, forced tokens on and off.  Reported per contestant: tokens/s, the time per token, mean
accepted tokens per step, the grammar's share of the time (masks and draft checks), the share of outputs that parse
and validate under their schema (``jsonschema``), and the share equal to plain constrained decoding's (which every
constrained contestant must reach: speculation is lossless under the constraint).  Every decode starts from a cold
drafter; one short untimed decode per generator first.  Not resumable: a run takes minutes.

Other servers (``--url LABEL=URL``, :mod:`specdecode.bench.structured_servers`) take their turn on each prompt too,
unconstrained and under the schema as OpenAI's ``response_format``; their times are whole HTTP requests, their answers
are compared with plain constrained decoding's as JSON values (a server may lay them out otherwise).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from specdecode.bench import common
from specdecode.bench.methods import MethodSpec, parse_methods
from specdecode.bench.metrics import ratio
from specdecode.bench.reporting import closing_line, fmt, table
from specdecode.bench.serve import check_server_labels, parse_servers
from specdecode.bench.structured_servers import StructuredServer
from specdecode.constraints import Constraint
from specdecode.data.structured import STRUCTURED_PROMPTS, STRUCTURED_SUITES, StructuredPrompt
from specdecode.errors import SpecDecodeError
from specdecode.generator import SpeculativeGenerator
from specdecode.models.loading import fast_path_default, load_model
from specdecode.models.quantize import check_quantize
from specdecode.threads import fixed_threads

WARMUP_TOKENS = 8
PLAIN = "none"
#: The contestant every constrained one must equal: plain decoding under the schema, nothing drafted.
REFERENCE = (PLAIN, True, False)
DEFAULTS: dict[str, Any] = {
    "model": "smollm2-135m",
    "methods": "pld,suffix,recycling",
    "suites": STRUCTURED_SUITES,
    "max_new_tokens": 128,
    "quantize": "none",
    "out": "bench-out/structured",
    "servers": "",  # other OpenAI-compatible servers, LABEL=URL,...
    "served_model": None,  # the model name they serve: default the model's
}

#: A contestant: (method or server label, constrained, forced tokens drafted; None for a server).
Contestant = tuple[str, bool, bool | None]


@dataclass(frozen=True)
class StructuredSettings:
    model: str
    methods: tuple[MethodSpec, ...]
    suites: tuple[str, ...]
    max_new_tokens: int
    quantize: str
    threads: int
    out: Path
    servers: tuple[tuple[str, str], ...] = ()  # other servers measured beside ours: (label, base URL)
    served_model: str | None = None  # the model name they serve (None: ``model``)

    def __post_init__(self) -> None:
        common.check_positive_ints(("--max-new-tokens", self.max_new_tokens), ("--threads", self.threads))
        check_server_labels(self.servers, {PLAIN, *(m.spec for m in self.methods)})
        check_quantize(self.quantize)
        unknown = sorted(set(self.suites) - set(STRUCTURED_SUITES))
        if not self.suites or unknown:
            raise SpecDecodeError(f"--suites takes some of {', '.join(STRUCTURED_SUITES)}, got {list(self.suites)}")

    def to_json(self) -> dict[str, Any]:
        return common.settings_json(self)


def resolve_settings(**overrides: Any) -> StructuredSettings:
    """The defaults, overridden by every given (non-None) value; strings are parsed as on the command line.
    Plain decoding is always measured, so ``none`` is dropped from ``methods``."""
    parsers = {"methods": parse_methods, "suites": common.split_names, "servers": parse_servers}
    values = common.resolve_values(StructuredSettings, DEFAULTS, overrides, "structured setting", parsers)
    return StructuredSettings(**{**values, "methods": tuple(m for m in values["methods"] if m.spec != PLAIN)})


def contestants(settings: StructuredSettings) -> list[Contestant]:
    """Every contestant, plain decoding first, other servers last."""
    plain: list[Contestant] = [(PLAIN, False, False), REFERENCE, (PLAIN, True, True)]
    ours: list[Contestant] = [(method.spec, True, forced) for method in settings.methods for forced in (False, True)]
    return plain + ours + [(label, constrained, None) for label, _ in settings.servers for constrained in (False, True)]


def validity(text: str, schema: dict[str, Any]) -> bool:
    """Whether ``text`` parses as JSON and validates under ``schema``."""
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def decode(
    generator: SpeculativeGenerator, prompt: StructuredPrompt, ids: list[int], settings: StructuredSettings, **how
) -> dict[str, Any]:
    """One greedy decode from a cold drafter → its record."""
    constrained, forced, k = how["constrained"], how["forced"], how["k"]
    generator.reset_drafter()
    generator.grammars.forced_drafts = forced
    constraint = Constraint.json_schema(prompt.schema) if constrained else None
    result = generator.generate(ids, max_new_tokens=settings.max_new_tokens, num_draft_tokens=k, constraint=constraint)
    stats = result.stats
    return {
        "prompt": f"{prompt.suite}/{prompt.id}",
        "token_ids": result.token_ids,
        "text": result.text,
        "new_tokens": stats.new_tokens,
        "steps": stats.steps,
        "accepted_tokens": stats.accepted_tokens,
        "wall_s": round(stats.wall_s, 5),
        "prefill_s": round(stats.prefill_s, 5),
        "grammar_s": round(stats.grammar_s, 5),
        "finish_reason": result.finish_reason,
        "valid": validity(result.text, prompt.schema),
    }


def same_value(text: str, reference: str) -> bool:
    """Whether two answers are the same JSON value (the same text where either does not parse)."""
    try:
        return json.loads(text) == json.loads(reference)
    except json.JSONDecodeError:
        return text == reference


def summarize(name: Contestant, records: list[dict], reference: list[dict] | None) -> dict[str, Any]:
    method, constrained, forced = name
    server = forced is None
    tokens = sum(r["new_tokens"] for r in records)
    wall_s = sum(r["wall_s"] for r in records)
    if reference is None or not constrained:
        same = None
    elif server:  # another server may lay JSON out otherwise (its whitespace): the same answer is the same value
        same = [same_value(r["text"], ref["text"]) for r, ref in zip(records, reference)]
    else:
        same = [r["token_ids"] == ref["token_ids"] for r, ref in zip(records, reference)]
    row: dict[str, Any] = {
        "method": method,
        "server": server,
        "constrained": constrained,
        "forced_drafts": forced,
        "new_tokens": tokens,
        "wall_s": round(wall_s, 4),
        "tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
        "valid": sum(r["valid"] for r in records) / len(records),
        "equal_to_plain_constrained": sum(same) / len(same) if same is not None else None,
    }
    if server:
        lengths = [r["mean_acceptance_length"] for r in records if r["mean_acceptance_length"] is not None]
        row |= {
            "decode_ms_per_token": None,
            "mean_accepted_tokens": sum(lengths) / len(lengths) if lengths else None,
            "grammar_share": None,
        }
    else:
        decode_s = wall_s - sum(r["prefill_s"] for r in records)
        steps = sum(r["steps"] for r in records)
        row |= {
            # Without the prompt's reading: unconstrained and constrained answers differ in length, and a short
            # answer would carry more of its prompt's cost per token.
            "decode_ms_per_token": 1000 * decode_s / tokens if tokens else None,
            "mean_accepted_tokens": (steps + sum(r["accepted_tokens"] for r in records)) / steps if steps else None,
            "grammar_share": sum(r["grammar_s"] for r in records) / wall_s if wall_s > 0 else 0.0,
        }
    row["per_prompt"] = [{k: v for k, v in r.items() if k != "token_ids"} for r in records]
    return row


def measure_structured(
    settings: StructuredSettings, prompts: list[StructuredPrompt] | None = None, progress: bool = True
) -> dict[str, Any]:
    """Decode every prompt with every contestant; write results.json and results.md to ``settings.out`` and return
    the results.  ``prompts`` replaces the built-in suites (tests)."""
    chosen = prompts if prompts is not None else [p for p in STRUCTURED_PROMPTS if p.suite in settings.suites]
    servers = {
        label: StructuredServer(label, url, settings.served_model or settings.model) for label, url in settings.servers
    }
    for server in servers.values():
        server.check()
    target = load_model(settings.model, quantize=settings.quantize)
    chat = bool(getattr(target.tokenizer, "chat_template", None))
    generators = {PLAIN: SpeculativeGenerator.build(target, PLAIN)}
    for method in settings.methods:
        generators[method.spec] = SpeculativeGenerator.build(target, method.drafter, **dict(method.options))
    ids = [generators[PLAIN].encode_prompt(prompt.text, chat=chat) for prompt in chosen]
    k_of = {method.spec: method.k for method in settings.methods} | {PLAIN: 0}
    names = contestants(settings)
    records: dict[Contestant, list[dict]] = {name: [] for name in names}
    results: dict[str, Any] = {
        "settings": settings.to_json(),
        "prompts": [{"prompt": f"{p.suite}/{p.id}", "prompt_tokens": len(i)} for p, i in zip(chosen, ids)],
        "environment": {**common.environment(settings.threads), "fast_path": fast_path_default()},
    }
    if servers:
        results["servers"] = {label: {"url": s.url, "model": s.model} for label, s in servers.items()}
    started = time.perf_counter()
    with (
        fixed_threads(settings.threads),
        tqdm(total=len(names) * len(chosen), unit="decode", disable=not progress) as bar,
    ):
        for generator in generators.values():
            generator.generate(
                ids[0], max_new_tokens=WARMUP_TOKENS, constraint=Constraint.json_schema(chosen[0].schema)
            )
        for prompt, prompt_ids in zip(chosen, ids):  # every contestant on a prompt in turn: drifts hit all alike
            for name in names:
                method, constrained, forced = name
                if method in servers:
                    record = servers[method].ask(prompt, prompt.text, constrained, settings.max_new_tokens)
                    record["valid"] = validity(record["text"], prompt.schema)
                else:
                    how = {"constrained": constrained, "forced": forced, "k": k_of[method] if method != PLAIN else 0}
                    record = decode(generators[method], prompt, prompt_ids, settings, **how)
                records[name].append(record)
                bar.update()
    results["rows"] = [summarize(name, records[name], records[REFERENCE]) for name in names]
    results["environment"]["load_average_end"] = common.load_average()
    results["measure_s"] = round(time.perf_counter() - started, 1)
    common.save_json(settings.out / "results.json", results)
    (settings.out / "results.md").write_text(markdown(results))
    return results


def markdown(results: dict[str, Any]) -> str:
    """results.md, from the results JSON alone."""
    s = results["settings"]
    rows = results["rows"]
    plain = next(r for r in rows if not r["constrained"])
    reference = next(r for r in rows if r["constrained"] and r["method"] == PLAIN and not r["forced_drafts"])

    def label(row: dict) -> str:
        if row.get("server"):
            return f"{row['method']} (server) {'constrained' if row['constrained'] else 'unconstrained'}"
        if not row["constrained"]:
            return f"`{row['method']}` unconstrained"
        return f"`{row['method']}` constrained, forced drafts {'on' if row['forced_drafts'] else 'off'}"

    servers = results.get("servers", {})
    where = ", ".join(f"{label}: {server['url']}" for label, server in servers.items())
    server_note = (
        [
            f"Other servers ({where}): each request is one greedy chat request, under the schema as `response_format` "
            "(`json_schema`, strict) or without, its "
            "prefix cache emptied first; its time is the whole HTTP request; its mean accepted tokens per step are "
            "1 + accepted / drafts from its speculation counters; its answers are compared with plain constrained "
            "decoding's as JSON values (its layout of them may differ).",
            "",
        ]
        if servers
        else []
    )

    lines = [
        f"# Structured outputs with speculation: `{s['model']}`"
        + (f" ({s['quantize']} weights)" if s.get("quantize", "none") != "none" else ""),
        "",
        f"{len(results['prompts'])} prompts ({', '.join(s['suites'])}), greedy, up to {s['max_new_tokens']} new "
        "tokens, each answer held to its prompt's JSON schema (but the unconstrained row). Plain decoding's "
        f"time per token, the prompt's reading left out: {fmt(plain['decode_ms_per_token'])} ms unconstrained, "
        f"{fmt(reference['decode_ms_per_token'])} ms constrained "
        f"({fmt(ratio(reference['decode_ms_per_token'], plain['decode_ms_per_token']), '.3f')}x).",
        "",
        *server_note,
        *table(
            [
                "contestant",
                "tokens/s",
                "decode ms / token",
                "over plain constrained",
                "mean accepted tokens / step",
                "grammar's share of time",
                "valid JSON under the schema",
                "same as plain constrained (tokens; a server: JSON value)",
            ],
            (
                [
                    label(row),
                    fmt(row["tokens_per_s"], ".1f"),
                    fmt(row["decode_ms_per_token"]),
                    fmt(ratio(row["tokens_per_s"], reference["tokens_per_s"]), ".2f", "x"),
                    fmt(row["mean_accepted_tokens"]),
                    fmt(_percent(row["grammar_share"]), ".1f", "%"),
                    fmt(100 * row["valid"], ".0f", "%"),
                    fmt(_percent(row["equal_to_plain_constrained"]), ".0f", "%"),
                ]
                for row in rows
            ),
        ),
        "",
        closing_line(results),
        "",
    ]
    return "\n".join(lines)


def _percent(share: float | None) -> float | None:
    return None if share is None else 100 * share
