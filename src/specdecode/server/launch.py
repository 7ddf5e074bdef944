"""``specdecode serve``: load the model and drafters once, then serve them with uvicorn (its flags:
:mod:`specdecode.server.cli`)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

import uvicorn

from specdecode.config import GenerationConfig
from specdecode.constraints import Constraint
from specdecode.decode_commands import load_models, parse_option
from specdecode.drafters import accepted_options, create_drafter, drafter_class
from specdecode.drafters.adapt import asks_to_adapt
from specdecode.errors import SpecDecodeError
from specdecode.generator import SpeculativeGenerator
from specdecode.server.app import ServerConfig, Service, create_app, freeze_startup_heap, uvicorn_config


def build_service(args: argparse.Namespace):
    """The generator, every served drafter and the service around them (models loaded once)."""
    names = [name.strip() for name in args.drafter.split(",") if name.strip()]
    if not names:
        raise SpecDecodeError("--drafter names no drafter")
    for name in names:
        drafter_class(name)  # unknown names fail before the model loads
    if args.max_batch_size < 1:
        raise SpecDecodeError(f"--max-batch-size must be a positive integer, got {args.max_batch_size}")
    if args.max_queue < 0:
        raise SpecDecodeError(f"--max-queue must be an integer >= 0, got {args.max_queue}")
    if args.max_verify_sessions < 0:
        raise SpecDecodeError(f"--max-verify-sessions must be an integer >= 0, got {args.max_verify_sessions}")
    if not args.verify_idle_timeout > 0:
        raise SpecDecodeError(f"--verify-idle-timeout must be a positive number, got {args.verify_idle_timeout}")
    if not 0 < args.port < 65536:
        raise SpecDecodeError(f"--port must be in 1..65535, got {args.port}")
    options = dict(parse_option(o) for o in args.drafter_option)
    if args.draft_model:
        options["draft_model"] = args.draft_model
    per_drafter = {name: {k: v for k, v in options.items() if k in accepted_options(name, options)} for name in names}
    if unused := sorted(set(options) - {key for taken in per_drafter.values() for key in taken}):
        raise SpecDecodeError(f"no served drafter takes option(s): {', '.join(unused)}")
    defaults = GenerationConfig(num_draft_tokens=args.num_draft_tokens)
    # draft-model drafts across vocabularies (a mapping by default); other drafters need the target's vocabulary.
    takers = [name for name in names if "draft_model" in per_drafter[name]]
    same_vocabulary = "vocab_mapping" not in options and any(name != "draft-model" for name in takers)
    target, draft = load_models(args, options.get("draft_model"), same_vocabulary, asks_to_adapt(options))
    if draft is not None:
        for taken in per_drafter.values():
            if "draft_model" in taken:
                taken["draft_model"] = draft
    drafters = {name: create_drafter(name, target, **per_drafter[name]) for name in names}
    drafters.setdefault("none", create_drafter("none", target))
    generator = SpeculativeGenerator(target, drafters[names[0]], defaults)
    warm_up_s = generator.warm_up(drafters.values())  # before the first request, which would otherwise wait
    # The grammar engine reads every token now (0.3 s for 49k, 2 s for 262k), not in a structured request's handler.
    generator.grammars.compile(Constraint.json_object())
    if warm_up_s:
        print(
            f"[serve] measured before serving in {warm_up_s:.1f} s: what the drafters' first requests would wait for "
            "(auto's verification cost curve, or its cache; draft tokens and prompt reading; self-drafters' agreement)",
            file=sys.stderr,
        )
    config = ServerConfig(
        model_name=args.model,
        max_batch_size=args.max_batch_size,
        max_queue=args.max_queue,
        api_key=args.api_key or os.environ.get("SPECDECODE_API_KEY") or None,
        drain_s=args.drain_timeout,
        engine_thread=False,  # run_serve steps it in the main thread, where the model was loaded
        strict_api=args.strict_api,
        prefix_caching=args.enable_prefix_caching,
        max_verify_sessions=args.max_verify_sessions,
        verify_idle_s=args.verify_idle_timeout,
    )
    return Service(generator, drafters, config)


def run_serve(args: argparse.Namespace) -> int:
    service = build_service(args)
    freeze_startup_heap()
    guarded = ", API key required" if service.config.api_key else ""
    print(
        f"[serve] {args.model} with drafters {', '.join(service.drafters)} on http://{args.host}:{args.port} "
        f"(batch {args.max_batch_size}, queue {args.max_queue}{guarded})",
        file=sys.stderr,
    )
    config = uvicorn_config(
        create_app(service),
        host=args.host,
        port=args.port,
        log_level="warning",
        timeout_graceful_shutdown=max(1, int(args.drain_timeout)),
    )
    server = uvicorn.Server(config)
    http = threading.Thread(target=server.run, name="specdecode-http", daemon=True)

    def stop(signum: int, frame: object) -> None:
        # The first SIGTERM or Ctrl-C drains (uvicorn's graceful shutdown, then the worker's); a second forces.
        if server.should_exit:
            server.force_exit = True
        server.should_exit = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    http.start()
    service.worker.drive(alive=http.is_alive)  # returns once uvicorn's shutdown has stopped the worker
    http.join()
    if not server.started:
        raise SpecDecodeError(f"the server could not start on {args.host}:{args.port} (uvicorn's error is above)")
    print("[serve] stopped", file=sys.stderr)
    return 0
