"""Distilling a draft model into its target (DistillSpec), for ``specdecode train draft``.

After Zhou et al., "DistillSpec: Improving Speculative Decoding via Knowledge Distillation" (2023).  A draft model
that shares the target's vocabulary is fine-tuned to reproduce the target's next-token distributions on text where
speculation will ask it to: the two design choices the paper finds crucial are both options here.

* **Data** (``data``): ``target`` — the target's own greedy answers to training prompts, exactly the contexts a
  greedy request verifies drafts in (with chat prompts this is Direct Alignment's recipe: the draft aligned to the
  target's chat distribution, on text the target wrote); ``draft`` — on-policy, the draft's own samples
  (temperature 1) to the same prompts, scored by the target, DistillSpec's choice: the draft learns where its own
  drafts go wrong.
* **Divergence** (``divergence``): forward KL (``fkl``, KL(target ‖ draft)), reverse KL (``rkl``) or total
  variation (``tvd``, whose complement is the acceptance probability of speculative sampling at one token; the
  paper finds the best one depends on the task and on greedy vs sampled verification).  Each is computed over the
  target's :data:`TEACHER_TOP` likeliest tokens at a position plus one bucket for the rest of the vocabulary, so a
  position's teacher costs 2 KB to keep instead of a whole vocabulary row.

* **Nested exits** (``exits``, S2D: Kavehzadeh et al., "S2D: Sorted Speculative Decoding For More Efficient
  Deployment of Nested Large Language Models", 2024): the loss is averaged over the draft's last layer and the exits
  after the given numbers of layers (the hidden state there through the model's final norm and LM head), so that each
  of those depths drafts too (sorted fine-tuning).  The held-out figures then include each exit's agreement.

Only answer positions are learnt (a prompt is context, not what a draft predicts).  Weights: LoRA (``peft``) on
every linear layer of every decoder layer, merged into the saved model, or full fine-tuning (``lora_rank`` 0).  The
held-out figures are teacher-forced on sequences kept out of training: how often the draft's top-1 token is the
target's (what a greedy chain is accepted on) and 1 − TVD (what one sampled token is accepted with).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from specdecode.errors import SpecDecodeError
from specdecode.generator import SpeculativeGenerator
from specdecode.heads.files import replace_atomically
from specdecode.models.loading import LoadedModel
from specdecode.train.common import fit
from specdecode.train.data import kept_sequences, self_distill

DIVERGENCES = ("fkl", "rkl", "tvd")
DATA_SOURCES = ("target", "draft")
#: Target tokens kept per position as the teacher (the rest of the vocabulary is one bucket).  At temperature 1
#: the 256 likeliest of Qwen2.5-Coder's 151,936 tokens hold nearly all of a position's probability.
TEACHER_TOP = 256
#: Share of the sequences kept out of training for the held-out figures.
HOLDOUT_SHARE = 0.1
LORA_ALPHA_PER_RANK = 2
#: Learning rates when none is given.  LoRA's adapters start at zero and take larger steps; every weight of the 0.5B
#: Qwen draft moved at 2e-5 took it away from its target on chat answers (held-out agreement 72.3% -> 68.6%), at 2e-6
#: it trained as LoRA at 2e-4 did (results/distill-chat-qwen2.5-coder-1.5b).
LORA_LR = 2e-4
FULL_FINE_TUNING_LR = 2e-6


@dataclass(frozen=True)
class DistillConfig:
    data: str = "target"
    divergence: str = "fkl"
    lora_rank: int = 16  # 0: full fine-tuning
    epochs: int = 2
    lr: float | None = None  # None: LORA_LR with LoRA, FULL_FINE_TUNING_LR for full fine-tuning
    new_tokens: int = 128
    max_prompt_tokens: int = 384
    seed: int = 0
    exits: tuple[int, ...] = ()  # S2D: layer depths whose exits are trained too (the last layer always is)
    bf16: bool = False  # matmuls of training in bf16 (autocast), see train.common.fit

    def __post_init__(self) -> None:
        if self.data not in DATA_SOURCES:
            raise SpecDecodeError(f"--data must be one of {', '.join(DATA_SOURCES)}, got {self.data!r}")
        if self.divergence not in DIVERGENCES:
            raise SpecDecodeError(f"--divergence must be one of {', '.join(DIVERGENCES)}, got {self.divergence!r}")
        if self.lora_rank < 0:
            raise SpecDecodeError(f"--lora-rank must be >= 0 (0: full fine-tuning), got {self.lora_rank}")
        if self.lr is None:
            object.__setattr__(self, "lr", LORA_LR if self.lora_rank else FULL_FINE_TUNING_LR)
        if any(depth < 1 for depth in self.exits) or len(set(self.exits)) != len(self.exits):
            raise SpecDecodeError(f"--exits takes distinct layer counts >= 1, got {list(self.exits)}")


@dataclass
class Sequence:
    """A training sequence: the token ids, where its answer starts, and the target's teacher at each answer
    position (``top_ids`` [answer, TEACHER_TOP], ``top_logprobs`` the same shape, temperature 1)."""

    ids: torch.Tensor
    answer_start: int
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor


@dataclass(frozen=True)
class HeldOut:
    top1: float  # the draft's top-1 token is the target's
    one_minus_tvd: float  # speculative sampling's acceptance of one draft token, over the teacher's buckets
    exits: dict[int, HeldOut] = field(default_factory=dict)  # the same figures at each trained exit


@dataclass
class DistillResult:
    before: HeldOut
    after: HeldOut
    train_sequences: int
    held_out_sequences: int
    answer_tokens: int
    epoch_losses: list[float]


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """Refuse a draft whose token ids mean other tokens than the target's (sizes alone can agree by chance)."""
    same_size = target.backend.vocab_size == draft.backend.vocab_size
    tokenizers = target.tokenizer is not None and draft.tokenizer is not None
    if not same_size or (tokenizers and target.tokenizer.get_vocab() != draft.tokenizer.get_vocab()):
        raise SpecDecodeError(
            f"train draft needs a draft sharing the target's vocabulary: {draft.name!r} ({draft.backend.vocab_size} "
            f"tokens) does not share {target.name!r}'s ({target.backend.vocab_size} tokens)"
        )


def answers(
    target: LoadedModel,
    draft: LoadedModel,
    prompts: list[list[int]],
    config: DistillConfig,
    progress: bool = True,
    cache: Path | None = None,
) -> list[tuple[list[int], int]]:
    """(prompt + answer ids, answer start) per prompt: the target's greedy answers, or the draft's samples.

    With a ``cache`` a rerun decodes only the sequences it lacks (:func:`specdecode.train.data.kept_sequences`):
    greedy answers and seeded samples come out the same either way."""
    cut = [p[-config.max_prompt_tokens :] for p in prompts]
    if config.data == "target":
        decode = partial(self_distill, target, prompts, config.new_tokens, config.max_prompt_tokens)
    else:
        decode = partial(draft_samples, draft, cut, config, progress=progress)
    done = kept_sequences(cache, decode)
    return [(ids, len(prompt)) for ids, prompt in zip(done, cut)]


def draft_samples(
    draft: LoadedModel, prompts: list[list[int]], config: DistillConfig, skip: int, progress: bool
) -> Iterator[list[int]]:
    """Each prompt followed by the draft's own sample (temperature 1, seeded by the prompt's index), from ``skip``."""
    generator = SpeculativeGenerator.build(draft, "none")
    with tqdm(total=len(prompts), initial=skip, desc="draft sampling", unit="prompt", disable=not progress) as bar:
        for index in range(skip, len(prompts)):
            seed = config.seed + index
            result = generator.generate(prompts[index], max_new_tokens=config.new_tokens, temperature=1.0, seed=seed)
            bar.update()
            yield prompts[index] + list(result.token_ids)


@torch.no_grad()  # not inference mode: full fine-tuning's embedding saves the ids for its backward
def teacher(target: LoadedModel, ids: list[int], answer_start: int) -> Sequence:
    """The target's top :data:`TEACHER_TOP` log-probabilities at every answer position of ``ids``."""
    tokens = torch.tensor(ids)
    logits = answer_pass(target.backend.model, tokens, answer_start)[0].float()
    top = torch.log_softmax(logits, dim=-1).topk(min(TEACHER_TOP, logits.shape[-1]), dim=-1)
    return Sequence(tokens, answer_start, top.indices.to(torch.int32), top.values)


def teachers(
    target: LoadedModel, pairs: list[tuple[list[int], int]], cache: Path | None = None, progress: bool = True
) -> list[Sequence]:
    """:func:`teacher` of every (ids, answer start) pair.  With a ``cache`` (the answers' own file, the target and its
    precision in its name) the scores are kept once all are made, and a rerun on the same answers makes none."""
    if cache is not None and cache.is_file():
        kept = torch.load(cache)
        if kept["pairs"] == pairs and kept["teacher_top"] == TEACHER_TOP:
            return [Sequence(torch.tensor(ids), start, *top) for (ids, start), top in zip(pairs, kept["tops"])]
    scored = tqdm(pairs, desc="scoring with the target", unit="sequence", disable=not progress)
    sequences = [teacher(target, ids, start) for ids, start in scored]
    if cache is not None:
        tops = [(sequence.top_ids, sequence.top_logprobs) for sequence in sequences]
        replace_atomically(cache, partial(torch.save, {"pairs": pairs, "teacher_top": TEACHER_TOP, "tops": tops}))
    return sequences


def bucketed(top_logprobs: torch.Tensor) -> torch.Tensor:
    """[..., K] log-probabilities of K tokens → [..., K + 1] with the rest of the vocabulary as the last bucket."""
    rest = torch.log1p(-top_logprobs.exp().sum(-1, keepdim=True).clamp(max=1.0 - 1e-6))
    return torch.cat([top_logprobs, rest], dim=-1)


def divergence(name: str, sequence: Sequence, draft_logits: torch.Tensor) -> torch.Tensor:
    """Per answer position, the divergence ``name`` between the target and the draft over the teacher's buckets
    (``draft_logits`` [answer, vocab], the rows predicting the answer tokens)."""
    draft_logprobs = torch.log_softmax(draft_logits.float(), dim=-1).gather(-1, sequence.top_ids.long())
    log_p, log_q = bucketed(sequence.top_logprobs), bucketed(draft_logprobs)
    p, q = log_p.exp(), log_q.exp()
    if name == "fkl":
        return (p * (log_p - log_q)).sum(-1)
    if name == "rkl":
        return (q * (log_q - log_p)).sum(-1)
    return 0.5 * (p - q).abs().sum(-1)


def answer_pass(model: nn.Module, ids: torch.Tensor, answer_start: int, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """``model`` over ``ids`` (one sequence) with its LM head on the rows predicting the answer tokens only (over a long
    prompt the head would otherwise cost more than the answer's layers): those rows' logits, and the whole output."""
    kept = len(ids) - answer_start + 1  # the answer's rows and the last one, which predicts past the sequence
    out = model(input_ids=ids[None], use_cache=False, logits_to_keep=kept, **kwargs)
    return out.logits[0, :-1], out


def draft_logits(model: nn.Module, sequence: Sequence) -> torch.Tensor:
    """The draft's logits at the rows predicting ``sequence``'s answer tokens."""
    return answer_pass(model, sequence.ids, sequence.answer_start)[0]


def exit_logits(model: nn.Module, sequence: Sequence, exits: tuple[int, ...]) -> list[torch.Tensor]:
    """The draft's logits at the rows predicting ``sequence``'s answer tokens: at its last layer, then at each exit
    (the hidden state after that many layers through the final norm and LM head)."""
    if not exits:
        return [draft_logits(model, sequence)]
    logits, out = answer_pass(model, sequence.ids, sequence.answer_start, output_hidden_states=True)
    rows = slice(sequence.answer_start - 1, -1)
    norm, head = output_stage(model)
    return [logits, *(head(norm(out.hidden_states[depth][0, rows])) for depth in exits)]


def output_stage(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """A Llama-shaped causal LM's final norm and LM head (under a LoRA wrapper too)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    norm, head = getattr(getattr(base, "model", None), "norm", None), getattr(base, "lm_head", None)
    if norm is None or head is None:
        raise SpecDecodeError("--exits needs a draft whose final norm and LM head are model.norm and lm_head")
    return norm, head


def check_exits(draft: LoadedModel, exits: tuple[int, ...]) -> None:
    """Refuse an exit at or past the draft's last layer (the last layer is always trained)."""
    layers = draft.backend.num_layers
    beyond = [depth for depth in exits if depth >= layers]
    if beyond:
        raise SpecDecodeError(f"--exits must be below the draft's {layers} layers, got {beyond}")
    if exits:
        output_stage(draft.backend.model)


@torch.inference_mode()
def held_out(model: nn.Module, sequences: list[Sequence], exits: tuple[int, ...] = ()) -> HeldOut:
    """The held-out figures of the draft's last layer, and of each exit."""
    depths = (None, *exits)  # None: the last layer
    agree, overlap = dict.fromkeys(depths, 0.0), dict.fromkeys(depths, 0.0)
    positions = 0
    for sequence in sequences:
        truth = sequence.top_ids[:, 0].long()
        for depth, logits in zip(depths, exit_logits(model, sequence, exits)):
            agree[depth] += float((logits.argmax(-1) == truth).sum())
            overlap[depth] += float((1.0 - divergence("tvd", sequence, logits)).sum())
        positions += len(truth)
    count = max(positions, 1)
    at = {depth: HeldOut(agree[depth] / count, overlap[depth] / count) for depth in depths}
    return HeldOut(at[None].top1, at[None].one_minus_tvd, {depth: at[depth] for depth in exits})


class TrainedState(nn.Module):
    """The parameters being trained, as a module of their own: what ``fit`` checkpoints (a LoRA run saves its
    adapters, not the 2 GB of frozen weights)."""

    def __init__(self, parameters: dict[str, nn.Parameter]) -> None:
        super().__init__()
        self.trained = nn.ParameterDict({name.replace(".", "/"): p for name, p in parameters.items()})


def trainable(model: nn.Module, rank: int) -> tuple[nn.Module, dict[str, nn.Parameter]]:
    """``model`` made trainable: LoRA adapters on every linear layer of its decoder (``rank`` > 0), or all of it."""
    if rank == 0:
        return model, {name: p for name, p in model.named_parameters() if p.requires_grad}
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise SpecDecodeError(
            "LoRA needs peft: pip install 'specdecode[adapt]' (or --lora-rank 0 for full fine-tuning)"
        ) from None
    linear = (name for name, module in model.named_modules() if ".layers." in name and isinstance(module, nn.Linear))
    modules = sorted({name.rsplit(".", 1)[-1] for name in linear})
    lora = LoraConfig(r=rank, lora_alpha=LORA_ALPHA_PER_RANK * rank, lora_dropout=0.0, target_modules=modules)
    wrapped = get_peft_model(model, lora)
    return wrapped, {name: p for name, p in wrapped.named_parameters() if p.requires_grad}


def distill(
    target: LoadedModel,
    draft: LoadedModel,
    prompts: list[list[int]],
    config: DistillConfig,
    checkpoint: Path | None = None,
    progress: bool = True,
    answers_cache: Path | None = None,
) -> tuple[nn.Module, DistillResult]:
    """Fine-tune ``draft`` (loaded without the fast path: plain linear layers) towards ``target``; returns the trained
    model (LoRA merged) and the held-out figures before and after.  ``answers_cache`` keeps the decoded sequences
    (:func:`answers`) and, beside it, the target's scores of them (:func:`teachers`), ``checkpoint`` the training
    (:func:`specdecode.train.common.fit`)."""
    check_same_vocabulary(target, draft)
    check_exits(draft, config.exits)
    pairs = answers(target, draft, prompts, config, progress, answers_cache)
    scores_cache = None if answers_cache is None else answers_cache.with_suffix(".scores.pt")
    sequences = teachers(target, [(ids, start) for ids, start in pairs if len(ids) > start], scores_cache, progress)
    random.Random(config.seed).shuffle(sequences)
    holdout = max(1, math.ceil(HOLDOUT_SHARE * len(sequences))) if len(sequences) > 1 else 0
    held, train = sequences[:holdout], sequences[holdout:]
    if not train:
        raise SpecDecodeError("train draft: no training sequence was written (give more --prompts)")
    model = draft.backend.model
    before = held_out(model, held, config.exits) if held else HeldOut(float("nan"), float("nan"))
    model, parameters = trainable(model, config.lora_rank)

    def epoch_batches(epoch: int) -> list[Sequence]:
        """One sequence per batch, in an order of its own each epoch (the same order when a run resumes)."""
        shuffled = list(train)
        random.Random(config.seed * 1000 + epoch).shuffle(shuffled)
        return shuffled

    def batch_loss(sequence: Sequence) -> torch.Tensor:  # averaged over the last layer and each exit
        depths = exit_logits(model, sequence, config.exits)
        return torch.stack([divergence(config.divergence, sequence, logits).mean() for logits in depths]).mean()

    losses = fit(
        TrainedState(parameters),
        list(parameters.values()),
        epochs=config.epochs,
        steps_per_epoch=len(train),
        lr=config.lr,
        epoch_batches=epoch_batches,
        batch_loss=batch_loss,
        identity={**asdict(config), "target": target.name, "draft": draft.name, "sequences": len(sequences)},
        model_key="trained",
        checkpoint=checkpoint,
        checkpoint_seconds=300,
        progress=progress,
        bf16=config.bf16,
    )
    if config.lora_rank:
        model = model.merge_and_unload()
    for p in model.parameters():
        p.requires_grad_(False)
    after = held_out(model, held, config.exits) if held else HeldOut(float("nan"), float("nan"))
    answer_tokens = sum(int(s.top_ids.shape[0]) for s in sequences)
    return model, DistillResult(before, after, len(train), len(held), answer_tokens, losses)


def save_draft(model: nn.Module, draft: LoadedModel, out: Path, facts: dict[str, Any]) -> None:
    """The trained draft as a transformers model directory ``--draft-model`` loads, with its tokenizer and a
    ``distill.json`` of how it was made."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    draft.tokenizer.save_pretrained(out)
    (out / "distill.json").write_text(json.dumps(facts, indent=2) + "\n")
