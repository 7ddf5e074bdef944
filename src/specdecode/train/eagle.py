"""Train an EAGLE-3 head for a target on a CPU: target features cached once, training-time test, KL loss.

Data (:mod:`specdecode.train.data`): the target's own greedy answers to prompts the benchmark never draws
(self-distillation: what the head will be asked to predict) and real ShareGPT conversations the benchmark
never draws, prefilled (far cheaper per token than generating).  One target forward per sequence gives
every position's fused features (the three ``aux_layers``) and final hidden state; they are cached on
disk, so a rerun — or a resumed run — starts training at once.

Training follows EAGLE-3 / ``speculators``: row j of a sequence is the pair (features of token j,
token j+1) and learns the target's distribution of token j+2 (KL over the draft vocabulary, teacher from
the target's final hidden state through its own LM head rows).  Training-time test unrolls ``ttt_steps``
drafting steps: step k feeds the layer's step k-1 output with token j+1+k and learns the distribution of
token j+2+k; its attention sees the true rows up to j (causal) and the same row's earlier steps (the
diagonal) — exactly what a chain draft sees at inference.  The draft vocabulary (VocabTrim) is the
``draft_vocab`` tokens most frequent in the data.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from specdecode.config import DEFAULT_DRAFT_VOCAB
from specdecode.errors import SpecDecodeError
from specdecode.heads.eagle import EagleConfig, EagleHead
from specdecode.heads.storage import target_mismatch
from specdecode.models.base import HiddenStates, LayerwiseExecution
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


@dataclass
class EagleTrainConfig:
    draft_vocab: int = DEFAULT_DRAFT_VOCAB  # VocabTrim: the head's vocabulary (0: the target's whole vocabulary)
    ttt_steps: int = 4  # drafting steps unrolled in training
    epochs: int = 4
    window: int = 256  # rows per training window (a window's first row sees no earlier context)
    batch_windows: int = 8
    lr: float = 1e-3
    holdout: float = 0.05  # fraction of sequences kept out for the acceptance figures
    seed: int = 0
    checkpoint_seconds: float = 120.0
    bf16: bool = False  # matmuls of training in bf16 (autocast), see train.common.fit


@dataclass
class Features:
    """One token sequence through the target: ids [n], fused-layer features [n, k*H], final hidden [n, H]."""

    ids: torch.Tensor
    aux: torch.Tensor
    final: torch.Tensor


@dataclass(kw_only=True)
class EagleTrainResult(TrainResult):
    """The trained head with its figures (acceptance per drafting step; losses per step, as logged)."""

    head: EagleHead


@torch.inference_mode()
def compute_features(
    backend: HiddenStates, sequences: list[list[int]], aux_layers: tuple[int, ...], progress: bool
) -> list[Features]:
    """One target forward per sequence, keeping the fused layers' inputs and the final hidden state."""
    wanted = (*aux_layers, backend.num_layers)
    out: list[Features] = []
    no_rows = torch.empty(0, dtype=torch.long)
    width = backend.hidden_size
    for ids in tqdm(sequences, desc="target features", unit="seq", disable=not progress):
        tokens = torch.tensor(ids, dtype=torch.long)
        hidden = backend.forward(
            tokens, backend.new_cache(), logits_rows=no_rows, hidden_layers=wanted, invariant=False
        ).hidden
        out.append(Features(tokens, hidden[:, :-width].clone(), hidden[:, -width:].clone()))
    return out


def draft_vocabulary(features: list[Features], size: int, vocab_size: int) -> torch.Tensor:
    """VocabTrim: the ``size`` ids most frequent in the data (ties by id), ascending."""
    if size <= 0 or size >= vocab_size:
        return torch.arange(vocab_size)
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for item in features:
        counts += torch.bincount(item.ids, minlength=vocab_size)
    return torch.argsort(counts, descending=True, stable=True)[:size].sort().values


@dataclass
class Batch:
    """Training windows as the head reads them, in fp32: [B, T] each (``steps`` leading where per step)."""

    aux: torch.Tensor  # [B, T, k*H]
    positions: torch.Tensor  # [B, T] position of token j+1
    tokens: torch.Tensor  # [S, B, T] token fed at step s (j+1+s)
    finals: torch.Tensor  # [S, B, T, H] target final hidden state whose distribution step s learns (j+1+s)
    valid: torch.Tensor  # [S, B, T] bool


@dataclass
class Windows:
    """Training rows cut into windows of T rows, kept as indices into one copy of the features.

    The features stay in the dtype they were computed in (bf16 halves their memory) and each row's final
    hidden state is stored once although ``steps`` drafting steps read it; :meth:`batch` gathers a batch
    in fp32.  A million rows of SmolLM2 features fit in under 5 GB this way."""

    aux_rows: torch.Tensor  # [N + 1, k*H]: every sequence's rows, then one zero row for padding
    final_rows: torch.Tensor  # [N + 1, H]
    aux_index: torch.Tensor  # [W, T] row of aux_rows read by window w at row t
    positions: torch.Tensor  # [W, T]
    tokens: torch.Tensor  # [S, W, T]
    final_index: torch.Tensor  # [S, W, T] row of final_rows step s learns from
    valid: torch.Tensor  # [S, W, T] bool

    @property
    def count(self) -> int:
        return self.aux_index.shape[0]

    def batch(self, index: torch.Tensor) -> Batch:
        return Batch(
            aux=self.aux_rows[self.aux_index[index]].float(),
            positions=self.positions[index],
            tokens=self.tokens[:, index],
            finals=self.final_rows[self.final_index[:, index]].float(),
            valid=self.valid[:, index],
        )


def make_windows(features: list[Features], window: int, steps: int, spill: Path | None = None) -> Windows:
    """Cut ``features`` into windows; ``spill``: a path prefix under which the rows are kept in files
    (``<spill>-aux.bin``, ``<spill>-final.bin``) rather than in memory."""
    aux_index, positions, tokens, final_index, valid = [], [], [], [], []
    offset = 0
    padding = sum(item.ids.numel() for item in features)  # the zero row after all of them
    for item in features:
        n = item.ids.numel()
        rows = n - 1  # row j: (features of j, token j+1) → distribution of token j+2, read at j+1
        for start in range(0, rows, window):
            j = torch.arange(start, start + window)
            inside = j < rows
            aux_index.append(torch.where(inside, offset + j, padding))
            positions.append(j + 1)
            read = j[None, :] + 1 + torch.arange(steps)[:, None]  # [S, T]
            ok = (read <= n - 1) & inside[None, :]
            tokens.append(torch.where(ok, item.ids[read.clamp(max=n - 1)], 0))
            final_index.append(torch.where(ok, offset + read, padding))
            valid.append(ok)
        offset += n
    if not aux_index:
        raise SpecDecodeError("eagle: no training rows (sequences need at least 2 tokens)")
    first = features[0]
    aux_rows = row_store(padding + 1, first.aux.shape[1], first.aux.dtype, spill and Path(f"{spill}-aux.bin"))
    final_rows = row_store(padding + 1, first.final.shape[1], first.final.dtype, spill and Path(f"{spill}-final.bin"))
    offset = 0
    for item in features:  # one sequence at a time: the features may be memory-mapped shards
        n = item.ids.numel()
        aux_rows[offset : offset + n] = item.aux
        final_rows[offset : offset + n] = item.final
        offset += n
    return Windows(
        aux_rows=aux_rows,
        final_rows=final_rows,
        aux_index=torch.stack(aux_index),
        positions=torch.stack(positions),
        tokens=torch.stack(tokens, dim=1),
        final_index=torch.stack(final_index, dim=1),
        valid=torch.stack(valid, dim=1),
    )


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """Training-time test attention for step ``len(keys) - 1``: each row sees step 0's rows up to itself
    (causal) and its own entries of steps 1..now (the diagonal).  q [B, h, T, d]; keys/values [B, kv, T, d]."""
    groups = q.shape[1] // keys[0].shape[1]
    expand = [k.repeat_interleave(groups, dim=1) for k in keys]
    spread = [v.repeat_interleave(groups, dim=1) for v in values]
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = (q @ expand[0].transpose(-1, -2)) * scale
    length = q.shape[2]
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    diagonal = [((q * k).sum(-1, keepdim=True)) * scale for k in expand[1:]]
    weights = torch.softmax(torch.cat([scores, *diagonal], dim=-1), dim=-1)
    out = weights[..., :length] @ spread[0]
    for step, v in enumerate(spread[1:]):
        out = out + weights[..., length + step : length + step + 1] * v
    return out


@torch.no_grad()
def start_from_target(head: EagleHead, backend: HiddenStates, layerwise: LayerwiseExecution) -> None:
    """Start the head from the target's own output stage: its LM head rows of the draft vocabulary (with the
    final norm's scale folded in, the head's norm starting at 1) and ``fc`` passing the highest fused
    layer's state through.  An untrained head then already reads its residual stream the way the target
    reads its own, so a CPU-sized training budget goes into the one-position shift it has to learn."""
    width = head.config.hidden_size
    scale = backend.final_norm(torch.ones(1, width, dtype=backend.dtype))[0].float().clone()
    weight = layerwise.output_weight()
    rows = weight.index_select(0, head.target_ids.to(weight.device)).float().cpu()
    head.lm_head.weight.copy_(rows * scale)
    head.norm.weight.fill_(1.0)
    head.fc.weight.zero_()
    head.fc.weight[:, -width:] = torch.eye(width)


def weights_digest(head: EagleHead) -> str:
    """SHA-256 of a head's tensors (names, shapes and bytes, in order): what a checkpoint records of the
    weights a run started from."""
    digest = hashlib.sha256()
    for name, tensor in head.state_dict().items():
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def unrolled_logits(head: EagleHead, embed: Callable[[torch.Tensor], torch.Tensor], batch: Batch) -> list[torch.Tensor]:
    """Draft logits [B, T, draft_vocab] of every training-time-test step."""
    hidden = head.fuse(batch.aux)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    logits = []
    for step in range(batch.tokens.shape[0]):
        cos, sin = head.rope(batch.positions + step)
        q, k, v = head.layer.project(hidden, embed(batch.tokens[step]), cos, sin)
        keys.append(k)
        values.append(v)
        hidden = head.layer.finish(hidden, ttt_attention(q, keys, values))
        logits.append(head.logits(hidden))
    return logits


@torch.no_grad()
def held_out_acceptance(
    head: EagleHead, backend: LayerwiseExecution, embed, windows: Windows, batch_windows: int
) -> HeldOutAcceptance:
    """The head's held-out acceptance per drafting step (:class:`HeldOutAcceptance`)."""
    steps = windows.tokens.shape[0]
    right, tried = torch.zeros(2, steps), torch.zeros(2, steps)
    own_rows = 0
    full_head = backend.lm_head()
    target_ids = head.target_ids
    for index in torch.arange(windows.count).split(batch_windows):
        batch = windows.batch(index)
        # Row j feeds token j + 1: the target's own where it is its greedy choice after row j's features.
        before = windows.final_rows[windows.final_index[0, index] - 1].float()
        chosen = backend.head_logits(before, full_head).argmax(-1)
        still = torch.stack([batch.valid[0], batch.valid[0] & (batch.tokens[0] == chosen)])
        own_rows += int(still[1].sum())
        for step, logits in enumerate(unrolled_logits(head, embed, batch)):
            truth = backend.head_logits(batch.finals[step], full_head).argmax(-1)
            guess = target_ids[logits.argmax(-1)]
            for kind in range(2):
                mask = still[kind] & batch.valid[step]
                tried[kind, step] += mask.sum()
                correct = mask & (guess == truth)
                right[kind, step] += correct.sum()
                still[kind] = correct
            if step + 1 < steps:  # the next step's token, fed where this one was right, is the target's own
                still[1] &= batch.tokens[step + 1] == truth
    every, own = (right / tried.clamp(min=1)).tolist()
    return HeldOutAcceptance(every, own, own_rows)


def train_eagle(
    target_backend: object,
    features: list[Features],
    config: EagleTrainConfig,
    progress: bool = False,
    checkpoint: Path | None = None,
    initial: EagleHead | None = None,
    spill: Path | None = None,
) -> EagleTrainResult:
    """Fit a fresh head (or resume ``checkpoint``) to ``features`` computed for ``target_backend``; ``initial``:
    start from that head (its layout and draft vocabulary) rather than from the target's own output stage;
    ``spill``: a directory where the training rows are kept in memory-mapped files (see :func:`row_store`)."""
    started = time.perf_counter()
    backend, layerwise = target_views(target_backend, "eagle")
    train, held = split_holdout(features, [f.ids.tolist() for f in features], config.holdout, config.seed, "eagle")

    vocab_size = layerwise.output_weight().shape[0]
    if initial is None:
        ids = draft_vocabulary(train, config.draft_vocab, vocab_size)
        head_config = EagleConfig.for_target(backend.decoder_shape(), backend.num_layers, vocab_size, ids.numel())
        head = EagleHead(head_config)
        head.set_draft_vocabulary(ids)
        start_from_target(head, backend, layerwise)
        identity: dict = head_config.to_dict()
    else:
        head_config = initial.config
        mismatch = target_mismatch(head_config, backend, vocab_size)
        if mismatch is not None:
            raise SpecDecodeError(
                f"eagle: the head to start from is for a target with (d, layers, tokens) {mismatch[0]}; this one "
                f"has {mismatch[1]}"
            )
        head = EagleHead(head_config)
        head.load_state_dict(initial.state_dict())
        ids = head.target_ids
        # A checkpoint resumes only a run that started from these very weights.
        identity = {**head_config.to_dict(), "initial": weights_digest(initial)}
    teacher = Teacher(layerwise, ids)
    windows = make_windows(train, config.window, config.ttt_steps, spill and spill / "training-rows")
    held_windows = make_windows(held, config.window, config.ttt_steps, spill and spill / "held-out-rows")
    embed = trainable_embed(backend)

    def batch_loss(index: torch.Tensor) -> torch.Tensor:
        """Every training-time-test step's KL, each averaged over its valid rows, summed over the steps."""
        batch = windows.batch(index)
        loss = torch.zeros(())
        for step, logits in enumerate(unrolled_logits(head, embed, batch)):
            kl = kl_to_teacher(teacher.log_probs(batch.finals[step]), logits)
            valid = batch.valid[step]
            loss = loss + (kl * valid).sum() / valid.sum().clamp(min=1)
        return loss

    count = windows.count
    losses = fit(
        head,
        list(head.parameters()),
        epochs=config.epochs,
        steps_per_epoch=math.ceil(count / config.batch_windows),
        lr=config.lr,
        epoch_batches=lambda epoch: torch.randperm(count, generator=torch.Generator().manual_seed(epoch)).split(
            config.batch_windows
        ),
        batch_loss=batch_loss,
        loss_scale=config.ttt_steps,
        identity=identity,
        model_key="head",
        checkpoint=checkpoint,
        checkpoint_seconds=config.checkpoint_seconds,
        progress=progress,
        bf16=config.bf16,
    )
    return EagleTrainResult(
        head=head,
        rows=int(windows.valid[0].sum()),
        held_out_rows=int(held_windows.valid[0].sum()),
        acceptance=held_out_acceptance(head, layerwise, embed, held_windows, config.batch_windows),
        epoch_losses=losses,
        seconds=time.perf_counter() - started,
    )
