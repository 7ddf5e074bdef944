"""Per-generation statistics: what was drafted, what was accepted, where the time went."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specdecode.verify.registry import DEFAULT_VERIFIER, is_lossless

if TYPE_CHECKING:  # types.py imports torch; the server's protocol module imports this one
    from specdecode.types import StepObservation


@dataclass
class GenerationStats:
    """What one request's decoding did.  Every step yields the target's own token plus the draft tokens kept,
    so ``new_tokens == steps + accepted_tokens`` (the docs and ``--json`` promise it), also when EOS or the
    token limit cuts the last step short: the engine passes ``kept`` to :meth:`record_step`."""

    new_tokens: int = 0
    steps: int = 0  # target verification forwards (the prompt prefill is not a step)
    drafted_tokens: int = 0  # draft nodes sent to verification (a tree counts all its nodes)
    accepted_tokens: int = 0  # draft tokens the target kept
    drafted_at: list[int] = field(default_factory=list)  # per draft depth: steps that drafted that deep
    accepted_at: list[int] = field(default_factory=list)  # per draft depth: steps that accepted that deep
    prefill_s: float = 0.0
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache, not read (specdecode.prefix_cache)
    draft_s: float = 0.0
    verify_s: float = 0.0
    forward_s: float = 0.0  # inside the target's forward passes (prefill and verification); part of the above
    wall_s: float = 0.0
    grammar_s: float = 0.0  # a constrained request's grammar: masks, drafts checked, forced tokens (part of wall_s)
    verifier: str = DEFAULT_VERIFIER  # the request's verifier; the registry says whether it is lossless

    @property
    def lossless(self) -> bool:
        """Whether the output is the target's own (exact verification); false for a relaxed verifier."""
        return is_lossless(self.verifier)

    @classmethod
    def combined(cls, parts: list[GenerationStats]) -> GenerationStats:
        """The statistics of several sequences decoded together for one request (its ``n`` choices): counts and
        times summed, per-depth counts summed depth by depth, the first part's verifier (a request has one)."""
        total = cls(verifier=parts[0].verifier)
        depth = max(len(part.drafted_at) for part in parts)
        total.drafted_at, total.accepted_at = [0] * depth, [0] * depth
        for part in parts:
            for name in ("new_tokens", "steps", "drafted_tokens", "accepted_tokens"):
                setattr(total, name, getattr(total, name) + getattr(part, name))
            for name in ("prefill_s", "draft_s", "verify_s", "forward_s", "wall_s"):
                setattr(total, name, getattr(total, name) + getattr(part, name))
            for i, (drafted, accepted) in enumerate(zip(part.drafted_at, part.accepted_at)):
                total.drafted_at[i] += drafted
                total.accepted_at[i] += accepted
        return total

    def record_step(self, step: StepObservation, kept: int | None = None) -> None:
        """Count a verification step; positions are depths, so a tree counts once per level it reaches.

        ``kept``: accepted draft tokens that were kept when EOS or the token limit cut the step short (so
        that ``new_tokens == accepted_tokens + steps`` always holds)."""
        accepted = step.accepted if kept is None else min(step.accepted, kept)
        self.steps += 1
        self.drafted_tokens += step.nodes
        self.accepted_tokens += accepted
        depth = step.depth
        while len(self.drafted_at) < depth:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for i in range(depth):
            self.drafted_at[i] += 1
            if i < accepted:
                self.accepted_at[i] += 1

    def drop_tail(self, dropped: int, last_accepted: int) -> None:
        """Uncount the output's last ``dropped`` tokens, all from the last step (which kept ``last_accepted`` draft
        tokens): a stop string completed before them, so the caller never gets them.  Tokens/s and the usage
        count what was returned, as plain decoding (which stops at once) does; ``new_tokens == steps +
        accepted_tokens`` still holds."""
        last_accepted = min(last_accepted, len(self.accepted_at))  # a step's tokens: its accepted ones plus one
        dropped = min(dropped, last_accepted)  # the step's own token always stays: the stop ends in it or later
        for depth in range(last_accepted - dropped, last_accepted):
            self.accepted_at[depth] -= 1
        self.accepted_tokens -= dropped
        self.new_tokens -= dropped

    @property
    def mean_accepted_tokens(self) -> float:
        """Tokens produced per target forward: accepted draft tokens plus the target's own token."""
        return (self.accepted_tokens + self.steps) / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def other_s(self) -> float:
        return max(0.0, self.wall_s - self.prefill_s - self.draft_s - self.verify_s)

    @property
    def overhead_s(self) -> float:
        """The engine's own time: everything but target forwards and the drafter (verification logic,
        cache compaction, the draft-length policy, streaming/detokenisation between steps)."""
        return max(0.0, self.wall_s - self.forward_s - self.draft_s)

    @property
    def overhead_fraction(self) -> float:
        return self.overhead_s / self.wall_s if self.wall_s > 0 else 0.0

    def to_json(self) -> dict:
        return {
            "new_tokens": self.new_tokens,
            "steps": self.steps,
            "mean_accepted_tokens": round(self.mean_accepted_tokens, 4),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "wall_s": round(self.wall_s, 4),
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_by_position": [round(x, 4) for x in self.acceptance_by_position],
            "prefill_s": round(self.prefill_s, 4),
            "cached_tokens": self.cached_tokens,
            "draft_s": round(self.draft_s, 4),
            "verify_s": round(self.verify_s, 4),
            "other_s": round(self.other_s, 4),
            "forward_s": round(self.forward_s, 4),
            "overhead_s": round(self.overhead_s, 4),
            "overhead_fraction": round(self.overhead_fraction, 4),
            "grammar_s": round(self.grammar_s, 4),
            "verifier": self.verifier,
            "lossless": self.lossless,
        }

    def summary(self) -> str:
        return (
            f"{self.new_tokens} tokens in {self.wall_s:.2f} s ({self.tokens_per_s:.1f} tok/s), "
            f"{self.steps} steps, mean accepted tokens {self.mean_accepted_tokens:.2f}, "
            f"acceptance rate {self.acceptance_rate:.1%}; time: prefill {self.prefill_s:.2f} s, "
            f"draft {self.draft_s:.2f} s, verify {self.verify_s:.2f} s, other {self.other_s:.2f} s; "
            f"target forwards {self.forward_s:.2f} s, engine overhead {self.overhead_fraction:.1%}"
            + ("" if self.lossless else f"; verifier {self.verifier} (LOSSY: not the target's exact output)")
        )
