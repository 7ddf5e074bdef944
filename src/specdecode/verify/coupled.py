"""Drafter-invariant sampling: Gumbel-max coupled verification (Daliri, Musco and Suresh, "Coupling
without communication and drafter-invariant speculative decoding").

The target's token at absolute position t is defined as ``argmax_v(log p_t(v) + G_{seed,t}(v))``: p_t its
processed (temperature / top-k / top-p) distribution given the prefix, G Gumbel(0, 1) noise keyed by the
seed and t alone (:func:`specdecode.sampling.gumbel_noise`).  By the Gumbel-max trick that token is an
exact draw from p_t; and since nothing a drafter does enters the definition, the text is a deterministic
function of (seed, target): every drafter, every draft length and plain decoding give the same tokens.

Verification is then greedy verification with the argmax taken on the perturbed log-probabilities: a
draft token is kept exactly when it equals the target's sample at its position, and the first mismatch
is replaced by that sample.  Trees work unchanged — all nodes at depth d sit at the same absolute
position, so they share its noise, and at most one child can match.  Draft probabilities are not read:
a drafter that samples with the same keyed noise (``draft-model``) proposes the target's token whenever
its own perturbed argmax agrees, which is what keeps acceptance close to rejection sampling's.

The price, against rejection sampling: a drafter that samples with noise of its own (or no coupling at
all) is accepted less often, because a correct guess must now equal one particular draw rather than be
kept with probability min(1, p/q).
"""

from __future__ import annotations

import torch

from specdecode.sampling import coupled_sample
from specdecode.sampling_params import SamplingParams
from specdecode.types import Draft, Verdict, children_by_row


def verify_coupled(
    target_logits: torch.Tensor, draft: Draft, sampling: SamplingParams, seed: int, first_position: int
) -> Verdict:
    """target_logits: [nodes + 1, vocab] raw target logits in the verification row layout (row 0 follows
    the context, row i + 1 follows draft node i); ``first_position``: the absolute position row 0
    predicts, i.e. the context's length.  Row i + 1 predicts position ``first_position + depth(i)``.

    Rows are read lazily along the accepted path (at most depth + 1 of them): each costs a pass over the
    vocabulary and one noise vector, and rows off the path are never needed."""
    children = children_by_row(draft)
    path: list[int] = []
    row, position = 0, first_position
    while True:
        chosen = coupled_sample(target_logits[row], sampling, seed, position)
        match = next((c for c in children[row] if draft.tokens[c] == chosen), None)
        if match is None:
            return Verdict(path=tuple(path), next_token=chosen)
        path.append(match)
        row, position = match + 1, position + 1
