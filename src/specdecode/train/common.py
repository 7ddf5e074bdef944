"""What the trainers of draft heads (EAGLE in :mod:`specdecode.train.eagle`, Medusa and Hydra in
:mod:`specdecode.train.medusa`) share, so that they cannot drift apart where they mean the same thing.

Both distil the target into a head on a CPU: the same held-out split of the data, the same teacher (the
target's own LM head rows of the draft vocabulary), the same KL loss, optimiser and warm-up + cosine
schedule, the same resumable checkpoints, and the same acceptance summary at the end.  What a batch is
and how its loss is summed over drafting steps or heads stays with each trainer.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import time
import warnings
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from specdecode.errors import SpecDecodeError
from specdecode.heads.files import replace_atomically
from specdecode.models.base import HiddenStates, LayerwiseExecution, require_capability

#: Optimiser steps over which the learning rate warms up linearly before the cosine decay.
WARMUP_STEPS = 50

Item = TypeVar("Item")
Batch = TypeVar("Batch")


class Teacher:
    """The target's distribution over the draft vocabulary from its final hidden states: what every head
    learns to reproduce (KL), through the target's own LM head rows so the teacher costs no extra forward."""

    def __init__(self, backend: LayerwiseExecution, ids: torch.Tensor) -> None:
        self.backend = backend
        self.weight = backend.output_weight().index_select(0, ids).contiguous()

    def log_probs(self, finals: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(self.backend.head_logits(finals, lambda x: x @ self.weight.T).float(), dim=-1)


def kl_to_teacher(teacher: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(teacher || draft) per row, from the teacher's log-probabilities and the draft's logits: the loss
    every head is trained with (the full distribution carries more than the target's top-1 token).  Both
    sides in fp32 whatever the matmuls ran in (see ``fit``'s ``bf16``)."""
    draft = torch.log_softmax(logits.float(), dim=-1)
    return F.kl_div(draft, teacher, reduction="none", log_target=True).sum(-1)  # one fused kernel each way


@dataclass
class HeldOutAcceptance:
    """Per drafting step (or head, or drafted token), P(head top-1 == target top-1 over the full vocabulary | earlier
    steps right): over every held-out row (``every``), and over the rows read as decoding reads them (``own``): each
    token fed to the head is the target's own greedy choice after the tokens before it, as it is when the target
    generated them.  Rows of prompts, chat templates and other writers' text are in ``every`` only, where the head
    meets them while training but never while drafting."""

    every: list[float]
    own: list[float]
    own_rows: int


@dataclass
class TrainResult:
    """What a head training reports besides the head itself."""

    rows: int
    held_out_rows: int
    acceptance: HeldOutAcceptance
    epoch_losses: list[float] = field(default_factory=list)
    seconds: float = 0.0


def percents(rates: list[float]) -> str:
    return ", ".join(f"{rate:.0%}" for rate in rates)


def chain_tokens(acceptance: list[float]) -> float:
    """Tokens a greedy chain drafted with these per-step acceptances gets accepted on average."""
    total, survive = 0.0, 1.0
    for rate in acceptance:
        survive *= rate
        total += survive
    return total


def target_views(target_backend: object, who: str) -> tuple[HiddenStates, LayerwiseExecution]:
    """The target as the two capabilities training needs (features in, its LM head as the teacher), or a
    clear error naming ``who`` (e.g. "eagle") before any data is touched."""
    backend = require_capability(target_backend, HiddenStates, f"{who} training")
    layerwise = require_capability(target_backend, LayerwiseExecution, f"{who} training")
    return backend, layerwise


def split_holdout(
    items: list[Item], tokens: Sequence[Sequence[int]], holdout: float, seed: int, who: str
) -> tuple[list[Item], list[Item]]:
    """(training, held-out) items, each item's ``tokens`` deciding its side: it is held out when their hash (with
    ``seed``) falls in the lowest ``holdout`` fraction.  The side depends on the sequence alone, so data grown for a
    longer run (``train eagle --init`` on more conversations) keeps the earlier held-out sequences held out and its
    figures stay clean of what the starting head trained on; equal sequences fall on the same side.  A few items
    still hold out one (the lowest hash) and train on one; a single item serves as both."""
    if not items:
        raise SpecDecodeError(f"{who}: no training data")
    if len(items) == 1:
        return items, items
    draws = [_uniform_draw(sequence, seed) for sequence in tokens]
    ranked = sorted(range(len(items)), key=draws.__getitem__)
    held = {i for i in ranked if draws[i] < holdout} or {ranked[0]}
    held.discard(ranked[-1])  # something to train on
    return [x for i, x in enumerate(items) if i not in held], [x for i, x in enumerate(items) if i in held]


def _uniform_draw(tokens: Sequence[int], seed: int) -> float:
    """A number in [0, 1) that is a function of ``tokens`` and ``seed`` only (the same in every process)."""
    digest = hashlib.blake2b(array("q", [seed, *tokens]).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def row_store(rows: int, width: int, dtype: torch.dtype, spill: Path | None) -> torch.Tensor:
    """A [rows, width] tensor of zeros: in the process, or backed by the file ``spill`` (shared mapping), so that
    the kernel pages rows in and out as a batch reads them.  Qwen's 842k EAGLE training rows are 10 GB in bf16,
    which this machine cannot hold twice beside the 6 GB target."""
    if spill is None:
        return torch.zeros(rows, width, dtype=dtype)
    spill.unlink(missing_ok=True)  # a fresh file is created zero-filled
    store = torch.from_file(str(spill), shared=True, size=rows * width, dtype=dtype).view(rows, width)
    spill.unlink()  # the mapping keeps the data until the tensor is freed; nothing is left behind, even by a crash
    return store


def trainable_embed(backend: HiddenStates) -> Callable[[torch.Tensor], torch.Tensor]:
    """The target's embedding as training uses it: cloned out of inference mode, since autograd may save it."""

    def embed(tokens: torch.Tensor) -> torch.Tensor:
        return backend.embed(tokens).clone()

    return embed


def fit(
    model: nn.Module,
    parameters: list[nn.Parameter],
    *,
    epochs: int,
    steps_per_epoch: int,
    lr: float,
    epoch_batches: Callable[[int], Iterable[Batch]],
    batch_loss: Callable[[Batch], torch.Tensor],
    loss_scale: float = 1,
    identity: object,
    model_key: str,
    checkpoint: Path | None,
    checkpoint_seconds: float,
    progress: bool,
    bf16: bool = False,
) -> list[float]:
    """Train ``parameters`` of ``model`` (AdamW, warm-up then cosine decay, gradients clipped at 1) and
    return the mean loss of every epoch, divided by ``loss_scale`` (EAGLE reports it per drafting step).

    ``epoch_batches(epoch)`` gives that epoch's ``steps_per_epoch`` batches in order (the same order each
    time it is asked, so a resumed run skips exactly the batches done); ``batch_loss`` is a batch's loss.
    With a ``checkpoint`` the run saves there every ``checkpoint_seconds`` and after every epoch, and
    resumes from it when it was made for the same ``identity`` (the head's config) and the same length.
    ``bf16`` runs the batches' matmuls in bf16 (autocast; weights, optimiser and losses stay fp32): the
    draft and teacher LM heads dominate a batch, and AMX multiplies bf16 several times faster."""
    optimizer = torch.optim.AdamW(parameters, lr=lr, weight_decay=0.0)
    total = epochs * steps_per_epoch
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: min(1.0, (step + 1) / WARMUP_STEPS) * 0.5 * (1 + math.cos(math.pi * min(step, total) / total)),
    )
    done, losses = 0, []
    if checkpoint is not None and checkpoint.is_file():
        state = torch.load(checkpoint, map_location="cpu", weights_only=False)
        if state["config"] == identity and state["total"] == total:
            model.load_state_dict(state[model_key])
            optimizer.load_state_dict(state["optimizer"])
            schedule.load_state_dict(state["schedule"])
            done, losses = state["done"], state["losses"]

    def save() -> None:
        state = {
            "config": identity,
            model_key: model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "schedule": schedule.state_dict(),
            "done": done,
            "total": total,
            "losses": losses,
        }
        checkpoint.parent.mkdir(parents=True, exist_ok=True)
        replace_atomically(checkpoint, lambda tmp: torch.save(state, tmp))

    last_save = time.perf_counter()
    model.train()
    # Under autocast a norm meets bf16 activations with its fp32 weight and takes torch's unfused kernel, saying so
    # once per run; the norms are a sliver of a batch beside the LM heads, so the warning is only noise to a user.
    # Silenced for the loop only: the caller's own warning filters are left as they were.
    with (
        warnings.catch_warnings(),
        tqdm(total=total, initial=done, desc="training", unit="batch", disable=not progress) as bar,
    ):
        warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
        for epoch in range(done // steps_per_epoch, epochs):
            running, weight = 0.0, 0
            for position, batch in enumerate(epoch_batches(epoch)):
                if epoch * steps_per_epoch + position < done:
                    continue
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    loss = batch_loss(batch)
                optimizer.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(parameters, 1.0)
                optimizer.step()
                schedule.step()
                done += 1
                running += float(loss.detach())
                weight += 1
                bar.update()
                bar.set_postfix(loss=f"{float(loss.detach()) / loss_scale:.3f}")
                if checkpoint is not None and time.perf_counter() - last_save > checkpoint_seconds:
                    save()
                    last_save = time.perf_counter()
            losses.append(running / max(weight, 1) / loss_scale)
            if checkpoint is not None:
                save()
    model.eval()
    return losses


def report_training(
    args: argparse.Namespace,
    result: TrainResult,
    what: str,
    draft_vocab: int,
    per: str,
    data_seconds: float,
    out: Path,
    drafter: str,
    option: str,
) -> None:
    """The end of a ``specdecode train`` run: the held-out figures, the time spent, where the head went and
    the command that uses it (naming the ``--drafter-option`` only when the head is not where it is looked
    for by default)."""
    every, own = result.acceptance.every, result.acceptance.own
    print(
        f"{what} for {args.model}: {result.rows} training rows, {draft_vocab} draft "
        f"tokens; held-out ({result.held_out_rows} rows) top-1 acceptance per {per} {percents(every)} "
        f"(a greedy chain of {len(every)} would average {chain_tokens(every):.2f} accepted tokens)"
    )
    print(
        f"on the target's own tokens ({result.acceptance.own_rows} held-out rows, as drafting meets them) "
        f"{percents(own)} (a chain would average {chain_tokens(own):.2f})"
    )
    print(
        f"data {data_seconds:.0f} s, training {result.seconds:.0f} s; "
        f"losses per epoch {', '.join(f'{loss:.3f}' for loss in result.epoch_losses)}"
    )
    print(f"saved {out}")
    hint = "" if not args.out else f" --drafter-option {option}={out}"
    print(f'use it: specdecode generate "..." --model {args.model} --drafter {drafter}{hint}')


def checked_tasks(args: argparse.Namespace, positive: tuple[str, ...]) -> list[str]:
    """The training tasks of a head's ``specdecode train`` command (eagle, medusa, hydra), after refusing its flags
    out of range; ``positive`` names its own flags that must be positive."""
    check_positive(args, "prompts", "new_tokens", "max_tokens", "epochs", "lr", *positive)
    for flag in ("conversations", "draft_vocab"):
        if getattr(args, flag) < 0:
            raise SpecDecodeError(f"--{flag.replace('_', '-')} must be >= 0")
    return task_names(args.tasks)


def check_positive(args: argparse.Namespace, *flags: str) -> None:
    """Refuse any of the named flags given a value <= 0 (one not given, None, is left to its default)."""
    for flag in flags:
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise SpecDecodeError(f"--{flag.replace('_', '-')} must be positive")


def task_names(text: str) -> list[str]:
    """``--tasks``: the comma-separated names of the tasks the training prompts come from; none is an error."""
    tasks = [t.strip() for t in text.split(",") if t.strip()]
    if not tasks:
        raise SpecDecodeError("--tasks names no task")
    return tasks
