"""Train a CTC draft head for a target on a CPU: cached final hidden states, CTC loss against the target's tokens.

Data as for Medusa (:mod:`specdecode.train.medusa`, the same cached final hidden states): the target's own greedy
answers and ShareGPT conversations the benchmark never draws, run through the target once.  Row j of a sequence
is position j's hidden state, which the drafter reads when token j+1 ends the context; its label is what the
target would say next: its greedy choices of tokens j+2 .. j+1+``tokens`` (the argmax of its LM head at positions
j+1 .. j+``tokens``, given the data before them — on self-distilled data the data itself), cut at the sequence's
end and at the first token outside the draft vocabulary (it cannot be drafted; what comes after it would not be
reached).  The head's ``slots`` distributions are fitted to that label with CTC loss
(:func:`torch.nn.functional.ctc_loss`, the blank the head's last output): the probability of every alignment of
the label to the slots — repeats and blanks around its tokens — summed, so the head learns where to put blanks
rather than a fixed token per slot.  ``slots`` must leave room for a blank between repeated tokens: twice
``tokens`` always does.

Rows are taken in contiguous runs as for Medusa; the blocks start at zero, the blank as likely as a row's likeliest
token, and the LM head is the target's, frozen.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specdecode.config import DEFAULT_DRAFT_VOCAB
from specdecode.errors import SpecDecodeError
from specdecode.heads.ctc import CTCHead, ctc_head_for_target
from specdecode.models.base import LayerwiseExecution
from specdecode.train.common import HeldOutAcceptance, TrainResult, fit, split_holdout, target_views
from specdecode.train.eagle import Features, draft_vocabulary
from specdecode.train.medusa import Stream, make_stream


@dataclass
class CTCTrainConfig:
    draft_vocab: int = DEFAULT_DRAFT_VOCAB  # VocabTrim: the head's vocabulary (0: the target's whole vocabulary)
    slots: int = 8  # outputs per pass, blanks included
    tokens: int = 4  # label length: the target's next tokens each row learns
    epochs: int = 4
    run: int = 256  # contiguous rows per batch
    lr: float = 1e-3
    holdout: float = 0.05  # fraction of sequences kept out for the acceptance figures
    seed: int = 0
    checkpoint_seconds: float = 120.0
    bf16: bool = False  # matmuls of training in bf16 (autocast), see train.common.fit


@dataclass(kw_only=True)
class CTCTrainResult(TrainResult):
    """The trained head with its figures (acceptance per token of the collapsed greedy draft)."""

    head: CTCHead


@dataclass
class Labels:
    """Every row's label: the target's greedy next tokens as draft ids [N, tokens] (padded with 0) and their count."""

    draft_ids: torch.Tensor
    lengths: torch.Tensor
    greedy: torch.Tensor  # [N, tokens] the same tokens as target ids, -1 past the sequence's end
    #: [N, tokens] whether the data's token before each label is the target's own greedy choice too (as in text the
    #: target wrote, where drafting meets the label), false past the sequence's end
    follows: torch.Tensor


@torch.no_grad()
def make_labels(stream: Stream, backend: LayerwiseExecution, head: CTCHead, tokens: int, run: int) -> Labels:
    """The labels of ``stream``'s rows: the target's full-vocabulary argmax at the ``tokens`` positions after each,
    computed once (an LM-head call per run of rows), cut where the sequence or the draft vocabulary ends."""
    full_head = backend.lm_head()
    rows = stream.rows
    choices = torch.cat(
        [
            backend.head_logits(stream.finals[start : min(start + run, rows + tokens)].float(), full_head).argmax(-1)
            for start in range(0, rows + tokens, run)
        ]
    )  # choices[i]: the target's greedy token after position i
    to_draft = torch.full((backend.output_weight().shape[0],), -1, dtype=torch.long)
    to_draft[head.target_ids] = torch.arange(head.target_ids.numel())
    ahead = torch.arange(rows)[:, None] + torch.arange(1, tokens + 1)  # [N, tokens] positions j+1 .. j+tokens
    inside = ahead <= stream.last[:, None]
    greedy = torch.where(inside, choices[ahead], -1)
    follows = inside & (stream.ids[ahead] == choices[ahead - 1])
    draft_ids = torch.where(inside, to_draft[greedy.clamp(min=0)], -1)
    lengths = (draft_ids >= 0).long().cumprod(dim=1).sum(dim=1)  # up to the first end or out-of-vocabulary token
    return Labels(draft_ids=draft_ids.clamp(min=0), lengths=lengths, greedy=greedy, follows=follows)


def check_slots(slots: int, tokens: int) -> None:
    """Refuse a label longer than CTC can always align: a label of repeated tokens needs a blank between each."""
    if tokens < 1 or slots < 2 * tokens:
        raise SpecDecodeError(f"--slots ({slots}) must be at least twice --tokens ({tokens}), which must be positive")


def collapse(path: list[int], blank: int) -> list[int]:
    """CTC's many-to-one map: repeats merged, then blanks removed."""
    out, previous = [], None
    for symbol in path:
        if symbol != previous and symbol != blank:
            out.append(symbol)
        previous = symbol
    return out


def ctc_losses(head: CTCHead, finals: torch.Tensor, labels: Labels, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``rows``: the CTC loss divided by the label's length (1 for an empty label) and whether the row
    has a next position at all (a row at its sequence's end learns nothing)."""
    logprobs = torch.log_softmax(head(finals), dim=-1)  # [B, slots, V + 1]
    lengths = labels.lengths[rows]
    slots = head.config.slots
    loss = F.ctc_loss(
        logprobs.transpose(0, 1),
        labels.draft_ids[rows],
        torch.full((logprobs.shape[0],), slots, dtype=torch.long),
        lengths,
        blank=head.config.blank,
        reduction="none",
        zero_infinity=True,
    )
    return loss / lengths.clamp(min=1), labels.greedy[rows, 0] >= 0


@torch.no_grad()
def held_out_acceptance(head: CTCHead, stream: Stream, labels: Labels, run: int) -> HeldOutAcceptance:
    """Per token of the collapsed greedy draft: P(it equals the target's greedy token | the earlier ones did), over
    every row and over the labels whose tokens before them the target wrote itself (:class:`HeldOutAcceptance`)."""
    tokens = labels.greedy.shape[1]
    right, tried = torch.zeros(2, tokens), torch.zeros(2, tokens)
    for start in range(0, stream.rows, run):
        stop = min(start + run, stream.rows)
        paths = head(stream.finals[start:stop].float()).argmax(-1).tolist()
        rows = zip(paths, labels.greedy[start:stop].tolist(), labels.follows[start:stop].tolist())
        for path, truth, follows in rows:
            draft = [int(head.target_ids[i]) for i in collapse(path, head.config.blank)]
            own = True
            for k in range(min(len(draft), tokens)):
                if truth[k] < 0:
                    break
                own = own and follows[k]
                counted = (0, 1) if own else (0,)
                for kind in counted:
                    tried[kind, k] += 1
                if draft[k] != truth[k]:
                    break
                for kind in counted:
                    right[kind, k] += 1
    every, own_rates = (right / tried.clamp(min=1)).tolist()
    return HeldOutAcceptance(every, own_rates, int(labels.follows[:, 0].sum()))


def train_ctc(
    target_backend: object,
    features: list[Features],
    config: CTCTrainConfig,
    progress: bool = False,
    checkpoint: Path | None = None,
    spill: Path | None = None,
) -> CTCTrainResult:
    """Fit a fresh head (or resume ``checkpoint``) to ``features`` (final hidden states) computed for
    ``target_backend``; ``spill``: a directory where the final hidden states are kept in memory-mapped files."""
    started = time.perf_counter()
    backend, layerwise = target_views(target_backend, "ctc")
    check_slots(config.slots, config.tokens)
    train, held = split_holdout(features, [f.ids.tolist() for f in features], config.holdout, config.seed, "ctc")
    ids = draft_vocabulary(train, config.draft_vocab, layerwise.output_weight().shape[0])
    head = ctc_head_for_target(target_backend, config.slots, ids)
    stream = make_stream(train, config.tokens, spill and spill / "training-finals.bin")
    held_stream = make_stream(held, config.tokens, spill and spill / "held-out-finals.bin")
    labels = make_labels(stream, layerwise, head, config.tokens, config.run)
    with torch.no_grad():
        # The blank starts as likely as a row's likeliest token: the target's logits run to tens, so a blank at zero
        # would start with a probability near nothing and every alignment through it would start unlearnable.
        head.blank_head.bias.fill_(float(head(stream.finals[: config.run].float())[..., :-1].amax(-1).mean()))
    held_labels = make_labels(held_stream, layerwise, head, config.tokens, config.run)

    def batch_loss(run: int) -> torch.Tensor:
        """Run ``run``'s CTC loss per label token, averaged over its rows that have a next position."""
        rows = slice(run * config.run, min((run + 1) * config.run, stream.rows))
        loss, valid = ctc_losses(head, stream.finals[rows].float(), labels, rows)
        return (loss * valid).sum() / valid.sum().clamp(min=1)

    runs = math.ceil(stream.rows / config.run)
    losses = fit(
        head,
        [p for p in head.parameters() if p.requires_grad],  # the shared LM head stays the target's
        epochs=config.epochs,
        steps_per_epoch=runs,
        lr=config.lr,
        epoch_batches=lambda epoch: torch.randperm(
            runs, generator=torch.Generator().manual_seed(config.seed + epoch)
        ).tolist(),
        batch_loss=batch_loss,
        identity={**asdict(head.config), "tokens": config.tokens},
        model_key="head",
        checkpoint=checkpoint,
        checkpoint_seconds=config.checkpoint_seconds,
        progress=progress,
        bf16=config.bf16,
    )
    head.eval()
    return CTCTrainResult(
        head=head,
        rows=int((labels.greedy[:, 0] >= 0).sum()),
        held_out_rows=int((held_labels.greedy[:, 0] >= 0).sum()),
        acceptance=held_out_acceptance(head, held_stream, held_labels, config.run),
        epoch_losses=losses,
        seconds=time.perf_counter() - started,
    )
