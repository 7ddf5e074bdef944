"""The target's logits processed with the tokens before each position: a constraint's grammar mask, ``min_tokens``,
``logit_bias`` and the repetition, presence and frequency penalties, in vLLM's order (then :mod:`specdecode.sampling`
applies the temperature, min-p, top-k and top-p).

A verification forward gives one row per draft node, and each row's prefix is its own: the context, then the draft
tokens on the path from the context to that node (:class:`RowHistory`).  Each row is processed with exactly that
prefix, so that the row is the distribution plain decoding would read at that position had it produced the same
tokens — which is what keeps greedy matching, rejection sampling and coupled sampling exact under speculation, for
chains and trees alike.  Drafters are not asked to process their own distributions; one that does not only loses
acceptance.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdecode.sampling_params import SamplingParams
from specdecode.types import Draft


@dataclass(frozen=True)
class RowHistory:
    """What precedes each row of one sequence's verification forward.

    context: prompt + every accepted token (row 0 follows it); ``prompt_length`` of them are the prompt.
    draft: the nodes verified after it (row i + 1 follows node i and its ancestors).
    stop_ids, min_tokens: the tokens that end the request, refused while fewer than ``min_tokens`` are generated.
    grammar_masks: [rows, vocab] bool, the tokens a constraint admits at each row, after that row's own prefix
        (:meth:`specdecode.grammar.SequenceGrammar.row_masks`); None without a constraint."""

    context: Sequence[int]
    prompt_length: int
    draft: Draft
    stop_ids: frozenset[int] = frozenset()
    min_tokens: int = 0
    grammar_masks: torch.Tensor | None = None

    def row_paths(self) -> list[list[int]]:
        """The draft tokens between the context and each row (row 0: none)."""
        return self.draft.row_paths()


def processes(sampling: SamplingParams, history: RowHistory | None) -> bool:
    """Whether :func:`process_rows` changes anything for this request."""
    if history is None:
        return False
    return request_processes(sampling, history.grammar_masks is not None, history.min_tokens, history.stop_ids)


def request_processes(sampling: SamplingParams, constrained: bool, min_tokens: int, stop_ids: frozenset[int]) -> bool:
    """Whether a request's logits are processed at all: by its sampling settings, a grammar or ``min_tokens``."""
    return sampling.reads_history or constrained or (min_tokens > 0 and bool(stop_ids))


def process_rows(logits: torch.Tensor, sampling: SamplingParams, history: RowHistory | None) -> torch.Tensor:
    """[rows, vocab] raw logits → [rows, vocab] float32 logits with each row's processing applied (the input itself
    when nothing applies)."""
    if not processes(sampling, history):
        return logits
    assert history is not None
    rows, vocab = logits.shape
    device = logits.device
    paths = history.row_paths()
    generated = len(history.context) - history.prompt_length
    processed = logits.float().clone()
    if history.grammar_masks is not None:
        # The grammar first, as vLLM applies its bitmask before the sampler; -inf stays -inf under what follows.
        processed.masked_fill_(~history.grammar_masks.to(device), float("-inf"))
    stop_ids = [token for token in history.stop_ids if token < vocab]
    if history.min_tokens > 0 and stop_ids:
        # vLLM's min_tokens: the request cannot end before it has that many tokens, at rows whose prefix is short.
        short = [row for row, path in enumerate(paths) if generated + len(path) < history.min_tokens]
        if short:
            rows_index = torch.tensor(short, device=device).unsqueeze(1)
            processed[rows_index, torch.tensor(stop_ids, device=device)] = float("-inf")
    if sampling.logit_bias:
        ids = torch.tensor([token for token, _ in sampling.logit_bias if token < vocab], dtype=torch.long)
        bias = torch.tensor([value for token, value in sampling.logit_bias if token < vocab])
        processed[:, ids.to(device)] += bias.to(device)
    if sampling.penalizes:
        _penalize(processed, sampling, history, paths)
    return processed


def _penalize(logits: torch.Tensor, sampling: SamplingParams, history: RowHistory, paths: list[list[int]]) -> None:
    """vLLM's ``apply_penalties``, in place: repetition over prompt + output, then frequency and presence over the
    output (each row's output: the generated part of the context and the row's path)."""
    rows, vocab = logits.shape
    device = logits.device
    output = torch.tensor([t for t in history.context[history.prompt_length :] if t < vocab], dtype=torch.long)
    counts = torch.bincount(output, minlength=vocab).float().to(device).repeat(rows, 1)
    path_rows = [row for row, path in enumerate(paths) for token in path if token < vocab]
    path_tokens = [token for path in paths for token in path if token < vocab]
    if path_tokens:
        index = (torch.tensor(path_rows, device=device), torch.tensor(path_tokens, device=device))
        counts.index_put_(index, torch.ones(len(path_tokens), device=device), accumulate=True)
    in_output = counts > 0
    if sampling.repetition_penalty != 1.0:
        prompt = torch.tensor([t for t in history.context[: history.prompt_length] if t < vocab], dtype=torch.long)
        seen = in_output.clone()
        seen[:, prompt.to(device)] = True
        factor = torch.where(seen, sampling.repetition_penalty, 1.0)
        logits.copy_(torch.where(logits > 0, logits / factor, logits * factor))
    if sampling.frequency_penalty:
        logits -= sampling.frequency_penalty * counts
    if sampling.presence_penalty:
        logits -= sampling.presence_penalty * in_output.float()
