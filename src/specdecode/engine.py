"""The speculative decoding loop, batch-shaped: propose → verify in one target forward → accept → roll back.

Invariant between steps, for every sequence: its KV cache holds ``context[:-1]``; the last context
token (the one the target itself chose last step) is fed together with the draft.  One forward over
``[context[-1], d_1 .. d_k]`` gives k+1 rows of logits: row i predicts what follows d_i (row 0 what
follows the context).  The verifier keeps n <= k draft tokens and supplies one more token of its own,
the cache is cropped to ``context + d_1..d_n`` and the loop continues.  With no draft this is exactly
plain autoregressive decoding, which is why ``--drafter none`` is the baseline.

Which verifier decides (:class:`TargetVerifier`, per sequence) is the request's choice, asked of the registry
(:mod:`specdecode.verify.registry`).  By default ``exact`` (:mod:`specdecode.verify.exact`): greedy matching at
temperature 0; with sampling and a seed, Gumbel-max coupled verification (:mod:`specdecode.verify.coupled`: the
tokens are a function of the seed and the target alone, so a seed gives the same text with every drafter and
draft length, ``auto`` included, and with none); with sampling and no seed, or ``coupled=False``, rejection
sampling (:mod:`specdecode.verify.rejection`), which keeps a sampling drafter's guesses a little more often but
whose text depends on what was drafted.  All three are exact.  A request may instead choose a relaxed, lossy
verifier (``verifier="fly"``, ``"typical"`` or ``"judge"``), which also keeps some mismatches; its stats say
``lossless: false``.

:func:`step` is the whole step for a batch of sequences, and the only one: the single-sequence
generator (:func:`speculative_decode`), the batched engine (:mod:`specdecode.batch_engine`) and the policy replay
(``bench/replay.py``, which swaps the target for a known output) all run it.  In a batch each sequence
keeps its own draft, depth, sampling, RNG, accepted length and cache slot; the forward is ragged (each
sequence's own positions and mask, nothing padded), so what one sequence accepts never depends on
what the others drafted — which is what makes batched greedy output equal solo greedy output.

A prompt is read into the cache in chunks at fixed offsets (every ``prefill_chunk`` tokens from its start,
:class:`PromptChunk`): alone, one forward per chunk; in a batch, chunks ride in the verification forward of the
sequences already decoding (:func:`step`'s ``chunks``), so those keep stepping while a prompt is read.  A chunk's
rows are computed by calls that depend on that chunk alone, so a prompt's cache, and so every later token, is the
same whoever else shares its forwards.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from specdecode.batch_plan import plan_batch
from specdecode.clock import now
from specdecode.config import GenerationConfig
from specdecode.draft_length.base import DraftLengthPolicy, PolicySource
from specdecode.draft_length.factory import make_policy
from specdecode.drafters.base import Drafter, DraftRequest, DraftSession
from specdecode.grammar import GrammarFailure, SequenceGrammar, row_masks
from specdecode.logits_processing import RowHistory, request_processes
from specdecode.models.base import CausalLM, ForwardOutput, KVCache, SequenceInput
from specdecode.stats import GenerationStats
from specdecode.types import Draft, StepFeedback, StepObservation, TokenLogprob, Verdict
from specdecode.verify.base import TargetRows

Clock = Callable[[], float]

log = logging.getLogger(__name__)

#: Cache positions beyond a request's last token that a final draft may occupy during verification.
MAX_DRAFT_MARGIN = 64

#: Prompt tokens read per forward.  A forward's arithmetic grows with its rows while its reading of the weights does
#: not, so a longer chunk saves a prompt only weight reads, a small part of a many-row forward; in a batch every
#: running sequence's step carries a chunk's whole cost.  128 keeps a step that reads one about as wide as the
#: widest verification forward of a batch of 8 (8 sequences x 16 drafted + 1 rows).  Batched and solo decoding
#: read a prompt in the same chunks (what batch invariance needs), so the size belongs to the numerics: another
#: size may break a near-tie differently, alone and in a batch alike.
PREFILL_CHUNK = 128


@dataclass
class DecodeOutcome:
    """Filled in while :func:`speculative_decode` runs; complete once the iterator is exhausted."""

    stats: GenerationStats = field(default_factory=GenerationStats)
    # "length" (max tokens or context full), "eos", "stop": the request's grammar admits nothing more, or "error"
    finish_reason: str = "length"
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per generated token, when the config asks
    error: str | None = None  # what failed, when the request's grammar failed (a bug): it ended, the batch went on


def request_seed(seed: int | None) -> int:
    """The seed a request's random draws come from: the user's, or a fresh one (never the global RNG)."""
    return seed if seed is not None else secrets.randbits(63)


@dataclass
class Sequence:
    """One request being decoded: everything the step needs that belongs to it alone."""

    prompt_ids: list[int]
    config: GenerationConfig
    stop_ids: frozenset[int]
    session: DraftSession
    length_policy: DraftLengthPolicy
    generator: torch.Generator  # rejection sampling's draws (CPU: it reads probabilities on the host)
    max_context: int
    cache: KVCache | None = None  # None when no target runs (replay)
    context: list[int] = field(default_factory=list)
    outcome: DecodeOutcome = field(default_factory=DecodeOutcome)
    done: bool = False
    started: float = field(default_factory=now)
    step_end: float = 0.0
    prefill_chunk: int = PREFILL_CHUNK
    read: int = 0  # prompt tokens in the cache (all but the last, once read)
    prompt_hidden: list[torch.Tensor] = field(default_factory=list)  # the chunks' features, for the session
    grammar: SequenceGrammar | None = None  # the request's constraint: its matcher over the accepted tokens
    grammar_masks: torch.Tensor | None = None  # the grammar's mask at each row of this step's verification

    def __post_init__(self) -> None:
        self.context = self.context or list(self.prompt_ids)
        self.step_end = self.started

    @property
    def reading(self) -> bool:
        """Whether prompt tokens are still to be read into the cache before the first step."""
        return self.read < len(self.prompt_ids) - 1

    @property
    def choices_suffice(self) -> bool:
        """Whether verifying this sequence reads each row's greedy choice and nothing else: greedy, its verifier reads
        the choices only, no processing of the logits (bias, penalties, ``min_tokens``, a grammar), no log-
        probabilities, and a drafting session that does not read the target's logits.  Its forward may then compute
        the choices without the logits (:attr:`SequenceInput.choices_only`)."""
        config = self.config
        return (
            config.sampling.greedy
            and config.verifier.method.greedy_reads_choices_only
            and config.logprobs is None
            and not request_processes(config.sampling, self.grammar is not None, config.min_tokens, self.stop_ids)
            and not self.session.reads_target_logits
        )

    def next_chunk(self) -> PromptChunk:
        """The prompt's next chunk to read: they end every ``prefill_chunk`` tokens from its start (a prompt that took
        a prefix ending inside a chunk from the prefix cache reads the rest of that chunk first)."""
        end = (self.read // self.prefill_chunk + 1) * self.prefill_chunk
        return PromptChunk(self, self.read, min(end, len(self.prompt_ids) - 1))

    @property
    def stats(self) -> GenerationStats:
        return self.outcome.stats

    @property
    def room(self) -> int:
        """Draft tokens this sequence may still use: a step adds at most depth + 1 tokens."""
        return self.config.max_new_tokens - self.stats.new_tokens - 1

    @property
    def generated(self) -> list[int]:
        return self.context[len(self.prompt_ids) :]


@dataclass
class PromptChunk:
    """Prompt tokens ``[start, stop)`` of a sequence, read into its cache by one forward."""

    sequence: Sequence
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start

    def forward_input(self) -> SequenceInput:
        """No logits (the prompt's last token is fed with the first draft), the features its session asks for,
        and no row invariance (the chunk is read alike alone and in a batch: ``SequenceInput.invariant``)."""
        seq = self.sequence
        tokens = torch.tensor(seq.prompt_ids[self.start : self.stop], dtype=torch.long)
        return SequenceInput(
            tokens, seq.cache, logits_rows=_NO_ROWS, hidden_layers=seq.session.hidden_layers, invariant=False
        )

    def read(self, out: ForwardOutput) -> None:
        """The chunk is in the cache; after the last one the sequence is ready for its first step."""
        seq = self.sequence
        seq.read = self.stop
        if seq.session.hidden_layers:
            seq.prompt_hidden.append(out.hidden)
        if not seq.reading:
            _prompt_read(seq)


_NO_ROWS = torch.empty(0, dtype=torch.long)


@dataclass
class Checked:
    """What verifying one sequence's draft decided, and the logits it read (for the drafter)."""

    verdict: Verdict
    logits: torch.Tensor
    hidden: torch.Tensor | None = None  # the features the sequence's drafting session asked for
    logprobs: list[TokenLogprob] | None = None  # the emitted tokens', when the request asks for them


class Verifier(Protocol):
    def __call__(self, sequences: list[Sequence], drafts: list[Draft], chunks: list[PromptChunk]) -> list[Checked]:
        """Verify every sequence's draft (one target forward for all, reading ``chunks`` of other sequences'
        prompts too) and leave each cache holding the context plus the accepted path."""


def verification_input(
    context: list[int],
    draft: Draft,
    cache: KVCache,
    hidden_layers: tuple[int, ...] = (),
    choices_only: bool = False,
) -> SequenceInput:
    """One target forward's input for a sequence: the last context token and the draft.

    A chain needs nothing but the tokens (positions follow the cache, the causal mask does the rest).  A
    tree also gets depth-based positions and a mask that lets each node see only the context, itself and
    its ancestors."""
    tokens = torch.tensor([context[-1], *draft.tokens], dtype=torch.long)
    if draft.is_chain:
        return SequenceInput(tokens, cache, hidden_layers=hidden_layers, choices_only=choices_only)
    base = len(context) - 1
    positions = torch.tensor([base, *(base + d for d in draft.depths())], dtype=torch.long)
    return SequenceInput(
        tokens,
        cache,
        positions=positions,
        tree_mask=ancestor_mask(draft),
        hidden_layers=hidden_layers,
        choices_only=choices_only,
    )


def ancestor_mask(draft: Draft) -> torch.Tensor:
    """[nodes + 1, nodes + 1] bool; entry (i, j): row i may attend to row j (row 0 = last context token)."""
    n = len(draft.tokens)
    mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    mask[:, 0] = True  # everyone sees the last context token (and, via the cache, the rest)
    for node, parent in enumerate(draft.parent_list):
        row = node + 1
        mask[row] = mask[parent + 1]
        mask[row, row] = True
    return mask


class TargetVerifier:
    """The real verifier: one ragged target forward over every sequence's draft, then per sequence the verifier
    its request chose (:mod:`specdecode.verify.registry`), and each cache compacted to its accepted path."""

    def __init__(self, target: CausalLM) -> None:
        self.target = target

    def __call__(self, sequences: list[Sequence], drafts: list[Draft], chunks: list[PromptChunk]) -> list[Checked]:
        inputs = [
            verification_input(seq.context, draft, seq.cache, self._hidden_layers(seq), seq.choices_suffice)
            for seq, draft in zip(sequences, drafts)
        ]
        outputs = self.target.forward_batch(inputs + [chunk.forward_input() for chunk in chunks])
        for chunk, out in zip(chunks, outputs[len(inputs) :]):
            chunk.read(out)
        checked = []
        for seq, draft, out in zip(sequences, drafts, outputs):
            sampling, verifier = seq.config.sampling, seq.config.verifier
            hidden, final = out.hidden, None
            if verifier.method.reads_final_hidden:  # recorded last (_hidden_layers): split off the session's
                size = self.target.hidden_size
                final, hidden = hidden[:, -size:], hidden[:, :-size] if seq.session.hidden_layers else None
            rows = TargetRows(
                out.logits,
                sampling,
                sampling.seed,
                first_position=len(seq.context),
                generator=seq.generator,
                final_hidden=final,
                target_name=self.target.name,
                choices=out.choices,
                history=RowHistory(
                    seq.context, len(seq.prompt_ids), draft, seq.stop_ids, seq.config.min_tokens, seq.grammar_masks
                ),
            )
            verdict = verifier.verify(rows, draft)
            top = seq.config.logprobs
            logprobs = rows.logprobs(draft, verdict, top) if top is not None else None
            # Keep the last context token's entry and the accepted nodes' entries (rows 1 + node).
            seq.cache.keep(len(seq.context) - 1, [0, *(1 + node for node in verdict.path)])
            checked.append(Checked(verdict, out.logits, hidden, logprobs))
        return checked

    def _hidden_layers(self, seq: Sequence) -> tuple[int, ...]:
        """The hidden states the forward records for ``seq``: its drafting session's, plus the final one when its
        verifier reads it (last, so that it can be split off again)."""
        layers = seq.session.hidden_layers
        return (*layers, self.target.num_layers) if seq.config.verifier.method.reads_final_hidden else layers


def _grammar_draft(seq: Sequence, grammar: SequenceGrammar, draft: Draft, room: int) -> tuple[Draft, bool]:
    """The draft a constrained sequence verifies, and whether it is still the drafter's own (cut at its end at most:
    what :attr:`StepFeedback.asked` tells the session).

    Nodes the grammar refuses are cut (a chain at its first such token, a tree's branches below one): the target
    gives them probability 0, so verifying them would spend forward width on tokens never kept.  Where the grammar
    admits one continuation only, its tokens are drafted for free (confidence 1): the drafter's own chain is kept
    when it is a point-mass chain that begins with them (a decision on what the context alone determines, so it
    biases nothing), and whatever the grammar forces after that chain (a value's closing quote, then the next key)
    follows it, with the bytes llguidance holds back (:meth:`SequenceGrammar.forced_after`)."""
    kept = grammar.valid_nodes(draft)
    own = kept == list(range(len(kept)))
    draft = draft.keep(kept)
    point_mass_chain = draft.is_chain and draft.probs is None
    forced = grammar.forced()
    if forced and not (point_mass_chain and draft.tokens[: len(forced)] == forced):
        draft, own, point_mass_chain = Draft(tokens=[]), False, True
    if point_mass_chain and (more := grammar.forced_after(draft.tokens)):
        confidence = draft.confidence if draft.tokens else []
        draft = Draft(
            tokens=[*draft.tokens, *more],
            confidence=[*confidence, *[1.0] * len(more)] if confidence is not None else None,
            setup_s=draft.setup_s,
        )
        own = False
    return draft.limited(seq.max_context - len(seq.context), room), own


def _mask_rows(constrained: list[tuple[Sequence, Draft]]) -> list[Draft]:
    """Leave in each constrained sequence's ``grammar_masks`` its rows' masks, computed for the batch together; return
    its draft with a sampled draft's distributions renormalised over the tokens the grammar admits at each node's
    parent: the kept nodes were drawn from exactly that, which keeps rejection sampling exact.

    Where the batch's masks fail, each sequence's are computed alone, and a sequence whose grammar fails then ends
    (its draft emptied): the others' masks are the same either way."""
    try:
        masks = row_masks([(seq.grammar, draft) for seq, draft in constrained])  # type: ignore[misc]
    except Exception:  # whose grammar failed is found alone, below
        masks = []
        for seq, draft in constrained:
            try:
                (rows,) = row_masks([(seq.grammar, draft)])  # type: ignore[list-item]
            except Exception as exc:  # a bug in one request's grammar ends that request alone
                _grammar_failed(seq, exc)
                rows = None
            masks.append(rows)
    drafts = []
    for (seq, draft), rows in zip(constrained, masks):
        if rows is None:
            drafts.append(Draft(tokens=[]))
            continue
        seq.grammar_masks = rows
        if draft.probs is not None:
            parents = [parent + 1 for parent in draft.parent_list]
            admitted = rows[parents, : draft.probs.shape[1]].to(draft.probs.device)
            draft = dataclasses.replace(draft, probs=_admitted(draft.probs, admitted))
        drafts.append(draft)
    return drafts


def _grammar_failed(seq: Sequence, error: Exception) -> None:
    """End ``seq`` for a failure of its grammar (a bug): its step still rides in the batch's forward, unmasked, and
    nothing of it is output; the other sequences go on."""
    log.error("a request's grammar failed; ending that request", exc_info=error)
    seq.outcome.finish_reason = "error"
    seq.outcome.error = f"the request's grammar failed: {error}"
    seq.grammar_masks = None


def _failed(seq: Sequence) -> bool:
    return seq.outcome.error is not None


def _admitted(probs: torch.Tensor, admitted: torch.Tensor) -> torch.Tensor:
    """Each row of a draft's distributions restricted to the tokens the grammar admits at its node's parent: given
    that the node was kept, what it was drawn from."""
    kept = probs * admitted
    return kept / kept.sum(dim=-1, keepdim=True)


def _plan_confidences(early: Draft | None) -> list[float] | None:
    """What the plan may know of a draft made before it: its confidences (none for an empty draft), or None
    when there is no such draft, it is a tree, or it reports no confidence."""
    if early is None or not early.is_chain:
        return None
    return early.confidence if early.tokens else []


def step(
    sequences: list[Sequence], verifier: Verifier, clock: Clock = now, chunks: list[PromptChunk] | None = None
) -> list[list[int]]:
    """One speculative step for every (unfinished) sequence: draft, verify all drafts in one forward,
    accept.  Returns the tokens each sequence gained (never empty), in order; marks finished ones done.
    ``chunks`` of prompts being read (other sequences') ride in the same forward."""
    chunks = chunks or []
    limits = [max(seq.room, 0) for seq in sequences]
    count = len(sequences)
    early: list[Draft | None] = [None] * count
    asked = [False] * count  # propose ran (StepFeedback.asked)
    draft_times, idle_times = [0.0] * count, [0.0] * count
    # Lookups draft before the plan, as deep as allowed, so that it can weigh each draft's confidences.
    for index, (seq, limit) in enumerate(zip(sequences, limits)):
        if seq.session.proposes_first and limit > 0:
            tick = clock()
            early[index] = seq.session.propose(seq.context, limit)
            asked[index] = True
            draft_times[index], idle_times[index] = clock() - tick, tick - seq.step_end
    depths = plan_batch([seq.length_policy for seq in sequences], limits, [_plan_confidences(d) for d in early])
    drafts = []
    for index, (seq, max_depth, draft) in enumerate(zip(sequences, depths, early)):
        tick = clock()
        if draft is None:
            idle_times[index] = tick - seq.step_end
            asked[index] = max_depth > 0
            draft = seq.session.propose(seq.context, max_depth) if max_depth > 0 else Draft(tokens=[])
            if draft.confidence is not None and draft.is_chain:
                max_depth = min(max_depth, seq.length_policy.keep_length(draft.confidence))
        draft = draft.limited(seq.max_context - len(seq.context), max_depth)
        if seq.grammar is not None:
            try:
                draft, own = _grammar_draft(seq, seq.grammar, draft, limits[index])
            except Exception as exc:  # a bug in one request's grammar ends that request alone
                _grammar_failed(seq, exc)
                draft, own = Draft(tokens=[]), False
            asked[index] = asked[index] and own
        drafts.append(draft)
        draft_times[index] += clock() - tick
    constrained = [index for index, seq in enumerate(sequences) if seq.grammar is not None and not _failed(seq)]
    if constrained:
        tick = clock()
        masked = _mask_rows([(sequences[index], drafts[index]) for index in constrained])
        share = (clock() - tick) / len(constrained)
        for index, draft in zip(constrained, masked):
            drafts[index] = draft
            draft_times[index] += share
    tick = clock()
    checked = verifier(sequences, drafts, chunks)
    verify_s = clock() - tick
    width = sum(len(draft.tokens) + 1 for draft in drafts) + sum(chunk.size for chunk in chunks)
    gained = []
    for seq, draft, check, draft_s, idle_s, proposed in zip(sequences, drafts, checked, draft_times, idle_times, asked):
        stats, config, verdict = seq.stats, seq.config, check.verdict
        accepted = [draft.tokens[node] for node in verdict.path]
        new_tokens = [*accepted, verdict.next_token][: config.max_new_tokens - stats.new_tokens]
        grammar_done = False
        if seq.grammar is not None and not _failed(seq):
            # The output ends where the grammar completes or reaches a dead end, however many tokens the step
            # verified past it: so a request ends at the same token, for the same reason, whatever was drafted.
            try:
                new_tokens = new_tokens[: seq.grammar.advance(new_tokens)]
                grammar_done = seq.grammar.complete
            except Exception as exc:  # a bug in one request's grammar ends that request alone
                _grammar_failed(seq, exc)
            stats.grammar_s = seq.grammar.mask_s
        if _failed(seq):  # nothing of its step is output (a failure before verifying left it unmasked)
            seq.done = True
            gained.append([])
            continue
        observation = StepObservation(
            depth=draft.depth,
            nodes=len(draft.tokens),
            accepted=verdict.num_accepted,
            draft_s=draft_s,
            verify_s=verify_s,
            overhead_s=idle_s,
            width=width,
            batch=len(sequences),
            confidence=tuple(draft.confidence) if draft.is_chain and draft.confidence is not None else None,
            setup_s=min(draft.setup_s, draft_s),
            context_tokens=len(seq.context),
        )
        seq.length_policy.observe(observation)
        # A stop token ends the request once min_tokens are out; exact verifiers never emit one sooner (the processing
        # gives it probability 0), a lossy one might keep a drafted one, which then does not end it.
        ends = [config.ends_at(token, stats.new_tokens + i + 1, seq.stop_ids) for i, token in enumerate(new_tokens)]
        eos_at = ends.index(True) if any(ends) else None
        if eos_at is not None:
            new_tokens = new_tokens[: eos_at + 1]
            seq.outcome.finish_reason = "eos"
        elif grammar_done:
            seq.outcome.finish_reason = "stop"
        # Stats count what was kept: draft tokens cut by EOS or the token limit are not "accepted".
        stats.record_step(observation, kept=len(new_tokens) - 1 if len(new_tokens) <= len(accepted) else None)
        stats.draft_s += draft_s
        stats.verify_s += verify_s
        stats.forward_s += verify_s
        seq.context.extend(new_tokens)
        if check.logprobs is not None:
            seq.outcome.logprobs.extend(check.logprobs[: len(new_tokens)])
        stats.new_tokens += len(new_tokens)
        tock = clock()
        feedback = StepFeedback(draft, verdict.path, check.logits, check.hidden, asked=proposed)
        seq.session.observe(seq.context, feedback)
        seq.step_end = clock()
        stats.draft_s += seq.step_end - tock
        stats.wall_s = seq.step_end - seq.started
        seq.done = (
            eos_at is not None
            or grammar_done
            or stats.new_tokens >= config.max_new_tokens
            or len(seq.context) >= seq.max_context
        )
        gained.append(new_tokens)
    return gained


def start_sequence(
    target: CausalLM,
    drafter: Drafter,
    prompt_ids: list[int],
    config: GenerationConfig,
    eos_ids: frozenset[int],
    policy: PolicySource,
    cache: KVCache,
    outcome: DecodeOutcome | None = None,
    prefill_chunk: int = PREFILL_CHUNK,
    grammar: SequenceGrammar | None = None,
) -> Sequence:
    """Open the request's drafting session; its prompt is then read into ``cache`` chunk by chunk
    (:meth:`Sequence.next_chunk`: by :func:`read_prompt` alone, or riding in a batch's steps).  ``grammar``: the
    matcher of ``config.constraint`` (:meth:`specdecode.grammar.GrammarCompiler.start`), required with one."""
    if (grammar is None) != (config.constraint is None):
        raise ValueError("a constrained request needs its grammar's matcher, and only a constrained one has one")
    if not isinstance(prefill_chunk, int) or prefill_chunk < 1:
        raise ValueError(f"prefill chunk must be a positive integer, got {prefill_chunk!r}")
    started = now()
    seed = request_seed(config.sampling.seed)
    generator = torch.Generator()
    generator.manual_seed(seed % 2**64)  # any integer: torch takes [-2**63, 2**64), negatives wrapped the same way
    length_policy = policy.fork()
    session = drafter.session(
        DraftRequest(
            prompt_ids=tuple(prompt_ids),
            sampling=config.sampling,
            seed=seed,
            stop_rule=length_policy.should_stop,
            target_cache=cache,
        )
    )
    seq = Sequence(
        prompt_ids=list(prompt_ids),
        config=config,
        stop_ids=config.stop_ids(eos_ids),
        session=session,
        length_policy=length_policy,
        generator=generator,
        max_context=target.max_context,
        cache=cache,
        outcome=outcome or DecodeOutcome(),
        started=started,
        prefill_chunk=prefill_chunk,
        grammar=grammar,
    )
    seq.stats.verifier = config.verifier.name
    seq.done = len(prompt_ids) >= target.max_context
    if grammar is not None and grammar.complete:  # a grammar of the empty string alone: nothing to generate
        seq.done, seq.outcome.finish_reason = True, "stop"
    if not seq.reading and not seq.done:
        _prompt_read(seq)
    return seq


def _prompt_read(seq: Sequence) -> None:
    """The prompt but its last token is in the cache: hand the session its features and start the clock of
    the first step."""
    if seq.prompt_hidden:  # a session with hidden_layers, and a prompt of more than one token
        seq.session.observe_prompt(torch.cat(seq.prompt_hidden))
        seq.prompt_hidden = []
    seq.stats.prefill_s = seq.stats.forward_s = now() - seq.started
    # Before the first step's clock starts: the policy may measure what verifying after so long a prompt costs.
    seq.length_policy.begin(seq.stats.prefill_s, len(seq.prompt_ids))
    seq.step_end = now()


def adopt_prompt_prefix(seq: Sequence, source: KVCache, length: int) -> bool:
    """Start ``seq``'s prompt with the first ``length`` tokens' keys and values from ``source``, another prompt's
    cache that holds them bitwise as reading them would (:mod:`specdecode.prefix_cache`), so that they are not read
    again.  Only before any of the prompt is read, and not for a session that reads the prompt's features."""
    if length <= 0 or seq.read or not seq.reading or seq.session.hidden_layers or seq.cache is None:
        return False
    if not seq.cache.adopt_prefix(source, length):
        return False
    seq.read = length
    seq.stats.cached_tokens = length
    if not seq.reading:
        _prompt_read(seq)
    return True


def read_prompt(target: CausalLM, seq: Sequence) -> None:
    """Read the rest of ``seq``'s prompt alone, one forward per chunk."""
    while seq.reading:
        chunk = seq.next_chunk()
        chunk.read(target.forward_batch([chunk.forward_input()])[0])


def finish_sequence(seq: Sequence) -> None:
    """Close the drafting session and give the cache slot back (finished or cancelled alike)."""
    seq.session.finish(seq.context)
    if seq.cache is not None:
        seq.cache.release()
        seq.cache = None
    seq.stats.wall_s = now() - seq.started


def speculative_decode(
    target: CausalLM,
    drafter: Drafter,
    prompt_ids: list[int],
    config: GenerationConfig,
    eos_ids: frozenset[int] = frozenset(),
    outcome: DecodeOutcome | None = None,
    draft_length: PolicySource | None = None,
    prefill_chunk: int = PREFILL_CHUNK,
    grammar: SequenceGrammar | None = None,
) -> Iterator[list[int]]:
    """Decode one sequence: yield the tokens accepted at each step (never empty) until EOS, max tokens or a
    full context.

    ``draft_length`` decides the depth of each draft (default: from ``config.num_draft_tokens``); pass
    one policy object across requests to let an adaptive policy keep what it learned.  ``prefill_chunk``: the
    prompt's tokens per forward (the batched engine's, for the same output as in a batch); ``grammar``: the matcher
    of ``config.constraint``."""
    policy = draft_length if draft_length is not None else make_policy(config.num_draft_tokens)
    cache = target.new_cache()
    seq = start_sequence(target, drafter, prompt_ids, config, eos_ids, policy, cache, outcome, prefill_chunk, grammar)
    verifier = TargetVerifier(target)
    try:
        if not seq.done:
            read_prompt(target, seq)
        while not seq.done:
            (new_tokens,) = step([seq], verifier)
            if seq.outcome.error is not None:
                raise GrammarFailure(seq.outcome.error)
            yield new_tokens
    finally:
        finish_sequence(seq)
