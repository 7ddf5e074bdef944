"""Train Medusa or Hydra heads for a target on a CPU: cached final hidden states, KL to the target.

Data as for EAGLE (:mod:`specdecode.train.data`, :func:`specdecode.train.eagle.compute_features`): the
target's own greedy answers and ShareGPT conversations the benchmark never draws, run through the target
once; only the final hidden state of every position is kept.  Row j of a sequence is position j's hidden
state; head k (1-based) learns the target's distribution of token j+1+k — what the target's LM head
gives at position j+k — by KL over the draft vocabulary (VocabTrim, as in
:mod:`specdecode.train.eagle`), summed over heads with Medusa's weights 0.8^(k-1) (Cai et al.: later
heads are less certain, and Medusa-1 down-weights them).  Hydra heads are fed the data's tokens j+1..j+k
(teacher forcing, as in Ankner et al.), which on self-distilled data are what a correct draft holds.

Rows are taken in contiguous runs so that the teacher's distribution of each position is computed once
for all heads.  The blocks start at zero (Medusa's initialisation): untrained heads repeat the target's
own next-token distribution, a sensible start.  The shared LM head is the target's, frozen.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specdecode.errors import SpecDecodeError
from specdecode.heads.medusa import DraftHeads, heads_for_target
from specdecode.models.base import LayerwiseExecution
from specdecode.train.common import (
    HeldOutAcceptance,
    Teacher,
    TrainResult,
    fit,
    kl_to_teacher,
    row_store,
    split_holdout,
    target_views,
    trainable_embed,
)
from specdecode.train.eagle import Features, draft_vocabulary

HEAD_WEIGHT = 0.8  # Medusa-1's per-head loss decay


@dataclass
class HeadsTrainConfig:
    kind: str = "medusa"  # or "hydra"
    num_heads: int = 4
    num_layers: int = 1  # residual layers per head
    prefix_window: int = 0  # Hydra++'s prefix attention over this many positions (0: none)
    draft_vocab: int = 8192  # VocabTrim: the heads' vocabulary (0: the target's whole vocabulary)
    epochs: int = 4
    run: int = 256  # contiguous rows per batch
    lr: float = 1e-3
    holdout: float = 0.05  # fraction of sequences kept out for the acceptance figures
    seed: int = 0
    checkpoint_seconds: float = 120.0
    bf16: bool = False  # matmuls of training in bf16 (autocast), see train.common.fit


@dataclass(kw_only=True)
class HeadsTrainResult(TrainResult):
    """The trained heads with their figures (acceptance per head, given the earlier heads were right and
    the data followed them)."""

    heads: DraftHeads


@dataclass
class Stream:
    """Every sequence end to end: ids [N + K + 1], final hidden states [N + K + 1, H] (padded so that a
    run's look-ahead never falls off the end), and for each of the N real rows the indices of its
    sequence's first and last positions."""

    ids: torch.Tensor
    finals: torch.Tensor
    first: torch.Tensor
    last: torch.Tensor

    @property
    def rows(self) -> int:
        return self.last.numel()


def make_stream(features: list[Features], heads: int, spill: Path | None = None) -> Stream:
    """Every sequence end to end; ``spill``: a file to keep the final hidden states in (:func:`row_store`),
    in the features' own precision (bf16 where kept so: each batch reads its rows as fp32)."""
    if not any(item.ids.numel() >= 2 for item in features):
        raise SpecDecodeError("heads: no training rows (sequences need at least 2 tokens)")
    lengths = torch.tensor([item.ids.numel() for item in features])
    total, first = int(lengths.sum()), features[0].final
    finals = row_store(total + heads + 1, first.shape[1], first.dtype, spill)  # zero rows pad the end
    offset = 0
    for item, length in zip(features, lengths.tolist()):  # one sequence at a time: never all of them in memory
        finals[offset : offset + length] = item.final
        offset += length
    ids = torch.cat([item.ids for item in features])
    ends = torch.cumsum(lengths, 0)
    return Stream(
        ids=torch.cat([ids, ids.new_zeros(heads + 1)]),
        finals=finals,
        first=torch.repeat_interleave(ends - lengths, lengths),
        last=torch.repeat_interleave(ends - 1, lengths),
    )


def read_states(heads: DraftHeads, stream: Stream, start: int, stop: int) -> torch.Tensor:
    """What the heads read of rows start..stop-1 [B, H]: their final hidden states, through the prefix attention
    (over each row's window within its own sequence) when the heads have one."""
    hidden = stream.finals[start:stop].float()
    prefix = heads.prefix
    if prefix is None:
        return hidden
    lo = max(0, start - prefix.window + 1)
    rows = torch.arange(lo, stop)
    sequence, positions = stream.first[lo:stop], rows - stream.first[lo:stop]
    q, k, v = prefix.project(stream.finals[lo:stop].float(), positions)
    reads = slice(start - lo, None)
    mask = prefix.in_window(positions[reads], positions) & (sequence[reads].unsqueeze(-1) == sequence)
    return prefix.attend(hidden, q[:, reads], k, v, mask)


def run_logits(
    heads: DraftHeads, embed, stream: Stream, start: int, stop: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Rows start..stop-1: every head's draft logits [B, draft_vocab] and validity [B] (the token it
    predicts lies in the row's sequence)."""
    hidden = read_states(heads, stream, start, stop)
    count, rows = stop - start, torch.arange(start, stop)
    embeds = embed(stream.ids[start + 1 : stop + heads.config.num_heads]) if heads.config.kind == "hydra" else None
    logits, valid = [], []
    for k in range(heads.config.num_heads):
        path = torch.stack([embeds[i : i + count] for i in range(k + 1)], dim=1) if embeds is not None else None
        logits.append(heads.logits(heads.head(k, hidden, path)))
        valid.append(rows + k + 1 <= stream.last[start:stop])
    return logits, valid


@torch.no_grad()
def held_out_acceptance(
    heads: DraftHeads, backend: LayerwiseExecution, embed, stream: Stream, run: int
) -> HeldOutAcceptance:
    """Per head: P(top-1 == the target's full-vocabulary top-1 | earlier heads right, data followed them), over every
    row and over the rows whose next token is the target's own choice too (:class:`HeldOutAcceptance`)."""
    k_heads = heads.config.num_heads
    right, tried = torch.zeros(2, k_heads), torch.zeros(2, k_heads)
    own_rows = 0
    full_head = backend.lm_head()
    for start in range(0, stream.rows, run):
        stop = min(start + run, stream.rows)
        logits, valid = run_logits(heads, embed, stream, start, stop)
        truths = backend.head_logits(stream.finals[start : stop + k_heads].float(), full_head).argmax(-1)
        # Row i's heads guess the tokens after token i + 1, which decoding would have chosen itself.
        own = valid[0] & (stream.ids[start + 1 : stop + 1] == truths[: stop - start])
        own_rows += int(own.sum())
        still = torch.stack([torch.ones(stop - start, dtype=torch.bool), own])
        for k in range(k_heads):
            truth = truths[k + 1 : k + 1 + stop - start]
            guess = heads.target_ids[logits[k].argmax(-1)]
            for kind in range(2):
                mask = still[kind] & valid[k]
                tried[kind, k] += mask.sum()
                correct = mask & (guess == truth)
                right[kind, k] += correct.sum()
                still[kind] = correct & (stream.ids[start + k + 2 : stop + k + 2] == truth)
    every, own_rates = (right / tried.clamp(min=1)).tolist()
    return HeldOutAcceptance(every, own_rates, own_rows)


def train_heads(
    target_backend: object,
    features: list[Features],
    config: HeadsTrainConfig,
    progress: bool = False,
    checkpoint: Path | None = None,
    spill: Path | None = None,
) -> HeadsTrainResult:
    """Fit fresh heads (or resume ``checkpoint``) to ``features`` computed for ``target_backend``; ``spill``: a
    directory where the final hidden states are kept in memory-mapped files (see :func:`row_store`)."""
    started = time.perf_counter()
    backend, layerwise = target_views(target_backend, config.kind)
    train, held = split_holdout(features, [f.ids.tolist() for f in features], config.holdout, config.seed, config.kind)

    ids = draft_vocabulary(train, config.draft_vocab, layerwise.output_weight().shape[0])
    heads = heads_for_target(
        target_backend, config.kind, config.num_heads, ids, config.num_layers, config.prefix_window
    )
    with torch.no_grad():
        for param in heads.blocks.parameters():
            param.zero_()
    teacher = Teacher(layerwise, ids)
    stream = make_stream(train, config.num_heads, spill and spill / "training-finals.bin")
    held_stream = make_stream(held, config.num_heads, spill and spill / "held-out-finals.bin")
    embed = trainable_embed(backend)

    def batch_loss(run: int) -> torch.Tensor:
        """Run ``run``'s KL per head, each averaged over its valid rows, summed with Medusa's weights."""
        start, stop = run * config.run, min((run + 1) * config.run, stream.rows)
        target = teacher.log_probs(stream.finals[start + 1 : stop + config.num_heads].float())
        logits, valid = run_logits(heads, embed, stream, start, stop)
        loss = torch.zeros(())
        for k, (draft, ok) in enumerate(zip(logits, valid)):
            kl = kl_to_teacher(target[k : k + stop - start], draft)
            loss = loss + HEAD_WEIGHT**k * (kl * ok).sum() / ok.sum().clamp(min=1)
        return loss

    runs = math.ceil(stream.rows / config.run)
    losses = fit(
        heads,
        [p for p in heads.parameters() if p.requires_grad],  # the shared LM head stays the target's
        epochs=config.epochs,
        steps_per_epoch=runs,
        lr=config.lr,
        epoch_batches=lambda epoch: torch.randperm(
            runs, generator=torch.Generator().manual_seed(config.seed + epoch)
        ).tolist(),
        batch_loss=batch_loss,
        identity=heads.config,
        model_key="heads",
        checkpoint=checkpoint,
        checkpoint_seconds=config.checkpoint_seconds,
        progress=progress,
        bf16=config.bf16,
    )
    valid_rows = (torch.arange(stream.rows) + 1 <= stream.last).sum()
    held_rows = (torch.arange(held_stream.rows) + 1 <= held_stream.last).sum()
    return HeadsTrainResult(
        heads=heads,
        rows=int(valid_rows),
        held_out_rows=int(held_rows),
        acceptance=held_out_acceptance(heads, layerwise, embed, held_stream, config.run),
        epoch_losses=losses,
        seconds=time.perf_counter() - started,
    )
