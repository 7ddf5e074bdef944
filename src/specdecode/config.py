"""Configuration dataclasses, validated once at the edge so the engine can trust them."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdecode.errors import SpecDecodeError
from specdecode.sampling_params import SamplingParams
from specdecode.verify.registry import VerifierChoice, parse_verifier

#: VocabTrim's default: the draft heads of the self-speculative drafters and trained heads keep
#: this many token ids (most frequent first) instead of the target's whole vocabulary.
DEFAULT_DRAFT_VOCAB = 8192

#: ``--num-draft-tokens`` when none is given: K, "auto" (cost model) or "heuristic" (transformers' schedule).
#: The one place the default lives (the CLI, ``specdecode.load`` and the benchmark's default K read it).  In
#: replay of the quick suite (tools/replay_draft_length.py) "auto" came within 3% of the best fixed K on every
#: task; no fixed K did.
DEFAULT_NUM_DRAFT_TOKENS: int | str = "auto"


@dataclass(frozen=True)
class GenerationConfig:
    """One request: how many tokens, when to stop, how to sample, how far to draft, how to verify.

    verifier: ``exact`` (lossless, the default) or a relaxed, lossy one (``specdecode verifiers``), with its
        options; given as text (``"fly"``, ``"fly:window=2"``) it is parsed here, once."""

    max_new_tokens: int = 128
    num_draft_tokens: int | str = DEFAULT_NUM_DRAFT_TOKENS
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    verifier: VerifierChoice = field(default_factory=VerifierChoice)

    def __post_init__(self) -> None:
        if not isinstance(self.verifier, VerifierChoice):
            object.__setattr__(self, "verifier", parse_verifier(self.verifier))
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise SpecDecodeError(f"max-new-tokens must be a positive integer, got {self.max_new_tokens!r}")
        # Imported here: draft_length needs torch, which ``specdecode --help`` must not load.
        from specdecode.draft_length import make_policy

        make_policy(self.num_draft_tokens)  # validates
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise SpecDecodeError("stop strings must be non-empty strings")
