"""``specdecode train judge``: fit the linear judge of :mod:`specdecode.verify.judge` on the target's own answers.

Examples: at answer positions of the target's greedy answers (self-distilled, to prompts the benchmark never
draws), each alternative the target itself finds plausible there (among its ``top_k``, probability >=
``min_prob``, not its own choice) is fed in place of its token, followed by the next ``window`` tokens of its
answer, in one forward from the cached prefix.  Label: harmless when the target, having read the substitute,
still predicts every one of those ``window`` tokens — keeping the substitute would not have changed what it
writes next.  Features: the final hidden state at the substitute and the two numbers of
:func:`~specdecode.verify.judge.judge_features`.

The classifier is logistic regression on standardised features (class-weighted, full batch, AdamW).  The
threshold is the lowest score whose held-out precision reaches ``--precision``: of the mismatches the judge
keeps, that share is harmless by the label's definition; the held-out recall says how many it finds.  Where
no threshold reaches it, the threshold with the best F1 is taken and the report says so.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from specdecode.errors import SpecDecodeError
from specdecode.models.base import CausalLM, HiddenStates, require_capability
from specdecode.verify.judge import Judge, JudgeOptions, judge_features, plausible


@dataclass
class Examples:
    features: list[torch.Tensor]
    labels: list[bool]


@torch.inference_mode()
def collect_examples(
    backend: CausalLM,
    sequence: list[int],
    answer_start: int,
    window: int,
    params: JudgeOptions,
    positions: int,
    rng: random.Random,
    into: Examples,
) -> None:
    """Examples from one prompt + greedy answer: at up to ``positions`` answer positions (chosen at random),
    every plausible alternative to the target's token, labelled by whether the target carries on unchanged."""
    final = (backend.num_layers,)
    cache = backend.new_cache()
    try:
        prompt = torch.tensor(sequence[:answer_start])
        out = backend.forward(prompt, cache, logits_rows=slice(-1, None), invariant=False)
        logits = out.logits[-1]
        candidates = range(answer_start, len(sequence) - window)
        chosen = set(rng.sample(candidates, min(positions, len(candidates))))
        for i in candidates:
            if i in chosen:
                probs = torch.softmax(logits.float(), dim=-1)
                top = torch.topk(probs, params.top_k).indices.tolist()
                following = torch.tensor(sequence[i + 1 : i + 1 + window])
                for token in top:
                    if token == sequence[i] or not plausible(probs, token, params):
                        continue
                    trial = backend.forward(torch.tensor([token, *following.tolist()]), cache, hidden_layers=final)
                    into.labels.append(bool((trial.logits[:window].argmax(-1) == following).all()))
                    into.features.append(judge_features(trial.hidden[0], probs, token))
                    cache.crop(i)
            logits = backend.forward(torch.tensor([sequence[i]]), cache).logits[-1]
    finally:
        cache.release()


def fit_judge(
    features: torch.Tensor,
    labels: torch.Tensor,
    precision: float,
    holdout: float = 0.2,
    epochs: int = 300,
    lr: float = 0.05,
    seed: int = 0,
    model: str = "",
) -> Judge:
    """Logistic regression on standardised features; the threshold reaching ``precision`` on held-out rows."""
    n = len(labels)
    if n < 4 or labels.all() or not labels.any():
        raise SpecDecodeError(
            f"judge training needs harmless and harmful examples, got {int(labels.sum())} of {n} harmless: "
            "use more prompts or positions"
        )
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_held = max(1, round(holdout * n))
    held, train = order[:n_held], order[n_held:]
    x, y = features[train].float(), labels[train].float()
    mean, std = x.mean(0), x.std(0).clamp_min(1e-4)
    weight = torch.zeros(x.shape[1], requires_grad=True)
    bias = torch.zeros(1, requires_grad=True)
    positive = float(y.mean().clamp(1e-3, 1 - 1e-3))
    pos_weight = torch.tensor((1 - positive) / positive)  # balance the classes
    optimizer = torch.optim.AdamW([weight, bias], lr=lr, weight_decay=1e-2)
    z = (x - mean) / std
    for _ in range(epochs):
        loss = torch.nn.functional.binary_cross_entropy_with_logits(z @ weight + bias, y, pos_weight=pos_weight)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    judge = Judge(weight.detach(), float(bias.detach()), mean, std, threshold=1.0, model=model)
    scores = judge.probability(features[held])
    truth = labels[held]
    judge.threshold, report = choose_threshold(scores, truth, precision)
    judge.report = {"examples": n, "harmless_share": round(float(labels.float().mean()), 4), **report}
    return judge


def choose_threshold(scores: torch.Tensor, truth: torch.Tensor, precision: float) -> tuple[float, dict]:
    """The lowest score threshold whose precision on (``scores``, ``truth``) is >= ``precision``, with the
    precision and recall it gives there.  When no threshold reaches it, the one with the best F1 (a judge that
    keeps nothing would be the exact verifier under another name); the report says which."""
    best = None
    best_f1 = (0.0, 1.0, 1.0, 0.0)
    positives = max(int(truth.sum()), 1)
    for threshold in sorted(set(scores.tolist()), reverse=True):
        kept = scores >= threshold
        hits = int((kept & truth).sum())
        if not hits:
            continue
        got, recall = hits / int(kept.sum()), hits / positives
        if got >= precision:
            best = (threshold, got, recall)
        f1 = 2 * got * recall / (got + recall)
        if f1 > best_f1[0]:
            best_f1 = (f1, threshold, got, recall)
    reached = best is not None
    threshold, got, recall = best if reached else best_f1[1:]
    return threshold, {
        "held_out": len(truth),
        "threshold": round(threshold, 4),
        "precision_asked": precision,
        "precision_reached": reached,
        "held_out_precision": round(got, 4),
        "held_out_recall": round(recall, 4),
    }


def train_judge(
    backend: CausalLM,
    sequences: list[tuple[list[int], int]],
    *,
    window: int,
    params: JudgeOptions,
    positions: int,
    precision: float,
    seed: int,
    model: str,
    progress: bool = True,
) -> tuple[Judge, float]:
    """(the judge, seconds spent collecting) from ``(prompt + answer, answer start)`` pairs."""
    require_capability(backend, HiddenStates, "judge training")
    rng = random.Random(seed)
    examples = Examples([], [])
    started = time.perf_counter()
    for sequence, start in tqdm(sequences, desc="judging alternatives", unit="answer", disable=not progress):
        collect_examples(backend, sequence, start, window, params, positions, rng, examples)
    seconds = time.perf_counter() - started
    if not examples.features:
        raise SpecDecodeError("no plausible alternatives found in the answers: use more prompts or positions")
    judge = fit_judge(torch.stack(examples.features), torch.tensor(examples.labels), precision, seed=seed, model=model)
    return judge, seconds
