"""The flags of ``specdecode generate | batch | demo`` (the model flags shared with ``serve``), declared without
importing what runs them (:mod:`specdecode.decode_commands`), so that their ``--help`` answers at once.

Names here are a contract (the benchmark and outside checks call them): keep flags.
"""

from __future__ import annotations

import argparse

from specdecode.config import DEFAULT_NUM_DRAFT_TOKENS
from specdecode.models.registry import DEFAULT_MODEL
from specdecode.verify.registry import DEFAULT_VERIFIER


def _draft_tokens(text: str) -> int | str:
    return int(text) if text.lstrip("-").isdigit() else text


def add_model_flags(parser: argparse.ArgumentParser, drafter_help: str) -> None:
    """What to load and how to draft (``generate``, ``batch``, ``demo`` and ``serve``; read by
    :func:`specdecode.decode_commands.load_models`)."""
    parser.add_argument("--model", default=DEFAULT_MODEL, help="registry short name, local dir, .gguf or hub id")
    parser.add_argument("--drafter", default="pld", help=drafter_help)
    parser.add_argument("--draft-model", help="draft model for --drafter draft-model")
    parser.add_argument(
        "--drafter-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra drafter option, e.g. max_ngram=4 for pld (repeatable)",
    )
    parser.add_argument(
        "--num-draft-tokens",
        type=_draft_tokens,
        default=DEFAULT_NUM_DRAFT_TOKENS,
        metavar="K",
        help="draft depth per step: an integer, 'auto' (cost model) or 'heuristic' (transformers' schedule); "
        "default %(default)s",
    )
    parser.add_argument(
        "--no-fast-path",
        action="store_true",
        help="keep transformers' default linear kernels (the fast CPU path is on by default)",
    )
    parser.add_argument(
        "--quantize",
        default="none",
        metavar="{none,int8,int4,bf16,w4a8,auto}",
        help="weight-only quantization of the target's linear layers (CPU): int8 per channel, int4 per group, "
        "bf16 (verification costs about one token on CPUs with AMX), w4a8 (int4 weights on int8 activations, our "
        "AVX2 kernel: fastest on AVX2-only CPUs), auto (the fastest of these on this CPU for this model, timed once "
        "and cached; the choice is printed); lossless against plain decoding of the same quantized model, not "
        "against fp32 (default none: the published weights)",
    )
    parser.add_argument(
        "--quantize-draft",
        metavar="{none,int8,int4,bf16,w4a8,auto}",
        help="quantization of the --draft-model (default int4, w4a8 on AVX2-only CPUs: measured fastest; "
        "none with adapt=true; auto as for --quantize); drafts never change the output",
    )
    parser.add_argument(
        "--lean-weights",
        action="store_true",
        help="int8/int4 layers hold no bf16 copy of their weights for prompts and drafts catching up: "
        "half the memory or less, but a 300-token prompt prefills about 6x slower",
    )
    parser.add_argument("--device", default="cpu", help="where the models run: cpu (default), cuda, cuda:N")
    parser.add_argument(
        "--verbose", action="store_true", help="also show other libraries' warnings and log lines (hidden by default)"
    )


def add_generation_flags(parser: argparse.ArgumentParser) -> None:
    add_model_flags(parser, "drafting method (see `specdecode drafters`)")
    parser.add_argument("--max-new-tokens", type=int, default=128, metavar="N")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0 disables top-k")
    parser.add_argument("--seed", type=int, help="seed for sampling (reproducible runs)")
    parser.add_argument(
        "--no-coupled",
        dest="coupled",
        action="store_false",
        help="with --seed, verify by rejection sampling instead of Gumbel-max coupling: the text then depends on "
        "the drafter and draft length (coupled, the default, gives one text per seed whatever drafts it)",
    )
    parser.add_argument(
        "--verifier",
        default=DEFAULT_VERIFIER,
        help="exact (lossless, default) or a relaxed, LOSSY verifier: fly, typical, judge (see `specdecode "
        "verifiers`); options inline (fly:window=2) or with --verifier-option",
    )
    parser.add_argument(
        "--verifier-option", action="append", default=[], metavar="KEY=VALUE", help="e.g. window=4 for fly"
    )
    parser.add_argument(
        "--presence-penalty", type=float, default=0.0, help="subtracted from the logit of each token already generated"
    )
    parser.add_argument(
        "--frequency-penalty", type=float, default=0.0, help="subtracted once per time a token was already generated"
    )
    parser.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="divides positive (multiplies negative) logits of tokens in the prompt or output; 1 disables it",
    )
    parser.add_argument(
        "--min-p", type=float, default=0.0, help="cut tokens less likely than this times the most likely one"
    )
    parser.add_argument(
        "--logit-bias",
        action="append",
        default=[],
        metavar="ID=BIAS",
        help="add BIAS (-100..100) to token ID's logit (repeatable)",
    )
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument(
        "--stop-token-id", action="append", type=int, default=[], metavar="ID", help="stop token id (repeatable)"
    )
    parser.add_argument(
        "--min-tokens", type=int, default=0, metavar="N", help="no end-of-sequence or stop token before N tokens"
    )
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    parser.add_argument(
        "--logprobs",
        type=int,
        metavar="N",
        help="with --json, each token's log-probability and the N most likely alternatives' (0-20)",
    )
    constraint = parser.add_argument_group(
        "structured output", "what the output must match (one of these; docs/structured-outputs.md)"
    ).add_mutually_exclusive_group()
    constraint.add_argument("--json-schema", metavar="FILE|JSON", help="JSON valid under this schema (file or inline)")
    constraint.add_argument("--json-object", action="store_true", help="one JSON object, any keys")
    constraint.add_argument("--regex", metavar="REGEX", help="text that matches this regular expression whole")
    constraint.add_argument("--choice", metavar="A,B,...", help="exactly one of these comma-separated strings")
    constraint.add_argument("--grammar", metavar="FILE", help="a context-free grammar's file: Lark or GBNF")
    chat = parser.add_mutually_exclusive_group()
    chat.add_argument(
        "--chat",
        action="store_const",
        const=True,
        help="wrap the prompt in the model's chat template (the default when it has one; with --chat, an error "
        "when it has none)",
    )
    chat.add_argument(
        "--no-chat",
        dest="chat",
        action="store_const",
        const=False,
        help="give the prompt to the model as it is, without the chat template",
    )


def add_remote_flags(parser: argparse.ArgumentParser) -> None:
    """``generate --remote``: draft here, verify on a ``specdecode serve`` server (:mod:`specdecode.remote_target`)."""
    remote = parser.add_argument_group("remote target (draft here, verify on a server)")
    remote.add_argument(
        "--remote",
        metavar="URL",
        help="verify on the specdecode server at URL (its /v1/verify; its model is the target, --model is not "
        "loaded): --drafter pld or draft-model drafts here, a fixed --num-draft-tokens (default 5)",
    )
    remote.add_argument("--api-key", help="the server's API key for --remote (default: $SPECDECODE_API_KEY)")
