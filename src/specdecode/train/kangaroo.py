"""Train a Kangaroo adapter on the target's own outputs, on a CPU, in minutes.

Data: the target greedily continues a few dozen prompts; every position of prompt + continuation then
gives one example — the exit layer's hidden state (input) and the full model's next-token distribution
(target).  Only the final hidden state is stored per position (the full logits would take
vocab × 4 bytes each); the target distribution is recomputed from it through the model's own head.
Loss: KL(full model ‖ adapter exit), the quantity speculative sampling's acceptance depends on.  The
model's weights stay frozen; only the adapter learns.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from specdecode.config import GenerationConfig
from specdecode.drafters import create_drafter
from specdecode.drafters._self_draft import require_layer_backend
from specdecode.drafters.kangaroo import KangarooAdapter
from specdecode.engine import speculative_decode
from specdecode.errors import SpecDecodeError
from specdecode.models.hf import HFCausalLM
from specdecode.models.loading import LoadedModel


@dataclass
class TrainConfig:
    exit_layer: int | None = None  # None: a fifth of the depth
    inner_size: int | None = None  # None: the model's hidden size
    new_tokens: int = 64  # continuation generated per prompt
    max_prompt_tokens: int = 256  # prompts are cut to their last tokens
    epochs: int = 4
    batch_size: int = 64
    lr: float = 1e-3
    holdout: float = 0.1  # fraction of positions kept for the before/after evaluation
    seed: int = 0


@dataclass
class Evaluation:
    """On held-out positions: mean KL(full ‖ exit) and how often the exit's argmax is the full model's."""

    kl: float
    top1: float


@dataclass
class TrainResult:
    adapter: KangarooAdapter
    positions: int
    before: Evaluation  # the untrained adapter, i.e. the plain early exit
    after: Evaluation
    epoch_losses: list[float] = field(default_factory=list)


def default_exit_layer(num_layers: int) -> int:
    return max(1, round(num_layers / 5))


@torch.inference_mode()
def collect(
    target: LoadedModel, prompts: list[list[int]], config: TrainConfig, exit_layer: int, progress: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(exit-layer hidden states, final hidden states before the norm), one row per position."""
    backend = require_layer_backend(target.backend, "kangaroo")
    none = create_drafter("none", target)
    generation = GenerationConfig(max_new_tokens=config.new_tokens)
    no_rows = torch.empty(0, dtype=torch.long)
    exits, finals = [], []
    for prompt in tqdm(prompts, desc="generating", unit="prompt", disable=not progress):
        prompt = prompt[-config.max_prompt_tokens :]
        continuation = speculative_decode(backend, none, prompt, generation, frozenset(backend.eos_token_ids))
        ids = torch.tensor(prompt + [t for chunk in continuation for t in chunk], dtype=torch.long)
        for layer, sink in ((exit_layer, exits), (backend.num_layers, finals)):
            out = backend.forward(ids, backend.new_cache(), exit_layer=layer, output_hidden=True, logits_rows=no_rows)
            sink.append(out.hidden)
    return torch.cat(exits), torch.cat(finals)


def _kl(backend: HFCausalLM, adapter: KangarooAdapter, exit_hidden: torch.Tensor, final_hidden: torch.Tensor):
    """Per-row KL(full ‖ exit) and whether the argmaxes agree."""
    with torch.no_grad():
        full = torch.log_softmax(backend.exit_logits(final_hidden), dim=-1)
    draft = torch.log_softmax(backend.exit_logits(adapter(exit_hidden)), dim=-1)
    kl = (full.exp() * (full - draft)).sum(-1)
    return kl, draft.argmax(-1) == full.argmax(-1)


def evaluate(backend: HFCausalLM, adapter: KangarooAdapter, exits: torch.Tensor, finals: torch.Tensor) -> Evaluation:
    with torch.no_grad():
        kl, agree = _kl(backend, adapter, exits, finals)
    return Evaluation(kl=float(kl.mean()), top1=float(agree.float().mean()))


def train_adapter(
    target: LoadedModel, prompts: list[list[int]], config: TrainConfig | None = None, progress: bool = False
) -> TrainResult:
    """Generate data with ``target`` from token-id ``prompts`` and fit a fresh adapter to it."""
    config = config or TrainConfig()
    backend = require_layer_backend(target.backend, "kangaroo")
    exit_layer = config.exit_layer or default_exit_layer(backend.num_layers)
    if not 1 <= exit_layer < backend.num_layers:
        raise SpecDecodeError(f"kangaroo: exit layer must be in 1..{backend.num_layers - 1}, got {exit_layer}")
    if not prompts:
        raise SpecDecodeError("kangaroo: no training prompts")
    torch.manual_seed(config.seed)
    # Cloned outside inference mode: ordinary tensors that autograd may save.
    exits, finals = (t.clone() for t in collect(target, prompts, config, exit_layer, progress))
    order = torch.randperm(len(exits))
    n_eval = max(1, int(config.holdout * len(order)))
    held, train = order[:n_eval], order[n_eval:]
    adapter = KangarooAdapter.for_backend(backend, exit_layer, config.inner_size)
    before = evaluate(backend, adapter, exits[held], finals[held])

    frozen = [(p, p.requires_grad) for p in backend.model.parameters()]
    for param, _ in frozen:
        param.requires_grad_(False)
    optimizer = torch.optim.AdamW(adapter.parameters(), lr=config.lr, weight_decay=0.0)
    batches = [train[i : i + config.batch_size] for i in range(0, len(train), config.batch_size)]
    losses: list[float] = []
    rng = random.Random(config.seed)
    adapter.train()
    try:
        with tqdm(total=config.epochs * len(batches), desc="training", unit="batch", disable=not progress) as bar:
            for _ in range(config.epochs):
                rng.shuffle(batches)
                total = 0.0
                for batch in batches:
                    kl, _ = _kl(backend, adapter, exits[batch], finals[batch])
                    loss = kl.mean()
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
                    total += float(loss.detach()) * len(batch)
                    bar.update()
                    bar.set_postfix(kl=f"{float(loss.detach()):.3f}")
                losses.append(total / max(1, len(train)))
    finally:
        for param, flag in frozen:
            param.requires_grad_(flag)
    adapter.eval()
    after = evaluate(backend, adapter, exits[held], finals[held])
    return TrainResult(adapter=adapter, positions=len(exits), before=before, after=after, epoch_losses=losses)
