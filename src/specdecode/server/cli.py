"""``specdecode serve``'s flags, declared without importing the server (:mod:`specdecode.server.launch` runs it)."""

from __future__ import annotations

import argparse

from specdecode.decode_flags import add_model_flags
from specdecode.deferred import Deferred


def add_serve_command(subparsers: argparse._SubParsersAction) -> None:
    serve = subparsers.add_parser(
        "serve",
        help="serve an OpenAI-compatible API (completions, chat completions, streaming, /metrics)",
        description="One process: the batched engine steps in the main thread, uvicorn's event loop in "
        "another; requests join the batch between steps. Binds 127.0.0.1 unless --host says otherwise.",
    )
    add_model_flags(
        serve,
        "drafter(s) to serve, comma-separated; the first is the default, 'none' is always served; "
        "each --drafter-option goes to every served drafter that takes it",
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--max-batch-size", type=int, default=8, help="sequences decoded together")
    serve.add_argument("--max-queue", type=int, default=64, help="requests waiting beyond the batch; more get 429")
    serve.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (default: $SPECDECODE_API_KEY)")
    serve.add_argument(
        "--strict-api",
        action="store_true",
        help="refuse (400) request fields the server does not know, instead of ignoring them with a warning "
        "(the X-Ignored-Fields header and the log)",
    )
    serve.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep finished prompts' caches (as many as the batch) and read only what a new prompt does not share "
        "with one read before, in whole 128-token chunks: output unchanged (default on)",
    )
    serve.add_argument(
        "--max-verify-sessions",
        type=int,
        default=8,
        metavar="N",
        help="/v1/verify sessions (clients that draft and send their drafts to be verified) open at once; more get 429",
    )
    serve.add_argument(
        "--verify-idle-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="seconds a /v1/verify session may wait for its next draft before it is closed and its cache slot freed",
    )
    serve.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="on SIGTERM, seconds in-flight requests may finish before they are cancelled",
    )
    serve.set_defaults(run=Deferred("specdecode.server.launch:run_serve"))
