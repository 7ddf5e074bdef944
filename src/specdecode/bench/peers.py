"""Hugging Face transformers' own generation, the peer our engine is compared with.

Each function runs ``model.generate()`` once on one tokenized prompt (batch size 1), greedy, and times only
that call.  Facts from the transformers 4.57.6 sources that shape this module:

* Only token ids are taken from the model's generation config.  Sampling and penalty settings there (e.g.
  a ``repetition_penalty`` shipped with a checkpoint) are deliberately not inherited
  (``use_model_defaults=False``), so every peer computes the plain greedy argmax our engine computes.
* ``ignore_eos`` passes ``eos_token_id=[]``: no EOS stopping criterion, and logits are untouched, so the
  tokens equal an EOS-respecting run up to its EOS.  ``eos_token_id=None`` would not do: prompt lookup
  then crashes in ``torch.isin(candidates, None)``; ``min_new_tokens`` would change the tokens by banning EOS.
* Prompt lookup can overshoot ``max_new_tokens`` by up to ``prompt_lookup_num_tokens - 1``; we keep the
  first ``max_new_tokens`` (see ``_run``).
* Assisted generation reads its draft length and schedule from the *assistant's* ``generation_config``
  (``AssistedCandidateGenerator.__init__``); passing ``num_assistant_tokens`` to ``generate()`` has no
  effect on it.  Generation also writes into that config: it copies the target's ``eos_token_id`` into it,
  and with the "heuristic" schedule stores the adapted draft length for the next call.  We set the
  requested values before the call and restore the assistant's config afterwards, so every call starts
  from the same state.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel

from specdecode.errors import SpecDecodeError, VocabularyMismatchError

# transformers 4.57.6 ``PromptLookupCandidateGenerator(num_output_tokens=10)``.
DEFAULT_PROMPT_LOOKUP_NUM_TOKENS = 10


@dataclass(frozen=True)
class PeerResult:
    """One generate() call.  ``token_ids`` are the generated tokens only (an EOS that stopped it included)."""

    method: str
    token_ids: list[int]
    wall_s: float
    new_tokens: int
    tokens_per_s: float


def tokens_per_second(new_tokens: int, wall_s: float) -> float:
    return new_tokens / wall_s if wall_s > 0 else 0.0


def _greedy_config(model: PreTrainedModel, max_new_tokens: int, ignore_eos: bool, **extra: Any) -> GenerationConfig:
    defaults = model.generation_config
    eos = defaults.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    pad = defaults.pad_token_id
    if pad is None:
        # Batch size 1 never pads; setting it only silences the "Setting pad_token_id" warning.
        pad = eos_ids[0] if eos_ids else 0
    return GenerationConfig(
        do_sample=False,
        num_beams=1,
        max_new_tokens=max_new_tokens,
        bos_token_id=defaults.bos_token_id,
        eos_token_id=[] if ignore_eos else eos,
        pad_token_id=pad,
        **extra,
    )


def _run(
    method: str,
    model: PreTrainedModel,
    prompt_ids: list[int],
    config: GenerationConfig,
    **generate_kwargs: Any,
) -> PeerResult:
    if not prompt_ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt_ids):
        raise SpecDecodeError("prompt must be a non-empty list of token ids")
    input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=model.device)
    attention_mask = torch.ones_like(input_ids)
    with torch.inference_mode():
        start = time.perf_counter()
        output = model.generate(
            input_ids,
            attention_mask=attention_mask,
            generation_config=config,
            use_model_defaults=False,
            **generate_kwargs,
        )
        wall_s = time.perf_counter() - start
    # Prompt lookup in 4.57.6 can accept drafts past ``max_length`` (its cap compares slice indices with
    # the length; huggingface/transformers PRs 46993 and 47195): the extra tokens come out of the final
    # verification forward, which is timed anyway, so they are dropped rather than counted.
    token_ids = output[0, len(prompt_ids) :].tolist()[: config.max_new_tokens]
    return PeerResult(method, token_ids, wall_s, len(token_ids), tokens_per_second(len(token_ids), wall_s))


def _check_positive(label: str, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
        raise SpecDecodeError(f"{label} must be a positive integer, got {value!r}")


def hf_plain(
    model: PreTrainedModel, prompt_ids: list[int], max_new_tokens: int, ignore_eos: bool = False
) -> PeerResult:
    """Plain greedy decoding: one target forward per token, the baseline every speed-up is measured against."""
    _check_positive("max-new-tokens", max_new_tokens)
    return _run("hf-plain", model, prompt_ids, _greedy_config(model, max_new_tokens, ignore_eos))


def hf_assisted(
    model: PreTrainedModel,
    assistant_model: PreTrainedModel,
    prompt_ids: list[int],
    max_new_tokens: int,
    num_assistant_tokens: int | None = None,
    num_assistant_tokens_schedule: str | None = None,
    assistant_confidence_threshold: float | None = None,
    ignore_eos: bool = False,
) -> PeerResult:
    """Greedy assisted generation (speculative decoding with a same-vocabulary draft model).

    ``None`` keeps what the assistant's generation config says; for a stock config in transformers 4.57.6
    that is 20 draft tokens, schedule ``"constant"`` (``"heuristic"``: +2 after a fully accepted draft,
    -1 otherwise; ``"heuristic_transient"``: the same, reset every call) and confidence threshold 0.4 (the
    assistant stops drafting early when its top token's probability falls below it; 0 disables that).
    The threshold would also self-tune if scikit-learn were installed; it is not, here.
    """
    _check_positive("max-new-tokens", max_new_tokens)
    _check_positive("num_assistant_tokens", num_assistant_tokens)
    schedules = ("constant", "heuristic", "heuristic_transient")
    if num_assistant_tokens_schedule is not None and num_assistant_tokens_schedule not in schedules:
        raise SpecDecodeError(
            f"assistant schedule must be one of {', '.join(schedules)}, got {num_assistant_tokens_schedule!r}"
        )
    target_vocab = model.config.get_text_config().vocab_size
    draft_vocab = assistant_model.config.get_text_config().vocab_size
    if target_vocab != draft_vocab:
        raise VocabularyMismatchError(
            f"assisted generation needs the same vocabulary: target has {target_vocab} tokens, assistant {draft_vocab}"
        )
    config = _greedy_config(model, max_new_tokens, ignore_eos)
    saved = copy.deepcopy(assistant_model.generation_config)
    assistant_config = assistant_model.generation_config
    overrides = {
        "num_assistant_tokens": num_assistant_tokens,
        "num_assistant_tokens_schedule": num_assistant_tokens_schedule,
        "assistant_confidence_threshold": assistant_confidence_threshold,
    }
    try:
        for key, value in overrides.items():
            if value is not None:
                setattr(assistant_config, key, value)
            # Mirrored into the target's config (where they are otherwise unused) so the assistant's inner
            # generate() call sees no difference to warn about.
            setattr(config, key, getattr(assistant_config, key))
        return _run("hf-assisted", model, prompt_ids, config, assistant_model=assistant_model)
    finally:
        assistant_model.generation_config = saved


def hf_prompt_lookup(
    model: PreTrainedModel,
    prompt_ids: list[int],
    max_new_tokens: int,
    prompt_lookup_num_tokens: int = DEFAULT_PROMPT_LOOKUP_NUM_TOKENS,
    max_matching_ngram_size: int | None = None,
    ignore_eos: bool = False,
) -> PeerResult:
    """Greedy prompt lookup decoding: drafts are copied from earlier context after a matching n-gram.

    ``max_matching_ngram_size=None`` uses transformers' default of 2.
    """
    _check_positive("max-new-tokens", max_new_tokens)
    _check_positive("prompt_lookup_num_tokens", prompt_lookup_num_tokens)
    _check_positive("max_matching_ngram_size", max_matching_ngram_size)
    config = _greedy_config(
        model,
        max_new_tokens,
        ignore_eos,
        prompt_lookup_num_tokens=prompt_lookup_num_tokens,
        max_matching_ngram_size=max_matching_ngram_size,
    )
    return _run("hf-prompt-lookup", model, prompt_ids, config)


@dataclass(frozen=True)
class BatchedPeerResult:
    """One batched generate() call: each row's generated tokens (input order) and the call's wall time.
    Unpacks as ``token_ids, wall_s = hf_plain_batched(...)``."""

    token_ids: list[list[int]]
    wall_s: float

    def __iter__(self):
        return iter((self.token_ids, self.wall_s))


def hf_plain_batched(
    model: PreTrainedModel,
    prompts_ids: list[list[int]],
    max_new_tokens: int,
    ignore_eos: bool = False,
    pad_token_id: int | None = None,
) -> BatchedPeerResult:
    """Plain greedy decoding of several prompts in one ``generate()`` call: left-padded to the longest
    prompt, with an attention mask (transformers derives each row's positions from it).

    Rows come back cut to ``max_new_tokens``; without ``ignore_eos`` a row that stopped is also cut after
    its EOS (transformers pads it while the others go on).  With ``ignore_eos`` every row has exactly
    ``max_new_tokens`` tokens.  ``pad_token_id`` defaults to the model's pad token, else its first EOS."""
    _check_positive("max-new-tokens", max_new_tokens)
    if not prompts_ids:
        raise SpecDecodeError("no prompts to decode")
    for prompt_ids in prompts_ids:
        if not prompt_ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt_ids):
            raise SpecDecodeError("every prompt must be a non-empty list of token ids")
    config = _greedy_config(model, max_new_tokens, ignore_eos)
    if pad_token_id is not None:
        config.pad_token_id = pad_token_id
    pad = config.pad_token_id
    width = max(len(p) for p in prompts_ids)
    input_ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts_ids], dtype=torch.long)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts_ids], dtype=torch.long)
    with torch.inference_mode():
        start = time.perf_counter()
        output = model.generate(
            input_ids.to(model.device),
            attention_mask=attention_mask.to(model.device),
            generation_config=config,
            use_model_defaults=False,
        )
        wall_s = time.perf_counter() - start
    eos = model.generation_config.eos_token_id
    eos_ids = set() if ignore_eos else ({eos} if isinstance(eos, int) else set(eos or []))
    rows = []
    for row in output[:, width:].tolist():
        row = row[:max_new_tokens]
        stop = next((i for i, token in enumerate(row) if token in eos_ids), None)
        rows.append(row if stop is None else row[: stop + 1])
    return BatchedPeerResult(rows, wall_s)
