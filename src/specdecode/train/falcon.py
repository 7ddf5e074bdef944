"""Train a Falcon head for a target on a CPU: final features cached once, blocks unrolled, glancing distillation.

Data as for EAGLE, Medusa and Hydra (:mod:`specdecode.train.features`): the target's own greedy answers and
ShareGPT conversations the benchmark never draws, run through the target once; the final hidden state of
every position is kept.  Row j of a sequence is the pair (feature of token j, token j+1) at position j+1;
rows are cut into windows and each window into blocks of ``block`` rows that see one another and every row
before them (the relaxed causal mask).  Row j learns the target's feature j+``block`` — by regression
(smooth L1, as EAGLE-1 and Falcon do) — and its distribution of token j+``block``+1 (KL over the draft
vocabulary, teacher from the target's own LM head rows, as every head here).

``passes`` unrolls drafting as EAGLE's training-time test does: in pass p > 1 row j is fed the feature that
row j-``block`` predicted in pass p-1 (with the true token j+1), and its block sees the true rows before its
path, the blocks of its path in the earlier passes and itself — what a chain of p passes sees at inference.

Coupled Sequential Glancing Distillation, in a simple form: the first pass is run once without gradients and
its wrong guesses counted; a fraction λ of that many blocks (λ decaying from ``glance_start`` to
``glance_end`` over the run, as the paper's schedule) then have their first rows' inputs — feature and token
together, "coupled" — replaced by the ground truth of what those rows predict (the rows ``block`` later), so
the block's later rows learn to read the tokens drafted before them in the same block.  Rows given their own
answer are left out of the loss.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specdecode.config import DEFAULT_DRAFT_VOCAB
from specdecode.errors import SpecDecodeError
from specdecode.heads.falcon import FalconConfig, FalconHead
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
from specdecode.train.eagle import Features, draft_vocabulary, start_from_target


@dataclass
class FalconTrainConfig:
    draft_vocab: int = DEFAULT_DRAFT_VOCAB  # VocabTrim: the head's vocabulary (0: the target's whole vocabulary)
    block: int = 2  # tokens drafted per head pass
    passes: int = 2  # head passes unrolled in training
    epochs: int = 3
    window: int = 256  # rows per training window (a multiple of ``block``; its first rows see no earlier context)
    batch_windows: int = 8
    lr: float = 1e-3
    feature_weight: float = 1.0  # of the feature regression beside the KL (the paper's v_w)
    glance_start: float = 0.45  # λ at the start: the share of wrong guesses whose blocks are glanced
    glance_end: float = 0.1  # ... and at the end (the paper's schedule: 0.35 (E - e) / E + 0.1)
    holdout: float = 0.05  # fraction of sequences kept out for the acceptance figures
    seed: int = 0
    checkpoint_seconds: float = 120.0
    bf16: bool = False  # matmuls of training in bf16 (autocast), see train.common.fit


@dataclass(kw_only=True)
class FalconTrainResult(TrainResult):
    """The trained head with its figures (acceptance per drafted token, ``block`` per pass)."""

    head: FalconHead


@dataclass
class Batch:
    """Training windows as the head reads them, in fp32, [B, T] each."""

    features: torch.Tensor  # [B, T, H] target feature of token j
    tokens: torch.Tensor  # [B, T] token j+1
    positions: torch.Tensor  # [B, T] j+1
    targets: torch.Tensor  # [B, T, H] target feature of token j+block: what row j predicts
    ahead: torch.Tensor  # [B, T] token j+block+1: with ``targets``, the input of row j+block (its glance)
    valid: torch.Tensor  # [B, T] bool: row j and its target exist
    glanceable: torch.Tensor  # [B, T] bool: row j+block exists


@dataclass
class Windows:
    """Training rows cut into windows of T rows, kept as indices into one copy of the final features (in the
    dtype they were computed in; :meth:`batch` gathers a batch in fp32)."""

    rows: torch.Tensor  # [N + 1, H]: every sequence's features, then one zero row for padding
    ids: torch.Tensor  # [N + 1]: every sequence's tokens, then a zero
    index: torch.Tensor  # [W, T] row of ``rows`` (feature of token j) read by window w at row t
    positions: torch.Tensor  # [W, T]
    valid: torch.Tensor  # [W, T]
    glanceable: torch.Tensor  # [W, T]
    block: int

    @property
    def count(self) -> int:
        return self.index.shape[0]

    def batch(self, index: torch.Tensor) -> Batch:
        rows = self.index[index]
        ahead = (rows + self.block).clamp(max=self.rows.shape[0] - 1)
        valid, glanceable = self.valid[index], self.glanceable[index]
        return Batch(
            features=self.rows[rows].float(),
            tokens=self.ids[(rows + 1).clamp(max=self.ids.numel() - 1)],  # the padding row's: the final zero
            positions=self.positions[index],
            targets=torch.where(valid[..., None], self.rows[ahead].float(), 0.0),
            ahead=torch.where(glanceable, self.ids[(ahead + 1).clamp(max=self.ids.numel() - 1)], 0),
            valid=valid,
            glanceable=glanceable,
        )


def make_windows(features: list[Features], window: int, block: int, spill: Path | None = None) -> Windows:
    """Cut ``features`` into windows of ``window`` rows (rounded up to whole blocks); ``spill``: a file to keep the
    features in rather than memory (:func:`specdecode.train.common.row_store`)."""
    window = -(-window // block) * block
    index, positions, valid, glanceable = [], [], [], []
    offset = 0
    padding = sum(item.ids.numel() for item in features)  # the zero row after all of them
    for item in features:
        n = item.ids.numel()
        rows = n - 1  # row j: (feature of j, token j+1) → feature j+block, token j+block+1
        for start in range(0, rows, window):
            j = torch.arange(start, start + window)
            inside = j < rows
            index.append(torch.where(inside, offset + j, padding))
            positions.append(j + 1)
            valid.append(inside & (j + block <= n - 1))
            glanceable.append(inside & (j + block < rows))
        offset += n
    if not index:
        raise SpecDecodeError("falcon: no training rows (sequences need at least 2 tokens)")
    first = features[0].final
    store = row_store(padding + 1, first.shape[1], first.dtype, spill)
    offset = 0
    for item in features:  # one sequence at a time: the features may be memory-mapped shards
        store[offset : offset + item.ids.numel()] = item.final
        offset += item.ids.numel()
    return Windows(
        rows=store,
        ids=torch.cat([*(item.ids for item in features), torch.zeros(1, dtype=torch.long)]),
        index=torch.stack(index),
        positions=torch.stack(positions),
        valid=torch.stack(valid),
        glanceable=torch.stack(glanceable),
        block=block,
    )


def pass_mask(length: int, block: int, passes: int, device: torch.device) -> torch.Tensor:
    """[T, passes * T] bool: what row j of pass ``passes`` (1-based) sees of the keys of passes 1..``passes``.

    Its block starts at s; the path back to the true rows goes through block s - k of the pass before, and so
    on (k = ``block``): it sees the true rows before s - (passes - 2) k (in pass 1, its own block too) and, of
    each pass q from 2 on, the block s - (passes - q) k."""
    rows = torch.arange(length, device=device)
    start = rows // block * block
    parts = [rows[None, :] < (start - (passes - 2) * block)[:, None]]
    for q in range(2, passes + 1):
        begin = start - (passes - q) * block
        parts.append((rows[None, :] >= begin[:, None]) & (rows[None, :] < begin[:, None] + block))
    return torch.cat(parts, dim=1)


def unrolled(
    head: FalconHead, embed, batch: Batch, passes: int, inputs: tuple[torch.Tensor, torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """The head's outputs [B, T, H] of every pass; ``inputs``: pass 1's (features, tokens) in place of the batch's
    (the glanced ones)."""
    block, length = head.config.block, batch.tokens.shape[1]
    features, tokens = inputs if inputs is not None else (batch.features, batch.tokens)
    cos, sin = head.rope(batch.positions)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    outputs: list[torch.Tensor] = []
    hidden = head.fuse(features)
    for p in range(1, passes + 1):
        if p > 1:  # row j reads what row j - block predicted in the pass before; the first blocks read nothing
            hidden = head.fuse(F.pad(outputs[-1], (0, 0, block, 0))[:, :length])
            tokens = batch.tokens
        q, k, v = head.layer.project(hidden, embed(tokens), cos, sin)
        keys.append(k)
        values.append(v)
        mask = pass_mask(length, block, p, q.device)
        attended = F.scaled_dot_product_attention(
            q, torch.cat(keys, dim=-2), torch.cat(values, dim=-2), attn_mask=mask, enable_gqa=True
        )
        outputs.append(head.layer.finish(hidden, attended))
    return outputs


def pass_valid(batch: Batch, block: int, p: int) -> torch.Tensor:
    """[B, T] the rows of pass ``p`` with a target and a path back to true rows."""
    rows = torch.arange(batch.valid.shape[1])
    return batch.valid & (rows >= (p - 1) * block)


def glance(
    batch: Batch, wrong: torch.Tensor, share: float, block: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pass 1's inputs with ``share`` x (wrong guesses of each window) of its blocks glanced, and the rows that saw
    their own answer: a glanced block's first m rows (m drawn in 1..block-1) are given the inputs of the rows
    ``block`` later — their targets' features with the tokens after them."""
    windows, length = batch.tokens.shape
    if block < 2:  # a block of one row has no later row to glance
        return batch.features, batch.tokens, torch.zeros_like(batch.valid)
    blocks = length // block
    # A block can be glanced when its first rows' answers exist; those all do when its row block - 2 does.
    can = batch.glanceable.view(windows, blocks, block)[:, :, block - 2]
    counts = (share * wrong.sum(1).float()).floor().long()
    order = torch.rand(windows, blocks, generator=generator).masked_fill(~can, 2.0).argsort(dim=1)
    ranks = torch.empty_like(order)
    ranks.scatter_(1, order, torch.arange(blocks).expand(windows, -1))
    chosen = can & (ranks < counts[:, None])
    revealed = torch.randint(1, block, (windows, blocks, 1), generator=generator)
    glanced = (chosen[..., None] & (torch.arange(block) < revealed)).view(windows, length) & batch.glanceable
    features = torch.where(glanced[..., None], batch.targets, batch.features)
    tokens = torch.where(glanced, batch.ahead, batch.tokens)
    return features, tokens, glanced


@torch.no_grad()
def held_out_acceptance(
    head: FalconHead, backend: LayerwiseExecution, embed, windows: Windows, passes: int, batch_windows: int
) -> HeldOutAcceptance:
    """Per drafted token (``block`` a pass): P(head top-1 == target top-1 over the full vocabulary | the earlier
    tokens of the chain right), chains rooted at every block of true rows (:class:`HeldOutAcceptance`).  A chain is
    read as drafting reads it (``own``) when every token its root block is fed is the target's greedy choice after
    the row before, and it goes on to a token only while the data's token there is the target's choice too."""
    block = head.config.block
    depth = block * passes
    right, tried = torch.zeros(2, depth), torch.zeros(2, depth)
    own_rows = 0
    full_head = backend.lm_head()
    for index in torch.arange(windows.count).split(batch_windows):
        batch = windows.batch(index)
        truth = backend.head_logits(batch.targets, full_head).argmax(-1)
        chosen = backend.head_logits(batch.features, full_head).argmax(-1)
        blocks = batch.tokens.shape[1] // block
        fed_own = batch.tokens == chosen
        own_rows += int((fed_own & batch.valid).sum())
        own_fed = (fed_own | ~batch.valid).view(-1, blocks, block).all(-1)
        # Row j predicts token j + block + 1, which the data holds as the next rows' input (``ahead``).
        own_next = batch.glanceable & (batch.ahead == truth)
        correct, valid, own = [], [], []
        for p, out in enumerate(unrolled(head, embed, batch, passes), start=1):
            ok = pass_valid(batch, block, p)
            guess = head.target_ids[head.logits(out).argmax(-1)]
            # Chain rooted at block b: pass p reads block b + p - 1.
            shift = (p - 1) * block
            for kept, rows in ((correct, ok & (guess == truth)), (valid, ok), (own, own_next)):
                kept.append(F.pad(rows[:, shift:], (0, shift)).view(-1, blocks, block))
        correct_all, valid_all, own_all = (torch.cat(rows, dim=-1) for rows in (correct, valid, own))
        roots = valid_all[..., 0]
        still = torch.stack([roots, roots & own_fed])  # [every, own] x [B, blocks]
        for d in range(depth):
            mask = still & valid_all[..., d]
            tried[:, d] += mask.flatten(1).sum(1)
            still = mask & correct_all[..., d]
            right[:, d] += still.flatten(1).sum(1)
            still[1] &= own_all[..., d]
    every, own_rates = (right / tried.clamp(min=1)).tolist()
    return HeldOutAcceptance(every, own_rates, own_rows)


def train_falcon(
    target_backend: object,
    features: list[Features],
    config: FalconTrainConfig,
    progress: bool = False,
    checkpoint: Path | None = None,
    spill: Path | None = None,
) -> FalconTrainResult:
    """Fit a fresh head (or resume ``checkpoint``) to ``features`` (final hidden states) computed for
    ``target_backend``; ``spill``: a directory where the training rows are kept in memory-mapped files."""
    started = time.perf_counter()
    backend, layerwise = target_views(target_backend, "falcon")
    if config.passes < 1:
        raise SpecDecodeError(f"falcon: passes must be positive, got {config.passes}")
    train, held = split_holdout(features, [f.ids.tolist() for f in features], config.holdout, config.seed, "falcon")
    vocab_size = layerwise.output_weight().shape[0]
    ids = draft_vocabulary(train, config.draft_vocab, vocab_size)
    head_config = FalconConfig.for_target(
        backend.decoder_shape(), backend.num_layers, vocab_size, ids.numel(), config.block
    )
    with torch.random.fork_rng():  # the same initial weights in every run of these settings, the caller's RNG untouched
        torch.manual_seed(config.seed)
        head = FalconHead(head_config)
    head.set_draft_vocabulary(ids)
    start_from_target(head, backend, layerwise)
    teacher = Teacher(layerwise, ids)
    block = config.block
    windows = make_windows(train, config.window, block, spill and spill / "training-rows.bin")
    held_windows = make_windows(held, config.window, block, spill and spill / "held-out-rows.bin")
    embed = trainable_embed(backend)
    steps_per_epoch = math.ceil(windows.count / config.batch_windows)
    total = config.epochs * steps_per_epoch

    def batch_loss(item: tuple[int, torch.Tensor]) -> torch.Tensor:
        """Every pass's KL and feature regression, each averaged over its valid rows, summed over the passes."""
        step, index = item
        batch = windows.batch(index)
        teacher_logprobs = teacher.log_probs(batch.targets)
        with torch.no_grad():
            first = head.logits(unrolled(head, embed, batch, 1)[0])
            wrong = batch.valid & (first.argmax(-1) != teacher_logprobs.argmax(-1))
        share = config.glance_end + (config.glance_start - config.glance_end) * (1 - step / total)
        generator = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
        features, tokens, glanced = glance(batch, wrong, share, block, generator)
        loss = torch.zeros(())
        for p, out in enumerate(unrolled(head, embed, batch, config.passes, (features, tokens)), start=1):
            valid = pass_valid(batch, block, p)
            if p == 1:
                valid = valid & ~glanced
            count = valid.sum().clamp(min=1)
            kl = kl_to_teacher(teacher_logprobs, head.logits(out))
            regression = F.smooth_l1_loss(out.float(), batch.targets, reduction="none").mean(-1)
            loss = loss + ((kl + config.feature_weight * regression) * valid).sum() / count
        return loss

    def epoch_batches(epoch: int) -> list[tuple[int, torch.Tensor]]:
        order = torch.randperm(windows.count, generator=torch.Generator().manual_seed(config.seed + epoch))
        return [(epoch * steps_per_epoch + n, index) for n, index in enumerate(order.split(config.batch_windows))]

    losses = fit(
        head,
        list(head.parameters()),
        epochs=config.epochs,
        steps_per_epoch=steps_per_epoch,
        lr=config.lr,
        epoch_batches=epoch_batches,
        batch_loss=batch_loss,
        loss_scale=config.passes,
        identity={
            **head_config.to_dict(),
            "passes": config.passes,
            "feature_weight": config.feature_weight,
            "glance": [config.glance_start, config.glance_end],
        },
        model_key="head",
        checkpoint=checkpoint,
        checkpoint_seconds=config.checkpoint_seconds,
        progress=progress,
        bf16=config.bf16,
    )
    return FalconTrainResult(
        head=head,
        rows=int(windows.valid.sum()),
        held_out_rows=int(held_windows.valid.sum()),
        acceptance=held_out_acceptance(head, layerwise, embed, held_windows, config.passes, config.batch_windows),
        epoch_losses=losses,
        seconds=time.perf_counter() - started,
    )
