"""Drafting here, verification on a server (SLED): ``specdecode.remote(url, drafter=...)`` and ``specdecode generate
--remote URL``.

The local drafter proposes; each draft goes to the server's ``/v1/verify`` (:mod:`specdecode.server.sled`), whose
target keeps what its own decoding would have produced: the accepted draft tokens and its next token.  So the
output is the server's plain output whatever is drafted here — token for token at temperature 0, the same text for
a seed (coupled sampling), and exact rejection sampling otherwise, against the distributions this side drew from.
Those are sent sparse: a sampling draft model draws from its ``DRAFT_SUPPORT`` most likely tokens only (any
distribution it really drew from keeps verification exact; a truncated one is a few dozen numbers per token rather
than the whole vocabulary).

Drafters that draft from the token ids alone run here: prompt lookup (``pld``) and a draft model of the server
model's vocabulary (``draft-model``).  The others read the target itself (its layers, features or logits) and run
on the server (``/v1/completions`` with ``"speculative"``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator

import requests
import torch

from specdecode.config import Fixed, parse_draft_length
from specdecode.drafters import check_drafter_options, create_drafter
from specdecode.drafters.base import Drafter, DraftRequest
from specdecode.engine import request_seed
from specdecode.errors import SpecDecodeError
from specdecode.generator import GenerationResult, StreamEvent
from specdecode.models.loading import LoadedModel, load_model
from specdecode.models.quantize import draft_quantization
from specdecode.sampling_params import SamplingParams
from specdecode.stats import GenerationStats
from specdecode.types import Draft, StepFeedback, StepObservation

#: The drafters that run on this side: they need the token ids only (a draft model brings its own weights).
REMOTE_DRAFTERS = ("pld", "draft-model")
#: Draft tokens per step when none are asked for.
REMOTE_DRAFT_TOKENS = 5
#: A sampling draft model draws from this many of its most likely tokens (see the module docstring).
DRAFT_SUPPORT = 64
#: The request fields a generation may set (``/v1/verify``'s; ``max_new_tokens`` is sent as ``max_tokens``).
REQUEST_FIELDS = frozenset(
    {"temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "seed", "coupled", "stop"}
    | {"stop_token_ids", "ignore_eos", "min_tokens", "max_new_tokens"}
)


class RemoteGenerator:
    """Generates with a server's target: drafts locally with ``drafter``, sends each draft to ``url``'s
    ``/v1/verify``.  ``round_trip_delay_s``: added before every call (a slower network, as the measurements
    simulate it on one machine)."""

    def __init__(
        self,
        url: str,
        drafter: Drafter,
        *,
        api_key: str | None = None,
        num_draft_tokens: int = REMOTE_DRAFT_TOKENS,
        max_new_tokens: int = 128,
        timeout_s: float = 120.0,
        round_trip_delay_s: float = 0.0,
    ) -> None:
        self.url = url.rstrip("/")
        self.drafter = drafter
        self.num_draft_tokens = num_draft_tokens
        self.max_new_tokens = max_new_tokens
        self.round_trip_delay_s = round_trip_delay_s
        self.timeout_s = timeout_s
        self.http = requests.Session()  # one connection kept alive: a step's call opens none
        if api_key:
            self.http.headers["Authorization"] = f"Bearer {api_key}"

    def close(self) -> None:
        self.http.close()

    def generate(self, prompt: str | list[int], *, chat: bool | None = False, **params) -> GenerationResult:
        """The whole output (``chat`` and ``params`` as :meth:`stream_events`)."""
        for event in self.stream_events(prompt, chat=chat, **params):
            if event.result is not None:
                return event.result
        raise AssertionError("the last event carries the result")

    def stream_events(self, prompt: str | list[int], *, chat: bool | None = False, **params) -> Iterator[StreamEvent]:
        """Events as drafts are verified, the last one carrying the result.  ``prompt``: text (``chat``: through the
        server model's chat template; None: where it has one) or token ids; ``params``: ``max_new_tokens``,
        ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``presence_penalty``, ``frequency_penalty``, ``seed``,
        ``coupled``, ``stop``, ``stop_token_ids``, ``ignore_eos``, ``min_tokens``."""
        if unknown := set(params) - REQUEST_FIELDS:
            raise SpecDecodeError(f"unknown generation parameter(s) for a remote target: {', '.join(sorted(unknown))}")
        given = {key: value for key, value in params.items() if value is not None}
        max_new_tokens = given.pop("max_new_tokens", self.max_new_tokens)
        sampling = SamplingParams(
            **{key: given[key] for key in ("temperature", "top_p", "top_k", "seed", "coupled") if key in given}
        )
        stats = GenerationStats()
        started = time.perf_counter()
        answer = self._call("/v1/verify", {"prompt": prompt, "chat": chat, "max_tokens": max_new_tokens, **given})
        stats.prefill_s = time.perf_counter() - started
        session_id, prompt_ids = answer["id"], answer["prompt_token_ids"]
        drafting = self.drafter.session(
            DraftRequest(tuple(prompt_ids), sampling=_drawn_from(sampling), seed=request_seed(sampling.seed))
        )
        context = [*prompt_ids]
        generated: list[int] = []
        pieces: list[str] = []
        draft = Draft(tokens=[])
        try:
            while True:
                kept = answer["token_ids"]
                context.extend(kept)
                generated.extend(kept)
                accepted = answer["accepted"]
                stats.record_step(StepObservation(len(draft.tokens), len(draft.tokens), accepted, 0.0, 0.0))
                stats.new_tokens = len(generated)
                path = tuple(range(accepted))
                drafting.observe(context, StepFeedback(draft, path, torch.empty(0), asked=bool(draft.tokens)))
                pieces.append(answer["text"])
                if answer["finished"]:
                    break
                yield StreamEvent(text=answer["text"], token_ids=kept)
                tick = time.perf_counter()
                room = min(self.num_draft_tokens, max_new_tokens - len(generated) - 1)
                draft = drafting.propose(context, room) if room > 0 else Draft(tokens=[])
                draft = draft.limited(room, room) if draft.is_chain else Draft(tokens=[])
                stats.draft_s += time.perf_counter() - tick
                tick = time.perf_counter()
                answer = self._call(f"/v1/verify/{session_id}", _draft_body(draft))
                stats.verify_s += time.perf_counter() - tick
        finally:
            drafting.finish(context)
            if not answer["finished"]:  # the caller stopped early, or a call failed: free the server's slot
                self._close(session_id)
        stats.wall_s = time.perf_counter() - started
        # The server trims the tokens after a stop string from its count; so does the result.
        token_ids = generated[: answer["usage"]["completion_tokens"]]
        result = GenerationResult("".join(pieces), token_ids, len(prompt_ids), answer["finish_reason"], stats)
        yield StreamEvent(text=answer["text"], token_ids=answer["token_ids"], result=result)

    def _call(self, path: str, body: dict) -> dict:
        if self.round_trip_delay_s:
            time.sleep(self.round_trip_delay_s)
        try:
            reply = self.http.post(self.url + path, json=body, timeout=self.timeout_s)
        except requests.RequestException as exc:
            raise SpecDecodeError(f"cannot reach {self.url}: {exc}") from exc
        if reply.status_code != 200:
            raise SpecDecodeError(f"{self.url}{path} answered {reply.status_code}: {_error_message(reply)}")
        return reply.json()

    def _close(self, session_id: str) -> None:
        with contextlib.suppress(requests.RequestException):  # else the server frees it once it is idle too long
            self.http.delete(f"{self.url}/v1/verify/{session_id}", timeout=self.timeout_s)


def _drawn_from(sampling: SamplingParams) -> SamplingParams:
    """What the draft model draws from: the request's sampling, over its ``DRAFT_SUPPORT`` likeliest tokens when its
    draws are random (greedy and coupled drafts are deterministic: their distributions are never sent)."""
    if sampling.greedy or sampling.is_coupled:
        return sampling
    top_k = min(sampling.top_k, DRAFT_SUPPORT) if sampling.top_k else DRAFT_SUPPORT
    return dataclasses.replace(sampling, top_k=top_k)


def _draft_body(draft: Draft) -> dict:
    """A draft as ``/v1/verify`` takes it: its token ids, and each one's distribution (its tokens of non-zero
    probability, by id) when it was drawn at random."""
    body: dict = {"draft_token_ids": draft.tokens}
    if draft.probs is not None:
        rows = []
        for row in draft.probs.float().cpu():
            ids = row.nonzero().flatten()
            rows.append({str(token): value for token, value in zip(ids.tolist(), row[ids].tolist())})
        body["draft_probs"] = rows
    return body


def _error_message(reply: requests.Response) -> str:
    try:
        return reply.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return reply.text[:200]


def remote_drafter(name: str, draft_model: str | LoadedModel | None = None, **options) -> Drafter:
    """A drafter that runs on this side of a remote target (one of :data:`REMOTE_DRAFTERS`); a draft model named
    by ``draft_model`` is loaded here, quantized as ``--quantize-draft`` quantizes it by default."""
    if name not in REMOTE_DRAFTERS:
        raise SpecDecodeError(
            f"drafter {name!r} cannot draft for a remote target (it reads the target itself); "
            f"drafters that can: {', '.join(REMOTE_DRAFTERS)}"
        )
    if draft_model is not None:
        options["draft_model"] = draft_model
    check_drafter_options(name, **options)
    if name != "draft-model":
        return create_drafter(name, None, **options)  # type: ignore[arg-type]  # it never reads the target
    if draft_model is None:
        raise SpecDecodeError("--drafter draft-model needs --draft-model")
    draft = draft_model
    if not isinstance(draft, LoadedModel):
        draft = load_model(draft, quantize=draft_quantization(None, "none"))
    # The draft model is all this side has of a model: it stands in for the target, whose vocabulary it must share
    # (the server refuses ids outside its vocabulary).
    return create_drafter(name, draft, **{**options, "draft_model": draft})


def remote(
    url: str,
    drafter: str = "pld",
    *,
    api_key: str | None = None,
    num_draft_tokens: int | str = REMOTE_DRAFT_TOKENS,
    max_new_tokens: int = 128,
    round_trip_delay_s: float = 0.0,
    **drafter_options,
) -> RemoteGenerator:
    """A generator whose target is the server at ``url`` (``specdecode serve``): ``drafter`` drafts here and the
    server verifies (SLED).  ``drafter_options`` as in :func:`specdecode.load` (``draft_model="..."`` for
    ``draft-model``); ``num_draft_tokens``: a fixed draft length."""
    length = parse_draft_length(num_draft_tokens)
    if not isinstance(length, Fixed):
        raise SpecDecodeError(f"a remote target drafts a fixed number of tokens, got num_draft_tokens={length}")
    local = remote_drafter(drafter, **drafter_options)
    return RemoteGenerator(
        url,
        local,
        api_key=api_key,
        num_draft_tokens=length.k,
        max_new_tokens=max_new_tokens,
        round_trip_delay_s=round_trip_delay_s,
    )
