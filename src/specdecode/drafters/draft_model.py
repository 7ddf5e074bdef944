"""An independent small model drafts autoregressively (with the target's vocabulary, or another one).

It keeps its own KV cache.  Instead of being told what was rejected, it re-synchronises on every
``propose``: the cache is cut back to the longest prefix it shares with the accepted context and
only the missing tokens are fed — so rollback is exact whatever the verifier decided.

``draft_vocab=N`` drafts over the draft model's LM head restricted to the N ids most frequent in chat text and the
prompt's (VocabTrim, :mod:`specdecode.drafters._vocab`; by default :data:`DEFAULT_DRAFT_MODEL_VOCAB`,
``draft_vocab=0`` for the full head): on a CPU a 0.5B model's 152k-row head is a fifth of its forward.  Tokens
outside are never drafted, which cannot change the output.

A draft model with *another* vocabulary drafts through ``vocab_mapping=intersection|text|ngram``
(:mod:`specdecode.drafters.cross_vocab`), by default :data:`DEFAULT_VOCAB_MAPPING`: ``text`` drafts fastest of
the three (``docs/results/cross-vocab-qwen2.5-coder-1.5b-4tasks``).  The same vocabulary keeps the direct path.

``adapt=true`` fine-tunes the draft model online on what the target verifies (LoRA, within a compute
budget, between requests; ``adapt_budget``, ``adapt_steps``, ``adapt_lr``, ``adapt_save``, ``adapt_load``:
:mod:`specdecode.drafters.adapt`).

With a seeded, coupled request (``SamplingParams.is_coupled``) the draft token at absolute position t is
``argmax_v(log q_t(v) + G_{seed,t}(v))`` with the very noise the coupled verifier applies to the target's
p_t: the draft then agrees with the target's sample whenever the two perturbed argmaxes coincide, which
happens most often where q is close to p (an independent draw would be accepted far less).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial

import torch

from specdecode.clock import now
from specdecode.drafters import register_drafter
from specdecode.drafters._forward_clock import ForwardClock
from specdecode.drafters._lookahead import Lookahead
from specdecode.drafters._parallel_switch import ParallelSwitch, parallel_mode
from specdecode.drafters._vocab import DraftHead, HeadRows, RequestRows, frequent_tokens
from specdecode.drafters._vocab_map import common_prefix_length
from specdecode.drafters.adapt import AdaptOptions, OnlineAdapter
from specdecode.drafters.adapt_data import AdaptingSession, cross_vocab_example, same_vocab_example
from specdecode.drafters.base import Drafter, DraftRequest, DraftSession
from specdecode.drafters.cross_vocab import PRIOR_ACCEPTANCE as CROSS_VOCAB_PRIOR
from specdecode.drafters.cross_vocab import CrossVocabulary, check_vocab_mapping
from specdecode.errors import SpecDecodeError, VocabularyMismatchError
from specdecode.models.base import CausalLM, HiddenStates, LayerwiseExecution, require_capability
from specdecode.models.cost import prefilled
from specdecode.models.loading import LoadedModel, check_same_vocabulary, load_model
from specdecode.models.quantize import draft_quantization
from specdecode.sampling import coupled_argmax, sample, sampling_log_weights, sampling_probs
from specdecode.types import Draft, StepFeedback


def choose_draft_token(
    logits: torch.Tensor, request: DraftRequest, position: int, generator: torch.Generator
) -> tuple[int, torch.Tensor | None, float]:
    """A draft model's token for absolute ``position`` from its logits there; the distribution it was drawn
    from (None when the token is a deterministic function of the logits: greedy, or coupled with the
    request's keyed noise — a point-mass proposal then); and the model's probability of it (its confidence,
    for the draft-length policy's stop rule)."""
    sampling = request.sampling
    if sampling.greedy:
        top = logits.float().softmax(-1).max(-1)
        return int(top.indices), None, float(top.values)
    if sampling.is_coupled:
        weights = sampling_log_weights(logits, sampling)
        token = coupled_argmax(weights, request.seed, position)
        return token, None, float(weights.softmax(-1)[token])
    probs = sampling_probs(logits, sampling).cpu()
    token = sample(probs, generator)
    return token, probs, float(probs[token])


def loaded_draft(draft_model: str | LoadedModel, target: LoadedModel, *, trains: bool = False) -> LoadedModel:
    """The draft model as handed in, or loaded by name on the target's device in the precision the command line
    gives it when ``--quantize-draft`` is not set (:func:`~specdecode.models.quantize.draft_quantization`:
    quantized on a CPU, fp32 for a draft that ``trains``), so the Python API drafts as fast as the CLI."""
    if isinstance(draft_model, LoadedModel):
        return draft_model
    device = target.backend.device
    quantize = draft_quantization(None, "none", device=device, trains=trains)
    return load_model(draft_model, device=device, quantize=quantize)


#: The mapping a draft model with another vocabulary drafts through when none is named (see the docstring).
DEFAULT_VOCAB_MAPPING = "text"
#: VocabTrim's size when ``draft_vocab`` is not given: Qwen2.5-Coder-0.5B drafting for the 1.5B ran faster over
#: 32,768 ids than over 65,536 or all 151,936 (``docs/results/vocabtrim-freq-bf16-qwen2.5-coder-1.5b``).
DEFAULT_DRAFT_MODEL_VOCAB = 32768


def default_draft_vocab(draft: LoadedModel) -> int:
    """:data:`DEFAULT_DRAFT_MODEL_VOCAB` where the draft model can draft through a head of its own rows (layer-wise
    execution and hidden states), else 0 (the full head)."""
    backend = draft.backend
    trims = isinstance(backend, LayerwiseExecution) and isinstance(backend, HiddenStates)
    return DEFAULT_DRAFT_MODEL_VOCAB if trims and backend.vocab_size > DEFAULT_DRAFT_MODEL_VOCAB else 0


def vocab_trim_head(draft: LoadedModel, draft_vocab: int | None, who: str) -> DraftHead | None:
    """VocabTrim for a draft model of the target's vocabulary: its LM head over its ``draft_vocab`` most frequent
    ids and each prompt's (None: :func:`default_draft_vocab`); None for the full head (``draft_vocab`` 0)."""
    if draft_vocab is None:
        draft_vocab = default_draft_vocab(draft)
    if not draft_vocab:
        return None
    backend = require_capability(draft.backend, LayerwiseExecution, f"{who} with draft_vocab")
    require_capability(backend, HiddenStates, f"{who} with draft_vocab")
    return DraftHead(backend, draft_vocab, frequent_tokens(draft, draft_vocab))


def choose_with_head(
    logits: torch.Tensor, head: HeadRows | None, request: DraftRequest, position: int, generator: torch.Generator
) -> tuple[int, torch.Tensor | None, float]:
    """:func:`choose_draft_token` over a VocabTrim ``head``'s ids when there is one (greedy reads them directly;
    sampling spreads them over the whole vocabulary, zero outside, so that rejection sampling stays exact)."""
    if head is not None and request.sampling.greedy:
        index, _, confidence = choose_draft_token(logits, request, position, generator)
        return head.token(index), None, confidence
    if head is not None:
        logits = head.full_vocab(logits)
    return choose_draft_token(logits, request, position, generator)


#: :meth:`DraftModelDrafter.draft_token_seconds` times this many one-token forwards (the first warms the
#: kernels up too) after a prompt of ``TIMING_CONTEXT`` tokens (dense forwards cost the same whatever the ids).
TIMED_TOKENS = 4
TIMING_CONTEXT = 64
#: :func:`time_reading` times the draft model's and the target's prefill of a prompt this long.
READING_CONTEXT = 128


def time_draft_token(backend: CausalLM, head: DraftHead | None = None) -> float:
    """The fastest of ``TIMED_TOKENS`` one-token draft forwards after a ``TIMING_CONTEXT``-token prompt, through
    ``head`` (VocabTrim) if given: about half a second for a 0.5B model on a 2-core CPU."""
    prompt = list(range(max(1, min(TIMING_CONTEXT, backend.max_context - TIMED_TOKENS - 1))))
    rows = head.for_prompt(prompt) if head is not None else None
    session = DraftModelSession(backend, DraftRequest(prompt_ids=tuple(prompt)), rows)
    try:
        session.next_logits(torch.tensor(prompt))
        timings = []
        for token in range(TIMED_TOKENS):
            tick = time.perf_counter()
            session.next_logits(torch.tensor([token]))
            timings.append(time.perf_counter() - tick)
    finally:
        session.finish(prompt)
    return min(timings)


def time_reading(draft: CausalLM, target: CausalLM, head: DraftHead | None = None) -> float:
    """The draft model's prefill of a ``READING_CONTEXT``-token prompt over the target's of the same tokens, each the
    faster of two (the first warms the kernels): what reading a prompt costs it against the target's prefill.  The
    weights multiplied per token misjudge it across kernels: an int4 SmolLM2-135M beside a w4a8 1.5B target reads a
    prompt in nearly twice the share its weights say."""
    length = max(1, min(READING_CONTEXT, draft.max_context - 1, target.max_context - 1))
    prompt = [token % draft.vocab_size for token in range(length)]
    rows = head.for_prompt(prompt) if head is not None else None
    draft_s, target_s = [], []
    for _ in range(2):
        session = DraftModelSession(draft, DraftRequest(prompt_ids=tuple(prompt)), rows)
        tick = time.perf_counter()
        try:
            session.next_logits(torch.tensor(prompt))
            draft_s.append(time.perf_counter() - tick)
        finally:
            session.finish(prompt)
        tick = time.perf_counter()
        cache, _ = prefilled(target, length, 1)  # the target's prefill, as its cost curve reads it
        target_s.append(time.perf_counter() - tick)
        cache.release()
    return min(draft_s) / min(target_s)


@register_drafter("draft-model")
class DraftModelDrafter(Drafter):
    provides_probs = True
    reads_context = True

    def __init__(
        self,
        target: LoadedModel,
        draft_model: str | LoadedModel | None = None,
        draft_vocab: int | None = None,
        vocab_mapping: str | None = None,
        adapt: bool | str | None = None,
        adapt_budget: float | None = None,
        adapt_steps: int | None = None,
        adapt_lr: float | None = None,
        adapt_save: str | None = None,
        adapt_load: str | None = None,
        parallel: bool | str = False,
    ) -> None:
        super().__init__(target)
        self.parallel = parallel_mode(parallel)
        # true: the worker is timed against drafting in turn and kept only where it is faster; always: kept.
        self.switch = ParallelSwitch() if self.parallel == "true" else None
        self.works_between_steps = self.parallel != "off"
        if self.parallel != "off" and vocab_mapping is not None:
            raise SpecDecodeError("parallel drafting needs a draft model with the target's vocabulary")
        if draft_model is None:
            raise SpecDecodeError("drafter 'draft-model' needs --draft-model (e.g. qwen2.5-coder-0.5b)")
        if vocab_mapping is not None:
            check_vocab_mapping(vocab_mapping)
            if draft_vocab:
                raise SpecDecodeError("draft_vocab does not combine with vocab_mapping")
        adapting = AdaptOptions.parse(adapt, adapt_budget, adapt_steps, adapt_lr, adapt_save, adapt_load)
        self.draft = loaded_draft(draft_model, target, trains=adapting is not None)
        # Adapted: LoRA on a copy of the draft model's modules (the base weights shared, never written).
        self.adapter = OnlineAdapter(self.draft, adapting) if adapting is not None else None
        if self.adapter is not None:
            self.draft = self.adapter.draft
        self.draft.backend.prepare_drafting()
        # Another vocabulary: cross_vocab.py translates both ways, by the mapping named or the default one.
        if vocab_mapping is None:
            try:
                check_same_vocabulary(target, self.draft)
            except VocabularyMismatchError:
                if draft_vocab:
                    raise SpecDecodeError("draft_vocab needs a draft model with the target's vocabulary") from None
                vocab_mapping = DEFAULT_VOCAB_MAPPING
        self.cross = CrossVocabulary.build(vocab_mapping, target, self.draft) if vocab_mapping else None
        self.prior_acceptance = CROSS_VOCAB_PRIOR if self.cross is not None else None
        self.clock = ForwardClock()  # shared by its sessions: what a one-token draft forward costs
        self._reading: float | None = None  # reading_cost, once timed
        # VocabTrim, by default where the draft shares the target's vocabulary.
        no_trim = draft_vocab is None and self.cross is not None
        self.head = vocab_trim_head(self.draft, 0 if no_trim else draft_vocab, "draft-model")

    def reset(self) -> None:
        if self.cross is not None:
            self.cross.reset()
        if self.adapter is not None:
            self.adapter.reset()

    def draft_token_seconds(self) -> float:
        """Seconds of a one-token draft forward: the clock's, learnt from drafting, or else timed now
        (:func:`time_draft_token`, once per drafter).  ``auto`` prices a first draft with it: the weight count it
        otherwise goes by says a 0.5B w4a8 draft token costs a third of a fp32 1.5B target's, where it measures
        a fourteenth, which would decline long prompts for drafting that pays (``docs/results/avx2``: "a draft
        token timed, not counted")."""
        if not self.clock.one_token_s:
            self.clock.add(time_draft_token(self.draft.backend, self.head))
        return self.clock.one_token_s

    def reading_cost(self) -> float:
        """Its reading of a prompt against the target's prefill, timed once (:func:`time_reading`)."""
        if self._reading is None:
            self._reading = time_reading(self.draft.backend, self.target.backend, self.head)
        return self._reading

    def session(self, request: DraftRequest) -> DraftSession:
        if self.cross is not None:
            session: DraftSession = self.cross.session(request)
        else:
            rows = self.head.for_prompt(request.prompt_ids) if self.head is not None else None
            parallel = self.parallel != "off"
            session = DraftModelSession(self.draft.backend, request, rows, self.clock, parallel, self.switch)
        if self.adapter is None:
            return session
        cross = self.cross
        builder = same_vocab_example if cross is None else partial(cross_vocab_example, cross)
        return AdaptingSession(session, self.adapter, request, builder)


@dataclass(frozen=True)
class StepMark:
    """What the parallel switch needs of a step when the next one starts: when it started, the context's
    length then, whether the worker ran during its verification, and the drafting it was spared by the
    worker of the step before (``received`` seconds)."""

    started: float
    length: int
    worked: bool
    received: float


class DraftModelSession(DraftSession):
    """One request: the draft model's own cache of it, its sampling and random stream."""

    def __init__(
        self,
        backend: CausalLM,
        request: DraftRequest,
        head: HeadRows | None = None,
        clock: ForwardClock | None = None,
        parallel: bool = False,
        switch: ParallelSwitch | None = None,
    ) -> None:
        self.backend = backend
        self.clock = clock if clock is not None else ForwardClock()
        self.vocab = RequestRows(head)  # VocabTrim's rows, if any, widened as the text grows
        self.request = request
        self.sampling = request.sampling
        self.generator = request.torch_generator()
        self.cache = backend.new_cache()
        self.cached_tokens: list[int] = []
        # Drafting on while the target verifies, where the drafts are a function of the context.
        deterministic = self.sampling.greedy or self.sampling.is_coupled
        self.lookahead = Lookahead(self._draft_one) if parallel and deterministic else None
        self.switch = switch  # None: the worker runs after every draft
        self._step: StepMark | None = None  # the last step, for the switch

    def _choose(self, logits: torch.Tensor, position: int) -> tuple[int, torch.Tensor | None, float]:
        """The next draft token (for absolute ``position``), over the VocabTrim head's ids when there is one."""
        return choose_with_head(logits, self.vocab.rows, self.request, position, self.generator)

    def propose(self, context: list[int], max_tokens: int) -> Draft:
        backend = self.backend
        last, self._step = self._step, None
        worked = last is not None and last.worked  # the worker ran during the last verification
        if self.lookahead is not None:
            self.cached_tokens.extend(self.lookahead.join())
        # After the join: waiting for the worker belongs to the step it worked in.  The request's clock, as
        # the switch compares times across steps.
        started = now()
        self.vocab.follow(context)  # (after the join: the worker drafts through the rows too)
        max_tokens = min(max_tokens, backend.max_context - len(context))
        # Tokens the worker drafted while the target verified, if the target went the way it assumed.
        tokens, confidence = self.lookahead.continuation(context) if worked else ([], [])
        tokens, confidence = tokens[: max(max_tokens, 0)], confidence[: max(max_tokens, 0)]
        stopped = next((n for n in range(1, len(tokens) + 1) if self.request.stop(confidence[:n])), None)
        if stopped is not None:
            tokens, confidence = tokens[:stopped], confidence[:stopped]
        saved = len(tokens) * self.clock.one_token_s  # draft forwards this step skips thanks to the worker
        if self.switch is not None and last is not None:
            # The last step's time, with the saving moved to it from this step (the worker earned it then).
            self.switch.record(last.worked, started - last.started + last.received - saved, len(context) - last.length)
        if max_tokens <= 0:
            return Draft(tokens=[])
        if tokens:  # the cache holds the context and more of them: keep what the draft needs
            self.cache.crop(len(context) + len(tokens) - 1)
            pending = torch.tensor(tokens[-1:], dtype=torch.long)
        else:
            keep = min(common_prefix_length(self.cached_tokens, context), len(context) - 1)
            self.cache.crop(keep)
            pending = torch.tensor(context[keep:], dtype=torch.long)
        prob_rows: list[torch.Tensor] = []
        setup_s = 0.0
        more = 0 if stopped is not None else max_tokens - len(tokens)
        for index in range(len(tokens), len(tokens) + more):
            # The first forward may also catch up with the context: its prompt, tokens skipped while not drafting.
            logits, catching_up = self.clock.timed(partial(self.next_logits, pending), len(pending))
            setup_s += catching_up
            token, probs, p = self._choose(logits, len(context) + index)
            tokens.append(token)
            confidence.append(p)
            if probs is not None:
                prob_rows.append(probs)
            if self.request.stop(confidence):  # SpecDec++-style early stop
                break
            pending = torch.tensor([token], dtype=torch.long)
        # The last drafted token was never fed to the draft model, so the cache ends one before it.
        self.cached_tokens = [*context, *tokens[:-1]]
        if self.lookahead is not None and tokens:
            work = self.switch is None or self.switch.parallel
            if work:
                room = backend.max_context - len(context) - len(tokens) - 1
                self.lookahead.start(context, tokens, min(max_tokens + 1, room))
            self._step = StepMark(started, len(context), work, saved)
        probs_out = torch.stack(prob_rows) if prob_rows else None
        return Draft(tokens=tokens, probs=probs_out, confidence=confidence, setup_s=setup_s)

    def _draft_one(self, token: int, position: int) -> tuple[int, float]:
        """The lookahead worker's step: feed ``token``, choose the token at ``position`` (deterministically)."""
        token, _, confidence = self._choose(self.next_logits(torch.tensor([token], dtype=torch.long)), position)
        return token, confidence

    def observe(self, context: list[int], feedback: StepFeedback) -> None:
        if self.lookahead is not None:
            self.lookahead.stop()

    def next_logits(self, pending: torch.Tensor) -> torch.Tensor:
        """Logits after ``pending`` (fed on top of the cache): full, or over the VocabTrim head's ids."""
        return self.backend.draft_logits(pending, self.cache, self.vocab.rows)[-1]

    def restart(self) -> None:
        """The draft model's weights changed (online adaptation): nothing cached is valid any more."""
        if self.lookahead is not None:
            self.lookahead.join()
        self.cached_tokens = []

    def finish(self, context: list[int]) -> None:
        if self.lookahead is not None:
            self.lookahead.stop()
            self.lookahead.join()
        self.cache.release()
