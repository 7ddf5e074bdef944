"""Train a Kangaroo adapter on the target's own outputs, on a CPU, in minutes.

Data: the target greedily continues real prompts (generated losslessly with prompt lookup, which gives
plain decoding's tokens faster); every position of prompt + continuation then gives one example — the
exit layer's hidden state (input) and the full model's final-normed hidden state, from which the full
model's distribution is recomputed through its own head (the logits would take vocab × 4 bytes each).

Loss: distillation, KL(full model ‖ adapter exit), over the draft head's vocabulary (the first
``draft_vocab`` ids plus every token the full model predicts anywhere in the data, see
:class:`~specdecode.drafters._self_draft.DraftHead`): that is the head the drafter drafts with, and it
makes a step ~6x cheaper than the full 49k-262k-row head, so many more steps fit in a CPU budget.
The model's weights stay frozen; only the adapter learns.  Held-out figures are measured on whole
held-out prompts, over the full vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from specdecode.config import DEFAULT_DRAFT_VOCAB, GenerationConfig
from specdecode.drafters import create_drafter
from specdecode.drafters._self_draft import require_layer_backend
from specdecode.drafters.kangaroo import KangarooAdapter
from specdecode.engine import speculative_decode
from specdecode.errors import SpecDecodeError
from specdecode.models.base import LayerwiseExecution
from specdecode.models.loading import LoadedModel
from specdecode.train.common import split_holdout


@dataclass
class TrainConfig:
    exit_layer: int | None = None  # None: see default_exit_layer
    inner_size: int | None = None  # None: twice the model's hidden size
    new_tokens: int = 96  # continuation generated per prompt
    max_prompt_tokens: int = 384  # prompts are cut to their last tokens
    epochs: int = 12
    batch_size: int = 128
    lr: float = 2e-3
    draft_vocab: int = DEFAULT_DRAFT_VOCAB  # the loss's vocabulary (0: full)
    holdout: float = 0.1  # fraction of prompts kept for the before/after evaluation
    seed: int = 0


@dataclass
class Evaluation:
    """On held-out prompts: mean KL(full ‖ exit) and how often the exit's argmax is the full model's."""

    kl: float
    top1: float


@dataclass
class KangarooTrainResult:
    adapter: KangarooAdapter
    positions: int
    before: Evaluation  # the untrained adapter, i.e. the plain early exit
    after: Evaluation
    epoch_losses: list[float] = field(default_factory=list)


def default_exit_layer(num_layers: int) -> int:
    """A third of the depth: on SmolLM2-135M (30 layers) a plain exit is useless below ~2/3 of the depth,
    and an exit at 10 with the adapter costs ~0.1-0.15 of a target forward with the restricted head."""
    return max(1, round(num_layers / 3))


@dataclass
class Sequence:
    """One prompt + continuation: exit-layer hidden states and the full model's final-normed states."""

    exits: torch.Tensor
    finals: torch.Tensor


@torch.inference_mode()
def collect(
    target: LoadedModel, prompts: list[list[int]], config: TrainConfig, exit_layer: int, progress: bool
) -> list[Sequence]:
    backend = require_layer_backend(target.backend, "kangaroo")
    lookup = create_drafter("pld", target)  # lossless: the same tokens as plain greedy decoding, faster
    generation = GenerationConfig(max_new_tokens=config.new_tokens, num_draft_tokens=8)
    no_rows = torch.empty(0, dtype=torch.long)
    out: list[Sequence] = []
    for prompt in tqdm(prompts, desc="generating", unit="prompt", disable=not progress):
        prompt = prompt[-config.max_prompt_tokens :]
        continuation = speculative_decode(backend, lookup, prompt, generation, frozenset(backend.eos_token_ids))
        ids = torch.tensor(prompt + [t for chunk in continuation for t in chunk], dtype=torch.long)
        exits = backend.forward_layers(
            ids, backend.new_cache(), exit_layer=exit_layer, output_hidden=True, logits_rows=no_rows
        )
        finals = backend.forward_layers(ids, backend.new_cache(), output_hidden=True, logits_rows=no_rows)
        out.append(Sequence(exits.hidden.clone(), finals.hidden.clone()))
    return out


class _Heads:
    """Teacher and student logits through the model's own head, optionally restricted to ``ids``."""

    def __init__(self, backend: LayerwiseExecution, ids: torch.Tensor | None) -> None:
        self.backend = backend
        self.weight = None if ids is None else backend.output_weight().index_select(0, ids).contiguous()

    def _head(self, normed: torch.Tensor) -> torch.Tensor:
        if self.weight is None:
            return self.backend.lm_head()(normed)
        return normed @ self.weight.T

    def teacher(self, finals: torch.Tensor) -> torch.Tensor:
        return self.backend.head_logits(finals, self._head)

    def student(self, adapter: KangarooAdapter, exits: torch.Tensor) -> torch.Tensor:
        return self.backend.exit_logits(adapter(exits), self._head)


def _kl(heads: _Heads, adapter: KangarooAdapter, exits: torch.Tensor, finals: torch.Tensor):
    """Per-row KL(full ‖ exit) and whether the argmaxes agree."""
    with torch.no_grad():
        full = torch.log_softmax(heads.teacher(finals), dim=-1)
    draft = torch.log_softmax(heads.student(adapter, exits), dim=-1)
    kl = (full.exp() * (full - draft)).sum(-1)
    return kl, draft.argmax(-1) == full.argmax(-1)


def evaluate(
    backend: LayerwiseExecution, adapter: KangarooAdapter, exits: torch.Tensor, finals: torch.Tensor
) -> Evaluation:
    heads = _Heads(backend, None)
    with torch.no_grad():
        kl, agree = _kl(heads, adapter, exits, finals)
    return Evaluation(kl=float(kl.mean()), top1=float(agree.float().mean()))


def _loss_vocabulary(backend: LayerwiseExecution, finals: torch.Tensor, size: int) -> torch.Tensor | None:
    """The first ``size`` ids plus every token the full model predicts in the data; None = full vocab."""
    if size <= 0 or size >= backend.vocab_size:
        return None
    heads = _Heads(backend, None)
    with torch.no_grad():
        predicted = torch.cat([heads.teacher(chunk).argmax(-1) for chunk in finals.split(1024)])
    return torch.unique(torch.cat([torch.arange(size), predicted]))


def train_adapter(
    target: LoadedModel, prompts: list[list[int]], config: TrainConfig | None = None, progress: bool = False
) -> KangarooTrainResult:
    """Generate data with ``target`` from token-id ``prompts`` and fit a fresh adapter to it."""
    config = config or TrainConfig()
    backend = require_layer_backend(target.backend, "kangaroo")
    exit_layer = config.exit_layer or default_exit_layer(backend.num_layers)
    if not 1 <= exit_layer < backend.num_layers:
        raise SpecDecodeError(f"kangaroo: exit layer must be in 1..{backend.num_layers - 1}, got {exit_layer}")
    if not prompts:
        raise SpecDecodeError("kangaroo: no training prompts")
    torch.manual_seed(config.seed)
    sequences = collect(target, prompts, config, exit_layer, progress)
    train, held = split_holdout(sequences, [list(p) for p in prompts], config.holdout, config.seed, "kangaroo")
    exits, finals = torch.cat([s.exits for s in train]), torch.cat([s.finals for s in train])
    held_exits, held_finals = torch.cat([s.exits for s in held]), torch.cat([s.finals for s in held])
    adapter = KangarooAdapter.for_backend(backend, exit_layer, config.inner_size or 2 * backend.hidden_size)
    before = evaluate(backend, adapter, held_exits, held_finals)
    adapter.vocab = _loss_vocabulary(backend, finals, config.draft_vocab)
    heads = _Heads(backend, adapter.vocab)

    frozen = [(p, p.requires_grad) for p in backend.model.parameters()]
    for param, _ in frozen:
        param.requires_grad_(False)
    optimizer = torch.optim.AdamW(adapter.parameters(), lr=config.lr, weight_decay=0.0)
    steps_per_epoch = math.ceil(len(exits) / config.batch_size)
    total = config.epochs * steps_per_epoch
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / total))
    )
    generator = torch.Generator().manual_seed(config.seed)
    losses: list[float] = []
    adapter.train()
    try:
        with tqdm(total=total, desc="training", unit="batch", disable=not progress) as bar:
            for _ in range(config.epochs):
                running = 0.0
                for batch in torch.randperm(len(exits), generator=generator).split(config.batch_size):
                    kl, _ = _kl(heads, adapter, exits[batch], finals[batch])
                    loss = kl.mean()
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
                    schedule.step()
                    running += float(loss.detach()) * len(batch)
                    bar.update()
                    bar.set_postfix(kl=f"{float(loss.detach()):.3f}")
                losses.append(running / max(1, len(exits)))
    finally:
        for param, flag in frozen:
            param.requires_grad_(flag)
    adapter.eval()
    after = evaluate(backend, adapter, held_exits, held_finals)
    positions = sum(len(s.exits) for s in sequences)
    return KangarooTrainResult(adapter=adapter, positions=positions, before=before, after=after, epoch_losses=losses)
