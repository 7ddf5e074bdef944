"""Compile time per schema, mask time per token and memory of xgrammar and llguidance on cached tokenizers.

Usage: python tools/measure_grammar_engines.py [MODEL ...]   (default: every model cached under
~/.cache/specdecode/models).  Prints one JSON object per (engine, model).  Needs ``pip install xgrammar`` besides
specdecode (xgrammar is not one of its dependencies: docs/structured-outputs.md says why)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

MODELS = Path.home() / ".cache" / "specdecode" / "models"

SCHEMAS = {
    "record": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "email": {"type": "string"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"],
            },
        },
        "required": ["name", "age", "email", "tags", "address"],
    },
    "label": {"type": "object", "properties": {"label": {"enum": ["positive", "negative", "neutral"]}}},
}
SAMPLES = {
    "record": '{"name": "Ada Lovelace", "age": 36, "email": "ada@example.com", "tags": ["math", "poetry"], '
    '"address": {"city": "London", "zip": "12345"}}',
    "label": '{"label": "neutral"}',
}


def rss_mb() -> float:
    """The process's resident memory now."""
    status = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) / 1024


def measure_xgrammar(tokenizer, vocab: int) -> dict:
    import xgrammar as xgr

    tick = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    result = {"tokenizer_s": time.perf_counter() - tick}
    for name, schema in SCHEMAS.items():
        tick = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))
        result[f"compile_{name}_s"] = time.perf_counter() - tick
        matcher = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, vocab)
        tokens = tokenizer.encode(SAMPLES[name], add_special_tokens=False)
        times = []
        for token in tokens:
            tick = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            times.append(time.perf_counter() - tick)
            assert matcher.accept_token(token), (name, token)
        result[f"mask_{name}_ms_per_token"] = 1000 * sum(times) / len(times)
        result[f"mask_{name}_ms_max"] = 1000 * max(times)
    result["rss_mb"] = rss_mb()  # while the tokenizer, compiler and matchers are alive
    return result


def measure_llguidance(tokenizer, vocab: int) -> dict:
    import llguidance
    import llguidance.torch

    from specdecode.constraints import JSON_LAYOUT
    from specdecode.grammar import GrammarCompiler

    tick = time.perf_counter()
    lltok = GrammarCompiler(tokenizer, vocab, frozenset({tokenizer.eos_token_id})).tokenizer  # what specdecode reads
    result = {"tokenizer_s": time.perf_counter() - tick}
    for name, schema in SCHEMAS.items():
        tick = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
        matcher = llguidance.LLMatcher(lltok, grammar)
        result[f"compile_{name}_s"] = time.perf_counter() - tick
        assert not matcher.is_error(), matcher.get_error()
        bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
        tokens = tokenizer.encode(SAMPLES[name], add_special_tokens=False)
        times = []
        for token in tokens:
            tick = time.perf_counter()
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask)
            times.append(time.perf_counter() - tick)
            assert matcher.consume_token(token), (name, token, matcher.get_error())
        result[f"mask_{name}_ms_per_token"] = 1000 * sum(times) / len(times)
        result[f"mask_{name}_ms_max"] = 1000 * max(times)
    result["rss_mb"] = rss_mb()  # while the tokenizer, compiler and matchers are alive
    return result


def main() -> None:
    torch.set_num_threads(1)
    models = sys.argv[1:] or sorted(path.name for path in MODELS.iterdir() if (path / "hf").is_dir())
    for engine, measure in (("llguidance", measure_llguidance), ("xgrammar", measure_xgrammar)):
        for model in models:
            tokenizer = AutoTokenizer.from_pretrained(MODELS / model / "hf")
            vocab = len(tokenizer)
            before = rss_mb()
            result = measure(tokenizer, vocab)
            result.update(engine=engine, model=model, vocab=vocab, memory_mb=result.pop("rss_mb") - before)
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}), flush=True)


if __name__ == "__main__":
    main()
