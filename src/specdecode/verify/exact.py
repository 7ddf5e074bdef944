"""The default verifier, lossless: the output is the target's own, whatever was drafted.

Which exact rule decides follows from the request's sampling settings: greedy matching at temperature 0
(:mod:`specdecode.verify.greedy`); with sampling and a seed, Gumbel-max coupled verification
(:mod:`specdecode.verify.coupled`: the tokens are a function of the seed and the target alone, so a seed gives
the same text with every drafter and draft length, and with none); with sampling and no seed, or
``coupled=False``, rejection sampling (:mod:`specdecode.verify.rejection`), which keeps a sampling drafter's
guesses a little more often but whose text depends on what was drafted.
"""

from __future__ import annotations

from specdecode.sampling import sampling_probs
from specdecode.types import Draft, Verdict
from specdecode.verify.base import NoOptions, TargetRows, VerifierMethod
from specdecode.verify.coupled import verify_coupled
from specdecode.verify.greedy import verify_greedy
from specdecode.verify.registry import register_verifier
from specdecode.verify.rejection import verify_speculative_sampling


@register_verifier("exact", lossless=True)
class Exact(VerifierMethod):
    """the target's own output: greedy matching, coupled (seeded) or rejection sampling (default)"""

    greedy_reads_choices_only = True

    @staticmethod
    def verify(rows: TargetRows, draft: Draft, options: NoOptions) -> Verdict:
        sampling = rows.sampling
        if sampling.greedy:
            return verify_greedy(rows.greedy_choices(), draft)
        logits = rows.processed_logits
        if sampling.is_coupled:
            # Row 0 predicts the token at position len(context): the noise is keyed by that position.
            return verify_coupled(logits, draft, sampling, sampling.seed, rows.first_position)
        return verify_speculative_sampling(sampling_probs(logits, sampling), draft, rows.generator)
