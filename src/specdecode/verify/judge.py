"""A learned judge of mismatches (in the spirit of Judge Decoding and Pivot-Aware SD), LOSSY: the output is no
longer the target's own.

Where the draft differs from the target's choice, the exact verifier cuts the draft.  Many such mismatches
are harmless — another word, another variable name — after which the target would carry on with the very
tokens it meant to write.  The judge is a linear classifier that predicts exactly that from what the target
already computes in the verification forward: the target's final hidden state *at the draft token* (the row
that has read it, as Judge Decoding reads the target's embeddings of the draft), the target's log-probability
of the draft token and the normalised entropy of its distribution where the draft token was chosen.

It is trained by ``specdecode train judge`` on the target's own greedy answers: at answer positions, an
alternative the target itself rated plausible (among its ``top_k``, probability >= ``min_prob``) is
substituted, and the example is labelled harmless when the target, fed the substitute, still predicts the
next ``window`` tokens of its own answer (:mod:`specdecode.train.judge`).  A mismatch is kept when it passes
the same plausibility gate and the judge's probability of "harmless" is at least the threshold chosen for the
precision asked at training (or ``judge_threshold``).  No deferred window: the judge alone decides.

Files: ``config.json`` (feature layout, standardisation, threshold, the model it was trained for, held-out
figures), ``model.safetensors`` and ``manifest.json``, as the trained heads (:mod:`specdecode.heads.files`);
saved next to the cached model, where ``--verifier judge`` looks unless ``--verifier-option judge=DIR``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file

from specdecode.errors import SpecDecodeError
from specdecode.heads.files import CONFIG_FILE, WEIGHTS_FILE, check_manifest, head_directory, write_head_files
from specdecode.types import Draft, Verdict
from specdecode.verify.base import TargetRows, VerifierMethod, check_fractions, check_integers
from specdecode.verify.registry import register_verifier
from specdecode.verify.relaxed import entropy, relaxed_walk

if TYPE_CHECKING:
    from specdecode.models.base import CausalLM

#: Where a model's judge lives next to its cached checkpoint.
JUDGE_ARTIFACT = "judge"


@dataclass(frozen=True)
class JudgeOptions:
    """A mismatch passing the gate — the draft token among the target's ``top_k`` most likely, with probability
    >= ``min_prob`` — is kept when the trained judge (``judge``: its directory, default next to the model) rates
    it harmless with probability >= ``judge_threshold`` (default: the threshold chosen at training)."""

    top_k: int = 5
    min_prob: float = 0.05
    judge: str | None = None
    judge_threshold: float | None = None

    def __post_init__(self) -> None:
        check_fractions(self, "min_prob", *(("judge_threshold",) if self.judge_threshold is not None else ()))
        if self.judge is not None and (not isinstance(self.judge, str) or not self.judge):
            raise SpecDecodeError(f"verifier option judge must be a directory, got {self.judge!r}")
        check_integers(self, top_k=1)


@dataclass
class Judge:
    """``P(harmless) = sigmoid(weight . standardised(features) + bias)``; features = [hidden, log p, entropy]."""

    weight: torch.Tensor  # [hidden_size + 2]
    bias: float
    mean: torch.Tensor  # [hidden_size + 2], feature standardisation
    std: torch.Tensor
    threshold: float  # keep a mismatch when P(harmless) >= this
    model: str = ""  # what it was trained for
    report: dict | None = None  # held-out figures from training

    @property
    def hidden_size(self) -> int:
        return int(self.weight.shape[0]) - 2

    def probability(self, features: torch.Tensor) -> torch.Tensor:
        """[n, hidden_size + 2] → [n] probabilities that keeping the mismatch leaves the continuation as it was."""
        z = (features.float() - self.mean) / self.std
        return torch.sigmoid(z @ self.weight + self.bias)

    def save(self, directory: Path) -> None:
        tensors = {"weight": self.weight, "bias": torch.tensor([self.bias]), "mean": self.mean, "std": self.std}
        config = {
            "kind": "specdecode-judge",
            "features": ["final hidden state at the draft token", "log p(draft token)", "normalised entropy"],
            "hidden_size": self.hidden_size,
            "threshold": self.threshold,
            "model": self.model,
            "report": self.report or {},
        }
        write_head_files(directory, {k: v.contiguous().float() for k, v in tensors.items()}, config)


def judge_features(hidden: torch.Tensor, probs: torch.Tensor, token: int) -> torch.Tensor:
    """One mismatch's features: the target's final hidden state at the draft token, the log-probability the
    target gave that token where it was drafted, and that distribution's entropy over log(vocabulary)."""
    log_p = math.log(max(float(probs[token]), 1e-12))
    flatness = entropy(probs) / math.log(probs.shape[-1])
    return torch.cat([hidden.float().reshape(-1), torch.tensor([log_p, flatness])])


def plausible(probs: torch.Tensor, token: int, params: JudgeOptions) -> bool:
    """The gate before the judge (the same one its training examples passed): among the target's ``top_k``
    and with probability at least ``min_prob``."""
    p = float(probs[token])
    return p >= params.min_prob and int(torch.count_nonzero(probs > p)) < params.top_k


def verify_judge(rows: TargetRows, draft: Draft, params: JudgeOptions, judge: Judge, hidden: torch.Tensor) -> Verdict:
    """Exact matching, plus the mismatches the judge calls harmless; ``hidden`` [nodes + 1, hidden_size] is
    the target's final hidden state at every row of the verification forward."""
    threshold = judge.threshold if params.judge_threshold is None else params.judge_threshold

    def keep(row: int, candidates: list[int]) -> int | None:
        probs = rows.raw_probs(row)
        passing = [c for c in candidates if plausible(probs, draft.tokens[c], params)]
        if not passing:
            return None
        features = torch.stack([judge_features(hidden[c + 1], probs, draft.tokens[c]) for c in passing])
        scores = judge.probability(features)
        best = int(scores.argmax())
        return passing[best] if float(scores[best]) >= threshold else None

    return relaxed_walk(rows, draft, keep)


@register_verifier("judge", lossless=False)
class JudgeVerifier(VerifierMethod):
    """a trained judge keeps a mismatch it predicts the target would carry on from (`train judge`) (LOSSY)"""

    options = JudgeOptions
    reads_final_hidden = True

    @classmethod
    def prepare(cls, target: CausalLM, options: JudgeOptions) -> None:
        super().prepare(target, options)
        judge_for(target.name, options.judge, target.hidden_size)  # its judge must exist before a request runs

    @staticmethod
    def verify(rows: TargetRows, draft: Draft, options: JudgeOptions) -> Verdict:
        judge = judge_for(rows.target_name, options.judge, rows.final_hidden.shape[-1])
        return verify_judge(rows, draft, options, judge, rows.final_hidden)


@lru_cache(maxsize=8)
def judge_for(model_name: str, option: str | None, hidden_size: int) -> Judge:
    """The judge of ``--verifier judge`` for ``model_name``: in ``option`` (``--verifier-option judge=DIR``) or
    next to the model, found and loaded once per process — every verification step of a judged request asks
    for it, and finding a registry model's directory checks its files.  Without one, an error that says how
    to make it."""
    path = head_directory(option, model_name, JUDGE_ARTIFACT, "judge", "a judge", "judge", user="verifier")
    return load_judge(path, hidden_size)


def load_judge(path: Path, hidden_size: int) -> Judge:
    """A saved judge (SHA-256 checked), refused when made for another hidden size."""
    try:
        check_manifest(path)
        config = json.loads((path / CONFIG_FILE).read_text())
        tensors = load_file(str(path / WEIGHTS_FILE))
    except (OSError, ValueError, KeyError) as exc:
        raise SpecDecodeError(f"cannot load the judge in {path}: {exc}") from exc
    if config.get("kind") != "specdecode-judge" or config.get("hidden_size") != hidden_size:
        raise SpecDecodeError(
            f"the judge in {path} was made for hidden size {config.get('hidden_size')}, this model has {hidden_size}"
        )
    return Judge(
        weight=tensors["weight"],
        bias=float(tensors["bias"][0]),
        mean=tensors["mean"],
        std=tensors["std"],
        threshold=float(config["threshold"]),
        model=str(config.get("model", "")),
        report=config.get("report"),
    )
