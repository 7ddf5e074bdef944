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

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from specdecode.config import DEFAULT_DRAFT_VOCAB
from specdecode.errors import SpecDecodeError
from specdecode.heads.eagle import EagleConfig, EagleHead
from specdecode.models.base import HiddenStates, LayerwiseExecution, require_capability


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


@dataclass
class Features:
    """One token sequence through the target: ids [n], fused-layer features [n, k*H], final hidden [n, H]."""

    ids: torch.Tensor
    aux: torch.Tensor
    final: torch.Tensor


@dataclass
class EagleTrainResult:
    head: EagleHead
    rows: int
    held_out_rows: int
    #: acceptance[k]: on held-out rows, how often the head's top-1 at drafting step k equals the target's
    #: (over the whole vocabulary) given that steps 0..k-1 were right.
    acceptance: list[float]
    epoch_losses: list[float] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def expected_accepted(self) -> float:
        """Tokens a greedy chain of ``len(acceptance)`` drafts would get accepted on average."""
        total, survive = 0.0, 1.0
        for rate in self.acceptance:
            survive *= rate
            total += survive
        return total


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
        hidden = backend.forward(tokens, backend.new_cache(), logits_rows=no_rows, hidden_layers=wanted).hidden
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
class Windows:
    """Training rows cut into windows: [W, T] each (``steps`` leading where per step)."""

    aux: torch.Tensor  # [W, T, k*H]
    positions: torch.Tensor  # [W, T] position of token j+1
    tokens: torch.Tensor  # [S, W, T] token fed at step s (j+1+s)
    finals: torch.Tensor  # [S, W, T, H] target final hidden state whose distribution step s learns (j+1+s)
    valid: torch.Tensor  # [S, W, T] bool


def make_windows(features: list[Features], window: int, steps: int) -> Windows:
    aux, positions, tokens, finals, valid = [], [], [], [], []
    for item in features:
        n = item.ids.numel()
        rows = n - 1  # row j: (features of j, token j+1) → distribution of token j+2, read at j+1
        for start in range(0, rows, window):
            count = min(window, rows - start)
            j = torch.arange(start, start + window)
            aux.append(F.pad(item.aux[start : start + count], (0, 0, 0, window - count)))
            positions.append(j + 1)
            read = j[None, :] + 1 + torch.arange(steps)[:, None]  # [S, T]
            ok = (read <= n - 1) & (j[None, :] < start + count)
            clamped = read.clamp(max=n - 1)
            tokens.append(torch.where(ok, item.ids[clamped], 0))
            finals.append(item.final[clamped] * ok[..., None])
            valid.append(ok)
    if not aux:
        raise SpecDecodeError("eagle: no training rows (sequences need at least 2 tokens)")
    return Windows(
        aux=torch.stack(aux),
        positions=torch.stack(positions),
        tokens=torch.stack(tokens, dim=1),
        finals=torch.stack(finals, dim=1),
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


class _Teacher:
    """The target's distribution over the draft vocabulary from its final hidden states."""

    def __init__(self, backend: LayerwiseExecution, ids: torch.Tensor) -> None:
        self.backend = backend
        self.weight = backend.output_weight().index_select(0, ids).contiguous()

    def log_probs(self, finals: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(self.backend.head_logits(finals, lambda x: x @ self.weight.T), dim=-1)


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


def unrolled_logits(
    head: EagleHead, embed: Callable[[torch.Tensor], torch.Tensor], batch: Windows
) -> list[torch.Tensor]:
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


def _select(windows: Windows, index: torch.Tensor) -> Windows:
    return Windows(
        aux=windows.aux[index],
        positions=windows.positions[index],
        tokens=windows.tokens[:, index],
        finals=windows.finals[:, index],
        valid=windows.valid[:, index],
    )


@torch.no_grad()
def held_out_acceptance(
    head: EagleHead, backend: LayerwiseExecution, embed, windows: Windows, batch_windows: int
) -> list[float]:
    """Per drafting step: P(head top-1 == target top-1 over the full vocabulary | earlier steps right)."""
    steps = windows.tokens.shape[0]
    right = torch.zeros(steps)
    tried = torch.zeros(steps)
    full_head = backend.lm_head()
    target_ids = head.target_ids
    for index in torch.arange(windows.aux.shape[0]).split(batch_windows):
        batch = _select(windows, index)
        still = batch.valid[0].clone()
        for step, logits in enumerate(unrolled_logits(head, embed, batch)):
            truth = backend.head_logits(batch.finals[step], full_head).argmax(-1)
            guess = target_ids[logits.argmax(-1)]
            mask = still & batch.valid[step]
            tried[step] += mask.sum()
            correct = mask & (guess == truth)
            right[step] += correct.sum()
            still = correct
    return (right / tried.clamp(min=1)).tolist()


def train_eagle(
    target_backend: object,
    features: list[Features],
    config: EagleTrainConfig,
    progress: bool = False,
    checkpoint: Path | None = None,
) -> EagleTrainResult:
    """Fit a fresh head (or resume ``checkpoint``) to ``features`` computed for ``target_backend``."""
    started = time.perf_counter()
    backend = require_capability(target_backend, HiddenStates, "eagle training")
    layerwise = require_capability(target_backend, LayerwiseExecution, "eagle training")
    if not features:
        raise SpecDecodeError("eagle: no training data")
    generator = torch.Generator().manual_seed(config.seed)
    order = torch.randperm(len(features), generator=generator).tolist()
    n_eval = max(1, round(config.holdout * len(order))) if len(order) > 1 else 0
    held = [features[i] for i in order[:n_eval]] or features
    train = [features[i] for i in order[n_eval:]] or features

    vocab_size = layerwise.output_weight().shape[0]
    ids = draft_vocabulary(train, config.draft_vocab, vocab_size)
    head_config = EagleConfig.for_target(backend.decoder_shape(), backend.num_layers, vocab_size, ids.numel())
    head = EagleHead(head_config)
    head.set_draft_vocabulary(ids)
    start_from_target(head, backend, layerwise)
    teacher = _Teacher(layerwise, ids)
    windows = make_windows(train, config.window, config.ttt_steps)
    held_windows = make_windows(held, config.window, config.ttt_steps)

    def embed(tokens: torch.Tensor) -> torch.Tensor:
        return backend.embed(tokens).clone()  # out of inference mode: autograd may save it

    optimizer = torch.optim.AdamW(head.parameters(), lr=config.lr, weight_decay=0.0)
    steps_per_epoch = math.ceil(windows.aux.shape[0] / config.batch_windows)
    total = config.epochs * steps_per_epoch
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(step, total) / total))
    )
    done, losses = 0, []
    if checkpoint is not None and checkpoint.is_file():
        state = torch.load(checkpoint, map_location="cpu", weights_only=False)
        if state["config"] == head_config.to_dict() and state["total"] == total:
            head.load_state_dict(state["head"])
            optimizer.load_state_dict(state["optimizer"])
            schedule.load_state_dict(state["schedule"])
            done, losses = state["done"], state["losses"]
    last_save = time.perf_counter()
    head.train()
    with tqdm(total=total, initial=done, desc="training", unit="batch", disable=not progress) as bar:
        for epoch in range(done // steps_per_epoch, config.epochs):
            permutation = torch.randperm(windows.aux.shape[0], generator=torch.Generator().manual_seed(epoch))
            running, weight = 0.0, 0
            for position, index in enumerate(permutation.split(config.batch_windows)):
                if epoch * steps_per_epoch + position < done:
                    continue
                batch = _select(windows, index)
                loss = torch.zeros(())
                for step, logits in enumerate(unrolled_logits(head, embed, batch)):
                    target = teacher.log_probs(batch.finals[step])
                    kl = (target.exp() * (target - torch.log_softmax(logits, dim=-1))).sum(-1)
                    valid = batch.valid[step]
                    loss = loss + (kl * valid).sum() / valid.sum().clamp(min=1)
                optimizer.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
                optimizer.step()
                schedule.step()
                done += 1
                running += float(loss.detach())
                weight += 1
                bar.update()
                bar.set_postfix(loss=f"{float(loss.detach()) / config.ttt_steps:.3f}")
                if checkpoint is not None and time.perf_counter() - last_save > config.checkpoint_seconds:
                    _save_checkpoint(checkpoint, head, head_config, optimizer, schedule, done, total, losses)
                    last_save = time.perf_counter()
            losses.append(running / max(weight, 1) / config.ttt_steps)
            if checkpoint is not None:
                _save_checkpoint(checkpoint, head, head_config, optimizer, schedule, done, total, losses)
    head.eval()
    acceptance = held_out_acceptance(head, layerwise, embed, held_windows, config.batch_windows)
    return EagleTrainResult(
        head=head,
        rows=int(windows.valid[0].sum()),
        held_out_rows=int(held_windows.valid[0].sum()),
        acceptance=acceptance,
        epoch_losses=losses,
        seconds=time.perf_counter() - started,
    )


def _save_checkpoint(path: Path, head, head_config, optimizer, schedule, done, total, losses) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {
        "config": head_config.to_dict(),
        "head": head.state_dict(),
        "optimizer": optimizer.state_dict(),
        "schedule": schedule.state_dict(),
        "done": done,
        "total": total,
        "losses": losses,
    }
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    tmp.replace(path)
