"""The user-facing object: text in, text out, with speculative decoding underneath.

Handles what the engine should not care about: prompt validation, chat templates, incremental
detokenisation for streaming, and stop strings (held back while they might still be completing).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from specdecode.batch_engine import BatchEngine, BatchRequest
from specdecode.config import AUTO, DraftLength, GenerationConfig, parse_draft_length
from specdecode.draft_length.base import PolicySource
from specdecode.draft_length.factory import measured_policy
from specdecode.drafters import create_drafter
from specdecode.drafters.base import Drafter
from specdecode.engine import PREFILL_CHUNK, DecodeOutcome, speculative_decode
from specdecode.errors import SpecDecodeError
from specdecode.grammar import GrammarCompiler, SequenceGrammar
from specdecode.models.cost import relative_cost_curve
from specdecode.models.loading import LoadedModel
from specdecode.sampling import token_logprobs
from specdecode.stats import GenerationStats
from specdecode.types import TokenLogprob
from specdecode.verify.registry import VerifierChoice, parse_verifier

Prompt = str | Sequence[int] | Sequence[dict]


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # generated tokens only
    prompt_tokens: int
    finish_reason: str  # "length", "eos" or "stop"
    stats: GenerationStats
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids, when asked for (``logprobs=N``)

    def to_json(self) -> dict:
        body = {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "stats": self.stats.to_json(),
        }
        if self.logprobs is not None:
            body["logprobs"] = [
                {"token": entry.token, "logprob": entry.logprob, "top": [list(pair) for pair in entry.top]}
                for entry in self.logprobs
            ]
        return body


@dataclass
class StreamEvent:
    text: str  # newly released text (may be empty while a stop string could still complete)
    token_ids: list[int]  # tokens accepted in this step
    result: GenerationResult | None = None  # set on the last event only


_PARAM_NAMES = {
    "max_new_tokens",
    "num_draft_tokens",
    "stop",
    "ignore_eos",
    "verifier",
    "stop_token_ids",
    "min_tokens",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "logprobs",
    "constraint",
}
_SAMPLING_NAMES = {
    "temperature",
    "top_k",
    "top_p",
    "seed",
    "coupled",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "logit_bias",
}


class SpeculativeGenerator:
    """A target model plus a drafter.  Drafter state persists across calls, so drafters that learn from
    earlier outputs make a session of related requests faster; ``reset_drafter()`` forgets it."""

    def __init__(self, target: LoadedModel, drafter: Drafter, defaults: GenerationConfig | None = None) -> None:
        self.target = target
        self.drafter = drafter
        self.defaults = defaults or GenerationConfig()
        # One policy per draft length and drafter, kept across requests: an adaptive one keeps what it learned.
        self._policies: dict[tuple[DraftLength, Drafter], PolicySource] = {}
        self._grammars: GrammarCompiler | None = None

    @classmethod
    def build(
        cls, target: LoadedModel, drafter: str = "pld", defaults: GenerationConfig | None = None, **drafter_options
    ) -> SpeculativeGenerator:
        return cls(target, create_drafter(drafter, target, **drafter_options), defaults)

    def reset_drafter(self) -> None:
        self.drafter.reset()
        self._policies.clear()

    def draft_length_policy(self, length: DraftLength | int | str, drafter: Drafter | None = None) -> PolicySource:
        """The policy requests drafting ``length`` decode with, kept per drafter (``None``: this generator's): what
        an adaptive policy learns about one drafter's acceptance says nothing of another's.  ``auto`` weighs
        acceptance against this model's verification cost curve, measured on first use (see :meth:`warm_up`)."""
        key = (parse_draft_length(length), drafter or self.drafter)
        if key not in self._policies:
            self._policies[key] = measured_policy(*key, self.target.backend)
        return self._policies[key]

    def warm_up(self, drafters: Iterable[Drafter] = ()) -> float:
        """Measure now what the first request would otherwise wait for: the target's verification cost
        curve, which ``auto`` (the default draft length) needs for a drafter that drafts — 112 forwards,
        2-3 s for SmolLM2-135M and more for larger models on a 2-core CPU, once per loaded model — and a draft
        model's token and its reading of a prompt (``Drafter.draft_token_seconds``, ``reading_cost``: a second or
        two), and a self-drafter's agreement with the target (``Drafter.acceptance_prior``: two forwards over a
        built-in text, 1 s on SmolLM2, 8 s on Qwen2.5-1.5B in w4a8 with building its draft head).  A server calls
        this before it accepts requests (as vLLM profiles before serving); a benchmark before it times.  Whatever
        the draft length, what a drafter measures of itself before drafting (``Drafter.prepare``: an early exit's
        agreement).  ``drafters``: those the requests will use (default: this generator's).  Returns the seconds
        spent, 0 where there was nothing to measure."""
        drafters = list(drafters) or [self.drafter]
        auto = self.defaults.num_draft_tokens == AUTO and any(d.drafts for d in drafters)
        started = time.perf_counter()
        prepared = [drafter.prepare() for drafter in drafters]
        if not auto:
            return time.perf_counter() - started if any(prepared) else 0.0
        relative_cost_curve(self.target.backend)
        for drafter in drafters:
            drafter.draft_token_seconds()
            drafter.reading_cost()
            drafter.acceptance_prior()
        return time.perf_counter() - started

    @property
    def grammars(self) -> GrammarCompiler:
        """The constraints compiled for this model's tokenizer (built on first use: reading the tokenizer's every
        token takes 0.3 s for a 49k vocabulary, 2 s for 262k)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.target.tokenizer, self.target.backend.vocab_size, self.eos_ids)
        return self._grammars

    def grammar_for(self, config: GenerationConfig) -> SequenceGrammar | None:
        """A fresh matcher of the request's constraint (None without one)."""
        return self.grammars.start(config.constraint) if config.constraint is not None else None

    # -- prompt handling -------------------------------------------------------------------------
    def encode_prompt(self, prompt: Prompt, chat: bool | None = False, tools: list[dict] | None = None) -> list[int]:
        """Text, chat messages or token ids → validated token ids.

        ``chat`` is for text: True wraps it in the model's chat template as one user message (an error if the
        model has none), False tokenizes it as it is, None uses the template when the model has one — what
        the CLI does by default, since an instruct model given a bare prompt often answers nothing at all.
        Chat messages always go through the template, with ``tools`` (OpenAI's function definitions) when given (an
        error if the template renders none); token ids are taken as they are."""
        tokenizer = self.target.tokenizer
        if isinstance(prompt, str):
            check_prompt_text(prompt)
            if chat or (chat is None and self.has_chat_template):
                ids = self._apply_chat_template([{"role": "user", "content": prompt}])
            else:
                ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
        elif prompt and all(isinstance(m, dict) for m in prompt):
            ids = self._apply_chat_template(list(prompt), tools)
        else:
            ids = list(prompt)
            if not all(isinstance(t, int) and 0 <= t < self.target.backend.vocab_size for t in ids):
                raise SpecDecodeError(f"prompt token ids must be integers in [0, {self.target.backend.vocab_size})")
        if not ids:
            raise SpecDecodeError("prompt is empty (it has no tokens)")
        limit = self.target.backend.max_context
        if len(ids) >= limit:
            raise SpecDecodeError(
                f"prompt is {len(ids)} tokens, but model {self.target.name!r} has a context of {limit} tokens "
                "(the prompt must leave room for at least one new token)"
            )
        return ids

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.target.tokenizer, "chat_template", None))

    def _apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        tokenizer = self.target.tokenizer
        if not self.has_chat_template:
            raise SpecDecodeError(f"model {self.target.name!r} has no chat template; use a plain prompt (no --chat)")
        for message in messages:
            role_ok = message.get("role") in {"system", "developer", "user", "assistant", "tool"}
            content = message.get("content")
            calls_only = content is None and message.get("role") == "assistant" and message.get("tool_calls")
            if not role_ok or not (isinstance(content, str) or calls_only):
                raise SpecDecodeError(
                    "chat messages need a role (system, developer, user, assistant or tool) and string content "
                    "(an assistant message may have tool_calls instead)"
                )
        # OpenAI's "developer" messages are what "system" ones were; chat templates know only the latter.
        messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
        said = [m.get("content") or "" for m in messages]
        if not any(text.strip() for text in said) and not any(m.get("tool_calls") for m in messages):
            raise SpecDecodeError("prompt is empty" if not any(said) else _BLANK)
        if tools and not self.renders_tools:
            raise SpecDecodeError(f"tools: the chat template of model {self.target.name!r} does not render tools")
        ids = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)

    @functools.cached_property
    def renders_tools(self) -> bool:
        """Whether the model's chat template shows the model the tools it is given (the Qwen2.5 and Hermes templates
        do; many ignore them, and a model never told of a tool cannot call it)."""
        if not self.has_chat_template:
            return False
        probe = [{"role": "user", "content": "hello"}]
        tool = {"type": "function", "function": {"name": "probe", "parameters": {"type": "object", "properties": {}}}}
        render = self.target.tokenizer.apply_chat_template
        told = render(probe, tools=[tool], add_generation_prompt=True, tokenize=False)
        return told != render(probe, add_generation_prompt=True, tokenize=False)

    def config_for(self, **params) -> GenerationConfig:
        """Defaults overridden by the given (non-None) parameters, validated.  ``verifier``: a name, a spec
        (``"fly:window=2"``) or a :class:`~specdecode.verify.registry.VerifierChoice`; ``verifier_options`` (a dict,
        e.g. ``{"window": 4}``) sets its options over the chosen ones (``specdecode verifiers`` lists each one's)."""
        unknown = set(params) - _PARAM_NAMES - _SAMPLING_NAMES - {"verifier_options"}
        if unknown:
            raise SpecDecodeError(f"unknown generation parameter(s): {', '.join(sorted(unknown))}")
        given = {k: v for k, v in params.items() if v is not None}
        if "verifier" in given or "verifier_options" in given:
            given["verifier"] = self._verifier(given.get("verifier"), given.pop("verifier_options", None))
        if "stop" in given:
            given["stop"] = (given["stop"],) if isinstance(given["stop"], str) else tuple(given["stop"])
        sampling = dataclasses.replace(
            self.defaults.sampling, **{k: v for k, v in given.items() if k in _SAMPLING_NAMES}
        )
        config = dataclasses.replace(
            self.defaults, sampling=sampling, **{k: v for k, v in given.items() if k in _PARAM_NAMES}
        )
        config.verifier.prepare(self.target.backend)  # e.g. judge's trained files: refused now (CLI exit 2, HTTP 400)
        if config.constraint is not None:
            self.grammars.check(config.constraint)  # compiled once, and refused now if this vocabulary cannot
        self._check_token_ids(config)
        return config

    def _check_token_ids(self, config: GenerationConfig) -> None:
        """Refuse a logit bias or a stop token id outside the vocabulary (vLLM's 400)."""
        vocab = self.target.backend.vocab_size
        for what, ids in (
            ("logit-bias", [token for token, _ in config.sampling.logit_bias]),
            ("stop token", config.stop_token_ids),
        ):
            outside = [token for token in ids if token >= vocab]
            if outside:
                raise SpecDecodeError(f"{what} ids must be in [0, {vocab}), got {outside}")

    def _verifier(self, verifier: str | VerifierChoice | None, options: dict | None) -> VerifierChoice:
        """A request's verifier: the defaults' (with their options) when it names the same one or none."""
        if verifier is None or verifier == self.defaults.verifier.name:
            verifier = self.defaults.verifier
        elif not isinstance(verifier, VerifierChoice):
            verifier = parse_verifier(verifier)
        return verifier.with_options(options) if options else verifier

    @property
    def eos_ids(self) -> frozenset[int]:
        ids = set(self.target.backend.eos_token_ids)
        if self.target.tokenizer.eos_token_id is not None:
            ids.add(int(self.target.tokenizer.eos_token_id))
        return frozenset(ids)

    # -- generation ------------------------------------------------------------------------------
    def stream_events(self, prompt: Prompt, *, chat: bool | None = False, **params) -> Iterator[StreamEvent]:
        """Events as tokens are verified, the last one carrying the result.  ``chat`` as in :meth:`encode_prompt`
        (the Python API tokenizes text as it is unless asked; the CLI passes None: the template if there is one)."""
        config = self.config_for(**params)
        prompt_ids = self.encode_prompt(prompt, chat=chat)
        outcome = DecodeOutcome()
        text = TextAssembler(self, prompt_ids, config)
        policy = self.draft_length_policy(config.num_draft_tokens)
        grammar = self.grammar_for(config)
        for new_tokens in speculative_decode(
            self.target.backend, self.drafter, prompt_ids, config, self.eos_ids, outcome, policy, grammar=grammar
        ):
            event = text.add(new_tokens)
            yield event
            if text.stopped:
                break
        yield text.finish(outcome)

    def stream(self, prompt: Prompt, *, chat: bool | None = False, **params) -> Iterator[str]:
        """Yield text as soon as it is verified."""
        for event in self.stream_events(prompt, chat=chat, **params):
            if event.text:
                yield event.text

    def generate(self, prompt: Prompt, *, chat: bool | None = False, **params) -> GenerationResult:
        for event in self.stream_events(prompt, chat=chat, **params):
            if event.result is not None:
                return event.result
        raise AssertionError("stream_events always ends with a result")

    def generate_batch(
        self, prompts: Sequence[Prompt], *, chat: bool | None = False, batch_size: int = 8, **params
    ) -> list[GenerationResult | SpecDecodeError]:
        """Decode many prompts together, ``batch_size`` at a time (continuous batching: a finished sequence's
        place goes to the next prompt at once).  Results come in input order; a prompt that cannot be
        decoded (empty, too long, ...) gets its :class:`SpecDecodeError` in its place and the others are
        unaffected.  ``params`` apply to every prompt (:meth:`run_batch` takes one config per prompt)."""
        config = self.config_for(**params)
        return self.run_batch([(prompt, config) for prompt in prompts], chat=chat, batch_size=batch_size)

    def batch_engine(self, max_batch_size: int, prefix_caching: bool = True) -> BatchEngine:
        """A continuous-batching engine over this generator's target, drafter and draft-length policies
        (callers that need per-request events, like the server, drive it themselves); ``prefix_caching``: keep
        as many finished prompts as the batch holds for reuse (:mod:`specdecode.prefix_cache`)."""
        return BatchEngine(
            self.target.backend,
            self.drafter,
            lambda config, drafter: self.draft_length_policy(config.num_draft_tokens, drafter),
            self.eos_ids,
            max_batch_size,
            prefix_cache_slots=max_batch_size if prefix_caching else 0,
            grammar_for=self.grammar_for,
        )

    def prompt_logprobs(self, prompt_ids: list[int], top: int) -> list[TokenLogprob]:
        """Each prompt token's log-probability after the tokens before it (the first has none, so ``len(prompt_ids)
        - 1`` entries), with the ``top`` most likely tokens' there: the target's raw distribution, read in one forward
        over the prompt (in the chunks decoding reads it in), with neither temperature nor penalties nor bias,
        as vLLM's prompt log-probabilities are."""
        backend = self.target.backend
        cache = backend.new_cache()
        entries: list[TokenLogprob] = []
        try:
            for start in range(0, len(prompt_ids) - 1, PREFILL_CHUNK):
                chunk = prompt_ids[start : start + PREFILL_CHUNK]
                logits = backend.forward(torch.tensor(chunk, device=backend.device), cache).logits
                following = prompt_ids[start + 1 : start + 1 + len(chunk)]
                entries += token_logprobs(logits[: len(following)], following, top)
        finally:
            cache.release()
        return entries

    def run_batch(
        self,
        requests: Sequence[tuple[Prompt, GenerationConfig]],
        *,
        chat: bool | None = False,
        batch_size: int = 8,
    ) -> list[GenerationResult | SpecDecodeError]:
        """Like :meth:`generate_batch`, with each prompt's own generation config (sampling, seed, limits)."""
        results: list[GenerationResult | SpecDecodeError | None] = [None] * len(requests)
        engine = self.batch_engine(batch_size)
        texts: dict[int, TextAssembler] = {}
        for index, (prompt, config) in enumerate(requests):
            try:
                prompt_ids = self.encode_prompt(prompt, chat=chat)
            except SpecDecodeError as exc:
                results[index] = exc
                continue
            texts[index] = TextAssembler(self, prompt_ids, config)
            engine.submit(BatchRequest(prompt_ids, config, tag=index))
        for event in engine.run():
            text = texts[event.tag]
            if event.new_tokens and not text.stopped:
                text.add(event.new_tokens)
                if text.stopped and not event.finished:
                    engine.cancel(event.tag)
            if event.finished and event.sequence.outcome.error is not None:
                results[event.tag] = SpecDecodeError(event.sequence.outcome.error)
            elif event.finished or text.stopped:
                outcome = event.sequence.outcome
                results[event.tag] = text.finish(outcome).result
        return results  # type: ignore[return-value]

    def _decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.target.tokenizer.decode(
            token_ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def _trim_to_stop(self, token_ids: list[int], stops: tuple[str, ...], skip_special_tokens: bool) -> list[int]:
        """The shortest prefix of ``token_ids`` whose text already contains a stop string."""
        while len(token_ids) > 1:
            if _find_stop(self._decode(token_ids[:-1], skip_special_tokens), stops, 0) is None:
                break
            token_ids = token_ids[:-1]
        return token_ids


_BLANK = "prompt is blank (only whitespace)"


def check_prompt_text(prompt: str) -> None:
    """Refuse an empty or whitespace-only prompt: a model continues it with junk, which helps no one."""
    if not prompt.strip():
        raise SpecDecodeError("prompt is empty" if not prompt else _BLANK)


class TextAssembler:
    """Turns one sequence's accepted tokens into text as it goes: incremental detokenisation (no broken
    multi-byte characters), stop strings held back while they might still be completing, and cut once one
    appears.

    Each step decodes only a window of the last tokens, not the whole output: ``settled`` tokens' text is in
    ``text``; the window starts one settling earlier (``window_start``), so that the window's first token, whose
    text a tokenizer may render differently at the start of a sequence (a dropped leading space), is rendered
    the same in both decodes whose difference is the new text.  Text ending in an incomplete UTF-8 sequence is
    not settled until the character completes (or the request ends)."""

    def __init__(self, generator: SpeculativeGenerator, prompt_ids: list[int], config: GenerationConfig) -> None:
        self.generator = generator
        self.prompt_ids = prompt_ids
        self.stops = config.stop
        self.skip_special_tokens = config.skip_special_tokens
        self.include_stop = config.include_stop_str_in_output
        self.wants_logprobs = config.logprobs is not None
        # The token that ended the request (end-of-sequence, a stop token) is not text, as in vLLM, unless asked.
        self.silent_stop_ids = frozenset() if self.include_stop else config.stop_ids(generator.eos_ids)
        self.config = config
        self.silent_tail = 0  # 1 while the last token is a stop token that ended the request
        self.holdback = max((len(s) for s in config.stop), default=1) - 1
        self.generated: list[int] = []
        self.text = ""
        self.window_start = 0
        self.settled = 0
        self.released = 0
        self.stopped = False
        self.dropped = 0  # tokens of the last step after the one that completed a stop string
        self.last_step = 0  # tokens the last step gave

    def _settle(self, final: bool = False) -> None:
        """Add the text of the tokens past ``settled`` to ``text``, unless it ends mid-character (``final``: even
        then)."""
        shown = len(self.generated) - self.silent_tail
        window = self.generator._decode(self.generated[self.window_start : shown], self.skip_special_tokens)
        if window.endswith("\ufffd") and not final:
            return
        known = self.generator._decode(self.generated[self.window_start : self.settled], self.skip_special_tokens)
        self.text += window[len(known) :]
        self.window_start, self.settled = self.settled, shown

    def add(self, new_tokens: list[int]) -> StreamEvent:
        self.generated.extend(new_tokens)
        self.last_step = len(new_tokens)
        ended = bool(new_tokens) and self.config.ends_at(new_tokens[-1], len(self.generated), self.silent_stop_ids)
        self.silent_tail = int(ended)
        self._settle()
        # As vLLM, stop strings are looked for once the output has more than min_tokens tokens.
        found = None
        if len(self.generated) > self.config.min_tokens:
            found = _find_stop(self.text, self.stops, max(0, self.released - self.holdback))
        if found is not None:
            self.text = self.text[: found[1] if self.include_stop else found[0]]
            kept = self.generator._trim_to_stop(self.generated, self.stops, self.skip_special_tokens)
            self.dropped, self.generated = len(self.generated) - len(kept), kept
            self.stopped = True
            piece, self.released = self.text[self.released :], len(self.text)
            return StreamEvent(text=piece, token_ids=new_tokens)
        safe = len(self.text) - self.holdback
        piece = self.text[self.released : safe] if safe > self.released else ""
        self.released = max(self.released, safe)
        return StreamEvent(text=piece, token_ids=new_tokens)

    def finish(self, outcome: DecodeOutcome) -> StreamEvent:
        if not self.stopped:
            self._settle(final=True)  # an incomplete character at the very end is the output's last text
        if self.dropped:  # what the stop string cut off was never returned: it is not counted either
            outcome.stats.drop_tail(self.dropped, self.last_step - 1)
            self.dropped = 0
        result = GenerationResult(
            text=self.text,
            token_ids=self.generated,
            prompt_tokens=len(self.prompt_ids),
            finish_reason="stop" if self.stopped else outcome.finish_reason,
            stats=outcome.stats,
            logprobs=outcome.logprobs[: len(self.generated)] if self.wants_logprobs else None,
        )
        return StreamEvent(text=self.text[self.released :], token_ids=[], result=result)


def _find_stop(text: str, stops: tuple[str, ...], start: int) -> tuple[int, int] | None:
    """Where the first stop string in ``text`` (from ``start``) begins and ends; None when there is none."""
    found = [(i, i + len(s)) for i, s in ((text.find(s, start), s) for s in stops) if i >= 0]
    return min(found) if found else None
