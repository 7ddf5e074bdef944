"""``specdecode generate | batch | demo``: how they load the models and build the generator, and the commands
themselves (``serve`` loads its models the same way).  Their flags: :mod:`specdecode.decode_flags`.

Names here are a contract (the benchmark and outside checks call them): keep JSON fields.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys

from specdecode.config import DEFAULT_NUM_DRAFT_TOKENS, GenerationConfig
from specdecode.constraints import KINDS, Constraint
from specdecode.drafters import check_drafter_options
from specdecode.drafters.adapt import asks_to_adapt
from specdecode.errors import SpecDecodeError, VocabularyMismatchError
from specdecode.generator import SpeculativeGenerator, check_prompt_text
from specdecode.models import loading, registry
from specdecode.models.quantize import check_quantize, draft_quantization
from specdecode.options import option_value
from specdecode.remote_target import REMOTE_DRAFT_TOKENS, RemoteGenerator, remote
from specdecode.sampling_params import SamplingParams
from specdecode.verify.registry import DEFAULT_VERIFIER, parse_verifier


def parse_option(text: str, flag: str = "--drafter-option") -> tuple[str, object]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise SpecDecodeError(f"{flag} takes KEY=VALUE, got {text!r}")
    return key.replace("-", "_"), option_value(raw)


def _generation_config(args: argparse.Namespace) -> GenerationConfig:
    options = dict(parse_option(o, "--verifier-option") for o in args.verifier_option)
    return GenerationConfig(
        verifier=parse_verifier(args.verifier, options),
        max_new_tokens=args.max_new_tokens,
        num_draft_tokens=args.num_draft_tokens,
        sampling=SamplingParams(
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            coupled=args.coupled,
            presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty,
            repetition_penalty=args.repetition_penalty,
            min_p=args.min_p,
            logit_bias=[_logit_bias_flag(text) for text in args.logit_bias],
        ),
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
        stop_token_ids=tuple(args.stop_token_id),
        min_tokens=args.min_tokens,
        logprobs=args.logprobs,
        constraint=_constraint_flags(args),
    )


def _constraint_flags(args: argparse.Namespace) -> Constraint | None:
    """``--json-schema``, ``--json-object``, ``--regex``, ``--choice`` or ``--grammar`` (at most one: argparse)."""
    if args.json_schema is not None:
        text = args.json_schema
        return Constraint.json_schema(text if text.lstrip().startswith("{") else _read_text(text, "--json-schema"))
    if args.json_object:
        return Constraint.json_object()
    if args.regex is not None:
        return Constraint.regex(args.regex)
    if args.choice is not None:
        return Constraint.choice(args.choice.split(","))
    if args.grammar is not None:
        return Constraint.grammar(_read_text(args.grammar, "--grammar"))
    return None


def _read_text(path: str, flag: str) -> str:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecDecodeError(f"{flag}: cannot read {path}: {exc.strerror or exc}") from None


def _logit_bias_flag(text: str) -> tuple[int, float]:
    """``--logit-bias ID=BIAS`` → (id, bias); the ranges are SamplingParams' to check."""
    token, _, bias = text.partition("=")
    try:
        return int(token), float(bias)
    except ValueError:
        raise SpecDecodeError(f"--logit-bias takes ID=BIAS (a token id and a number), got {text!r}") from None


def registry_vocab_size(name: str) -> int | None:
    """The vocabulary size the offline registry gives for model ``name`` (its description's "vocab N"), or
    None for a model it does not list."""
    spec = next((spec for spec in registry.MODELS if spec.name == name), None)
    found = re.search(r"\bvocab ([\d,]+)", spec.description) if spec else None
    return int(found.group(1).replace(",", "")) if found else None


def check_registry_vocabularies(target: str, draft: str) -> None:
    """Refuse a registered draft model whose vocabulary the registry says differs from the registered target's,
    before anything is downloaded or converted (a gigabyte, for some); equal sizes are checked token by token
    once both are loaded."""
    target_size, draft_size = registry_vocab_size(target), registry_vocab_size(draft)
    if target_size is None or draft_size is None or target_size == draft_size:
        return
    same = [name for name in registry.model_names() if name != target and registry_vocab_size(name) == target_size]
    hint = f"registered ones with its vocabulary: {', '.join(same)}" if same else "none of the registered ones has it"
    raise VocabularyMismatchError(
        f"vocabulary mismatch: draft model {draft!r} has {draft_size:,} tokens, target {target!r} {target_size:,} "
        f"(from the registry, before downloading anything); choose a draft model with the target's vocabulary ({hint}) "
        "or draft across vocabularies with --drafter draft-model (vocab_mapping=text|ngram|intersection)"
    )


def load_models(args: argparse.Namespace, draft_model: str | None, same_vocabulary: bool = True, adapts: bool = False):
    """The target (``--model``) and, if named, the draft model, with ``--no-fast-path``, ``--lean-weights``,
    ``--quantize`` (``--quantize-draft`` for the draft model, default
    :func:`~specdecode.models.quantize.draft_quantization`: int4, or fp32 when it ``adapts``) and
    ``--device`` applied; a model drafting for itself with the target's quantization is loaded once.  Bad
    ``--quantize`` values and registered models with different vocabularies are refused before either is
    loaded."""
    quantize = check_quantize(args.quantize)
    quantize_draft = draft_quantization(args.quantize_draft, quantize, device=args.device, trains=adapts)
    if draft_model is not None and same_vocabulary:  # not with --drafter-option vocab_mapping=
        check_registry_vocabularies(args.model, draft_model)
    common = {
        "fast_path": False if args.no_fast_path else None,
        "device": args.device,
        "block_copies": not args.lean_weights,
    }
    target = loading.load_model(args.model, quantize=quantize, **common)
    if draft_model is None:
        return target, None
    if draft_model == args.model and quantize_draft == quantize:
        return target, target
    return target, loading.load_model(draft_model, quantize=quantize_draft, **common)


def _build_generator(args: argparse.Namespace, drafter: str, defaults):
    options = dict(parse_option(o) for o in args.drafter_option)
    options["draft_model"] = args.draft_model
    options = check_drafter_options(drafter, **options)  # fail before the (slow) model load
    # draft-model drafts across vocabularies (a mapping by default); other drafters need the target's vocabulary.
    same_vocabulary = drafter != "draft-model" and "vocab_mapping" not in options
    target, draft = load_models(args, options.get("draft_model"), same_vocabulary, asks_to_adapt(options))
    if draft is not None:
        options["draft_model"] = draft
    return SpeculativeGenerator.build(target, drafter, defaults, **options)


def _remote_generator(args: argparse.Namespace) -> tuple[RemoteGenerator, dict]:
    """``--remote``: the drafter here, the server's model the target, and the request's settings from the flags; what
    only a local target does is refused."""
    config = _generation_config(args)
    sampling = config.sampling
    refused = {
        "--verifier (the server verifies with exact)": config.verifier.name != DEFAULT_VERIFIER,
        "--logprobs": config.logprobs is not None,
        "a structured output": config.constraint is not None,
        "--repetition-penalty": sampling.repetition_penalty != 1.0,
        "--logit-bias": bool(sampling.logit_bias),
    }
    if given := [flag for flag, asked in refused.items() if asked]:
        raise SpecDecodeError(f"--remote does not take {given[0]}")
    length = REMOTE_DRAFT_TOKENS if args.num_draft_tokens is DEFAULT_NUM_DRAFT_TOKENS else args.num_draft_tokens
    options = dict(parse_option(o) for o in args.drafter_option)
    return (
        remote(
            args.remote,
            args.drafter,
            api_key=args.api_key or os.environ.get("SPECDECODE_API_KEY") or None,
            num_draft_tokens=length,
            max_new_tokens=args.max_new_tokens,
            draft_model=args.draft_model,
            **options,
        ),
        {
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
            "min_p": sampling.min_p,
            "presence_penalty": sampling.presence_penalty,
            "frequency_penalty": sampling.frequency_penalty,
            "seed": sampling.seed,
            "coupled": sampling.coupled,
            "stop": list(config.stop) or None,
            "stop_token_ids": list(config.stop_token_ids) or None,
            "ignore_eos": config.ignore_eos,
            "min_tokens": config.min_tokens,
        },
    )


def cmd_generate(args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    check_prompt_text(prompt)  # before the (slow) model load
    if args.remote:
        generator, params = _remote_generator(args)
    else:
        generator, params = _build_generator(args, args.drafter, _generation_config(args)), {}
    if args.json:
        result = generator.generate(prompt, chat=args.chat, **params)
        print(json.dumps(result.to_json()))
        return 0
    result = None
    for event in generator.stream_events(prompt, chat=args.chat, **params):
        sys.stdout.write(event.text)
        sys.stdout.flush()
        result = event.result or result
    print()
    print(f"[{args.drafter}] {result.stats.summary()}", file=sys.stderr)
    return 0


#: Generation parameters a line of ``specdecode batch`` may set for itself (the flags set the defaults).
BATCH_LINE_PARAMS = frozenset(
    {"max_new_tokens", "num_draft_tokens", "temperature", "top_k", "top_p", "seed", "stop", "ignore_eos", "verifier"}
    | {"presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "logit_bias"}
    | {"stop_token_ids", "min_tokens", "skip_special_tokens", "include_stop_str_in_output", "logprobs"}
)
#: A line's own constraint (one of them; it replaces the flags'), as :func:`specdecode.constraints.parse_constraint`
#: reads it: ``{"prompt": "...", "json_schema": {...}}``, ``"json_object": true``, ``"regex"``, ``"choice"`` (a list),
#: ``"grammar"`` (the grammar's text).
BATCH_LINE_CONSTRAINTS = frozenset(KINDS)


def _read_batch_lines(path: str) -> list[str]:
    if path == "-":
        return sys.stdin.read().splitlines()
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecDecodeError(f"cannot read {path}: {exc}") from exc


def _batch_request(generator, line: str, chat: bool | None):
    """One JSONL line → (prompt, generation config, chat), or SpecDecodeError saying what is wrong."""
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        raise SpecDecodeError(f"not valid JSON ({exc.msg} at column {exc.colno})") from exc
    if not isinstance(item, dict):
        raise SpecDecodeError('expected an object like {"prompt": "..."} or {"messages": [...]}')
    unknown = set(item) - {"prompt", "messages"} - BATCH_LINE_PARAMS - BATCH_LINE_CONSTRAINTS
    if unknown:
        raise SpecDecodeError(f"unknown field(s): {', '.join(sorted(unknown))}")
    if ("prompt" in item) == ("messages" in item):
        raise SpecDecodeError('give exactly one of "prompt" (a string) or "messages" (a list of chat messages)')
    if "prompt" in item and not isinstance(item["prompt"], str):
        raise SpecDecodeError('"prompt" must be a string')
    messages = item.get("messages")
    if messages is not None and (not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages)):
        raise SpecDecodeError('"messages" must be a list of {"role": ..., "content": ...} objects')
    constraint = {key: item[key] for key in BATCH_LINE_CONSTRAINTS & set(item)}
    config = generator.config_for(
        **{key: item[key] for key in BATCH_LINE_PARAMS & set(item)}, constraint=constraint or None
    )
    prompt = item.get("prompt", messages)
    generator.encode_prompt(prompt, chat=chat)  # validates now, so the error names the line
    return prompt, config


def cmd_batch(args: argparse.Namespace) -> int:
    """Decode every line of a JSONL file together, ``--batch-size`` sequences at a time; one JSON result
    per line in input order.  A bad line gets an error in its place; the others complete."""
    lines = _read_batch_lines(args.prompts)
    if not any(line.strip() for line in lines):
        raise SpecDecodeError(f"{args.prompts} has no prompts (one JSON object per line)")
    generator = _build_generator(args, args.drafter, _generation_config(args))
    requests, errors = [], {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        index = len(requests) + len(errors)
        try:
            requests.append((index, *_batch_request(generator, line, args.chat)))
        except SpecDecodeError as exc:
            errors[index] = f"line {number}: {exc}"
    results = generator.run_batch(
        [(prompt, config) for _, prompt, config in requests], chat=args.chat, batch_size=args.batch_size
    )
    by_index: dict[int, object] = dict(errors)
    by_index.update({index: result for (index, _, _), result in zip(requests, results)})
    for index in sorted(by_index):
        result = by_index[index]
        if isinstance(result, (str, SpecDecodeError)):
            message = str(result)
            print(f"specdecode: error: {message}", file=sys.stderr)
            row = {"index": index, "error": message}
        elif args.json:
            row = {"index": index, **result.to_json()}
        else:
            print(f"=== [{index}] {result.finish_reason}, {result.stats.summary()}")
            print(result.text)
            continue
        print(json.dumps(row))
    return 2 if errors else 0


DEMO_PROMPT_INSTRUCTION = "Add a one-line comment above each function in this code and repeat the code:\n\n"
#: The demo's code, fixed here rather than read from the library (whose source changes, and could outgrow a
#: small model's context): an edit that repeats its input is where speculation shows its speed.
DEMO_CODE = """\
def mean(values):
    return sum(values) / len(values)


def variance(values):
    m = mean(values)
    return sum((v - m) ** 2 for v in values) / len(values)


def clamp(x, low, high):
    return max(low, min(high, x))
"""


def cmd_demo(args: argparse.Namespace) -> int:
    """The main job of the README's first command: same prompt, plain decoding vs speculative decoding, same output."""
    prompt = DEMO_PROMPT_INSTRUCTION + DEMO_CODE
    defaults = _generation_config(args)
    speculative = _build_generator(args, args.drafter, defaults)
    exact = dataclasses.replace(defaults, verifier=DEFAULT_VERIFIER)  # the reference is the target's own output
    plain = type(speculative).build(speculative.target, "none", exact)
    plain.generate(prompt, chat=args.chat, max_new_tokens=4)  # warm-up: first-call allocations are not decoding
    speculative.warm_up()  # nor is measuring the cost curve `auto` reads (plain decoding needs none)
    base = plain.generate(prompt, chat=args.chat)
    fast = speculative.generate(prompt, chat=args.chat)
    print(fast.text)
    print("-" * 60)
    print(f"plain decoding        : {base.stats.summary()}")
    print(f"{args.drafter:<22}: {fast.stats.summary()}")
    same = "identical" if base.token_ids == fast.token_ids else "DIFFERENT"
    speedup = fast.stats.tokens_per_s / base.stats.tokens_per_s if base.stats.tokens_per_s else float("nan")
    lossy = "" if fast.stats.lossless else f" (verifier {args.verifier} is LOSSY: a difference is its cost)"
    print(f"speedup {speedup:.2f}x over plain decoding on {args.model}; output {same} to plain decoding{lossy}")
    return 0 if base.token_ids == fast.token_ids or not defaults.sampling.greedy or lossy else 1
