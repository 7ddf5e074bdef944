"""``/v1/verify``: the target verifies drafts that a client made on its own device (SLED, "Speculative LLM Decoding
for Edge Serving": small devices draft, one server verifies for many of them).

A client opens a session with ``POST /v1/verify`` (its prompt and sampling settings); each ``POST /v1/verify/{id}``
then carries its draft of the tokens that follow what the session holds, and is answered with the tokens the target
keeps: the accepted prefix of the draft and the target's own next token.  The opening call already takes a step
(with the draft it carries, or none), so every answer brings at least one token.  A draft is verified by the
engine's one step (:func:`specdecode.engine.step`), the code that verifies the server's own drafts: the output is
the target's own whoever drafted it — greedy, the text of plain decoding; seeded sampling (coupled), the text
``/v1/completions`` gives for that seed; unseeded sampling, rejection sampling against the distributions the client
sent (``draft_probs``; a draft without them is a deterministic proposal, which is lossless only if it was one).

Between calls the session's KV cache stays in a slot of the sessions' own pool.  The slot is freed when the output
ends, on ``DELETE /v1/verify/{id}``, when the client leaves before its answer is sent (without the answer it cannot
go on), and after ``--verify-idle-timeout`` seconds without a call.  Each call's step runs in the engine's thread
between two steps of the batch (:meth:`~specdecode.server.worker.EngineWorker.call`), in a forward of its own.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Annotated, Any

import torch
from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from specdecode.config import MAX_FIXED_DRAFT_LENGTH, GenerationConfig
from specdecode.draft_length.base import FixedLength
from specdecode.drafters.base import Drafter, DraftRequest, DraftSession
from specdecode.engine import MAX_DRAFT_MARGIN, Sequence, TargetVerifier, finish_sequence, read_prompt, start_sequence
from specdecode.engine import step as engine_step
from specdecode.errors import SpecDecodeError
from specdecode.generator import TextAssembler
from specdecode.models.base import KVPool
from specdecode.server.app import ApiError, Service
from specdecode.server.openapi import ERROR_STATUSES, ErrorResponse
from specdecode.server.protocol import BiasKey, Count, NonBlank, NonEmpty, Penalty, TokenId, finish_reason, usage
from specdecode.types import Draft, StepFeedback

_FIELDS = ConfigDict(extra="forbid", strict=True)  # a misspelt draft field would silently change what is verified
log = logging.getLogger("specdecode.server")
Weight = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]


class VerifyStepRequest(BaseModel):
    """A draft of the tokens after what the session holds.

    ``draft_probs``, for unseeded sampling: row i gives the distribution token i was drawn from, as weights by token
    id (normalised by their sum; ids left out have weight 0).  With rows, the draft is cut before the first token
    that its own row gives no weight (it cannot have been drawn from it) and after the last row."""

    model_config = _FIELDS
    draft_token_ids: Annotated[list[TokenId], Field(max_length=MAX_FIXED_DRAFT_LENGTH)] = []
    draft_probs: list[dict[BiasKey, Weight]] | None = None


class VerifyOpenRequest(VerifyStepRequest):
    """A session's prompt (text, or token ids), its sampling settings as in ``/v1/completions``, and a first draft
    (a client that sends token ids can draft before the first answer).  ``chat``: the prompt text as one user message
    of the model's chat template (true), as it is (false), or the template where the model has one (absent)."""

    model: str | None = None
    prompt: NonBlank | Annotated[list[TokenId], Field(min_length=1)]
    chat: bool | None = None
    max_tokens: Count | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    seed: int | None = None
    coupled: bool | None = None
    stop: NonEmpty | list[NonEmpty] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None


def verify_responses(opens: bool = False) -> dict[int | str, dict[str, Any]]:
    """The error answers of the ``/v1/verify`` routes (``opens``: the one that opens a session)."""
    statuses = {
        400: ERROR_STATUSES[400],
        401: ERROR_STATUSES[401],
        404: "The session does not exist: it never did, it ended, it was closed, or it stayed idle too long."
        + (" Or the request names a model this server does not serve." if opens else ""),
        409: "A call of this session is still being answered.",
    }
    if opens:
        statuses[429] = "As many sessions are open as the server keeps (`--max-verify-sessions`); retry later."
    statuses[500] = ERROR_STATUSES[500]
    return {status: {"model": ErrorResponse, "description": text} for status, text in statuses.items()}


def client_draft(body: VerifyStepRequest, vocab_size: int) -> Draft:
    """The body's draft, with its distributions as a tensor when it sent them (see :class:`VerifyStepRequest`)."""
    tokens = list(body.draft_token_ids)
    if outside := [token for token in tokens if token >= vocab_size]:
        why = f"draft_token_ids: token ids must be in [0, {vocab_size}), got {outside}"
        raise ApiError(400, why, param="draft_token_ids")
    if body.draft_probs is None:
        return Draft(tokens=tokens)
    rows = []
    for token, given in zip(tokens, body.draft_probs):
        weights = torch.zeros(vocab_size, dtype=torch.float64)
        ids = torch.tensor([int(key) for key in given], dtype=torch.long)  # "07" and "7" are one id
        weights.index_add_(0, ids, torch.tensor(list(given.values()), dtype=torch.float64))
        if not weights[token] > 0:
            break
        weights /= weights.max()  # no overflow in the sum, however large the weights
        rows.append(weights / weights.sum())
    if not rows:
        return Draft(tokens=[])
    return Draft(tokens=tokens[: len(rows)], probs=torch.stack(rows).float())


class ClientDraftSession(DraftSession):
    """Proposes the draft its client sent for this step, and keeps how much of it verification accepted."""

    def __init__(self) -> None:
        self.draft = Draft(tokens=[])
        self.accepted = 0

    def propose(self, context: list[int], max_tokens: int) -> Draft:
        return self.draft.limited(max_tokens, max_tokens)

    def observe(self, context: list[int], feedback: StepFeedback) -> None:
        self.accepted = feedback.num_accepted


class ClientDrafts(Drafter):
    """Drafts nothing here: each session proposes what its client sent."""

    name = "client"

    def session(self, request: DraftRequest) -> ClientDraftSession:
        return ClientDraftSession()


@dataclass(eq=False)
class VerifySession:
    id: str
    sequence: Sequence
    text: TextAssembler
    touched: float = field(default_factory=time.monotonic)
    busy: bool = False

    @property
    def drafts(self) -> ClientDraftSession:
        return self.sequence.session  # type: ignore[return-value]


class VerifySessions:
    """The open sessions (the event loop's), their pool of cache slots and their sequences (the engine thread's)."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.open: dict[str, VerifySession] = {}
        self.opening = 0  # sessions whose prompt is being read: they count against the limit already
        self.pool: KVPool | None = None  # made at the first session, in the engine's thread
        self.drafter = ClientDrafts(service.generator.target)
        self.verifier = TargetVerifier(service.generator.target.backend)
        self.expiring: asyncio.Task | None = None

    @property
    def limit(self) -> int:
        return self.service.config.max_verify_sessions

    # -- the event loop ------------------------------------------------------------------------------------------
    async def start(self, body: VerifyOpenRequest) -> tuple[VerifySession, list[int]]:
        """A new session for ``body`` with its prompt read; its prompt's token ids."""
        config = self.service.config
        if body.model is not None and body.model != config.model_name:
            why = f"model {body.model!r} does not exist; this server serves {config.model_name!r}"
            raise ApiError(404, why, kind="not_found_error", param="model")
        if len(self.open) + self.opening >= self.limit:
            why = f"{len(self.open) + self.opening} verification sessions are open, as many as this server keeps"
            raise ApiError(429, why, kind="rate_limit_error", headers={"Retry-After": "1"})
        generator = self.service.generator
        try:
            prompt_ids = generator.encode_prompt(body.prompt, chat=body.chat)
            room = generator.target.backend.max_context - len(prompt_ids)
            generation = generator.config_for(
                max_new_tokens=min(body.max_tokens, room) if body.max_tokens else room,
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=max(body.top_k, 0) if body.top_k is not None else None,
                min_p=body.min_p,
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                seed=body.seed,
                coupled=body.coupled,
                stop=body.stop,
                stop_token_ids=body.stop_token_ids,
                ignore_eos=body.ignore_eos,
                min_tokens=min(body.min_tokens, room) if body.min_tokens is not None else None,
                verifier="exact",
            )
        except SpecDecodeError as exc:
            raise ApiError(400, str(exc)) from exc
        self.opening += 1
        try:
            sequence = await self.service.worker.call(lambda: self._begin(prompt_ids, generation))
        except Exception as exc:  # a bug
            log.exception("opening a verification session failed")
            raise ApiError(500, "internal error while reading the prompt", kind="server_error") from exc
        finally:
            self.opening -= 1
        session = VerifySession(
            f"verify-{secrets.token_hex(16)}", sequence, TextAssembler(generator, prompt_ids, generation)
        )
        self.open[session.id] = session
        if self.expiring is None or self.expiring.done():
            self.expiring = asyncio.ensure_future(self._expire())
        return session, prompt_ids

    def take(self, session_id: str) -> VerifySession:
        session = self.open.get(session_id)
        if session is None:
            raise ApiError(404, f"verification session {session_id!r} does not exist", kind="not_found_error")
        if session.busy:
            raise ApiError(409, f"verification session {session_id!r} is answering another call")
        return session

    def draft(self, body: VerifyStepRequest) -> Draft:
        return client_draft(body, self.service.generator.target.backend.vocab_size)

    async def advance(self, request: Request, session: VerifySession, draft: Draft) -> dict:
        """Verify ``draft`` in the session; the answer, or the session closed when the client left."""
        session.busy = True
        try:
            answer = await self.service.worker.call(lambda: self._step(session, draft))
        except Exception as exc:  # a bug: this session cannot go on
            log.exception("verifying a client's draft failed")
            session.busy = False
            await self.close(session)
            raise ApiError(500, "internal error while verifying", kind="server_error") from exc
        finally:
            session.busy = False
            session.touched = time.monotonic()
        if answer["finished"]:
            self.open.pop(session.id, None)
        elif await request.is_disconnected():  # nobody will ever send this session's next draft
            await self.close(session)
            raise ApiError(499, "client disconnected")
        return {"id": session.id, "object": "verification", "model": self.service.config.model_name, **answer}

    async def close(self, session: VerifySession) -> None:
        if self.open.get(session.id) is not session:  # closed already (expired while a DELETE waited, say)
            return
        del self.open[session.id]
        await self.service.worker.call(lambda: finish_sequence(session.sequence))

    async def _expire(self) -> None:
        """Close the sessions idle longer than the timeout, until none is open."""
        timeout = self.service.config.verify_idle_s
        while self.open:
            await asyncio.sleep(min(1.0, timeout / 4))
            now = time.monotonic()
            for session in list(self.open.values()):
                if not session.busy and now - session.touched > timeout:
                    await self.close(session)

    # -- the engine's thread -------------------------------------------------------------------------------------
    def _begin(self, prompt_ids: list[int], config: GenerationConfig) -> Sequence:
        target = self.service.generator.target.backend
        if self.pool is None:
            self.pool = target.new_pool()
        longest = len(prompt_ids) + config.max_new_tokens + MAX_DRAFT_MARGIN
        self.pool.reserve(self.limit, min(longest, target.max_context))
        policy = FixedLength(MAX_FIXED_DRAFT_LENGTH)  # as deep as the client drafted: the engine cuts it to the room
        eos_ids = self.service.generator.eos_ids
        sequence = start_sequence(target, self.drafter, prompt_ids, config, eos_ids, policy, self.pool.allocate())
        try:
            read_prompt(target, sequence)
        except Exception:
            finish_sequence(sequence)
            raise
        return sequence

    def _step(self, session: VerifySession, draft: Draft) -> dict:
        """One step of the session's sequence with the client's draft; the answer's fields (the slot freed when the
        output ends)."""
        sequence, drafts, text = session.sequence, session.drafts, session.text
        drafts.draft, drafts.accepted = draft, 0
        new_tokens: list[int] = []
        if not sequence.done:
            (new_tokens,) = engine_step([sequence], self.verifier)
        piece = text.add(new_tokens).text
        finished = sequence.done or text.stopped
        answer = {
            "token_ids": new_tokens,
            # As the stats count them: a step cut short by the end of the output keeps its last token as its own.
            "accepted": drafts.accepted if len(new_tokens) > drafts.accepted else max(len(new_tokens) - 1, 0),
            "verified": len(draft.tokens),
            "text": piece,
            "finished": finished,
            "finish_reason": None,
        }
        if finished:
            answer["text"] += text.finish(sequence.outcome).text
            answer["finish_reason"] = finish_reason("stop" if text.stopped else sequence.outcome.finish_reason)
            finish_sequence(sequence)
        answer["usage"] = usage(len(sequence.prompt_ids), len(text.generated))
        return answer


def add_verify_routes(app: FastAPI, service: Service) -> VerifySessions:
    """The ``/v1/verify`` routes on ``app``; their sessions."""
    sessions = VerifySessions(service)

    @app.post("/v1/verify", responses=verify_responses(opens=True))
    async def open_session(request: Request, body: VerifyOpenRequest):
        """Open a verification session with a prompt and verify its first draft (SLED: the client drafts, the
        server verifies).  The answer also carries the prompt's token ids, which the client drafts after."""
        draft = sessions.draft(body)  # a bad draft opens no session
        session, prompt_ids = await sessions.start(body)
        return {**await sessions.advance(request, session, draft), "prompt_token_ids": prompt_ids}

    @app.post("/v1/verify/{session_id}", responses=verify_responses())
    async def verify(request: Request, session_id: str, body: VerifyStepRequest):
        """Verify a draft of the tokens after what the session holds: the tokens the target keeps (the accepted
        draft tokens and its own next token), their text, and whether the output has ended."""
        session = sessions.take(session_id)
        return await sessions.advance(request, session, sessions.draft(body))

    @app.delete("/v1/verify/{session_id}", responses=verify_responses())
    async def close(session_id: str):
        """Close a verification session: its cache slot is freed."""
        await sessions.close(sessions.take(session_id))
        return {"id": session_id, "object": "verification", "deleted": True}

    return sessions
