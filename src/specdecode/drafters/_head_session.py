"""What a session drafting with a trained head over the target's features does each step, shared by ``eagle`` and
``falcon``: it keeps the features the engine hands over until the next draft, and a draft is the prompt-lookup
branch alone when that is all that pays, else the head catches up on the new features and drafts a tree (greedy) or a
sampled chain.  How a head catches up and grows its tree or chain is each drafter's own."""

from __future__ import annotations

import torch

from specdecode.drafters._lookup_graft import Copy, NodeSources, copy_draft
from specdecode.drafters.base import DraftSession
from specdecode.types import Draft, StepFeedback


class HeadSession(DraftSession):
    """Subclasses set ``drafter`` (with ``budget``, ``lookup`` and ``calibration``), ``sampling``, ``pending`` (an empty
    list) and ``sources`` in their constructor, and implement ``_catch_up``, ``_tree`` and ``_chain``."""

    def observe_prompt(self, hidden: torch.Tensor) -> None:
        self.pending.append(hidden)

    def observe(self, context: list[int], feedback: StepFeedback) -> None:
        self.sources.learn(feedback, self.drafter.calibration, self.drafter.lookup.calibration)
        if feedback.target_hidden is not None:
            self.pending.append(feedback.target_hidden[feedback.accepted_rows])

    @torch.inference_mode()
    def propose(self, context: list[int], max_tokens: int) -> Draft:
        self.sources = NodeSources()
        if max_tokens <= 0:
            return Draft(tokens=[])
        tree = self.sampling.greedy and self.drafter.budget.drafts_trees
        copy = self.drafter.lookup.copy(context, max_tokens) if tree else Copy()
        if self.drafter.lookup.alone(copy):  # the head catches up on the features later, in one call
            self.sources = NodeSources.of_copy(copy)
            return copy_draft(copy)
        root = self._catch_up(context)
        if root is None:
            return Draft(tokens=[])
        if tree:
            return self._tree(root, len(context), max_tokens, copy)
        return self._chain(root, len(context), max_tokens)

    def _catch_up(self, context: list[int]) -> torch.Tensor | None:
        """Feed the head every feature now known; what the first draft token is predicted from (None: nothing yet)."""
        raise NotImplementedError

    def _tree(self, root: torch.Tensor, length: int, max_depth: int, copy: Copy) -> Draft:
        raise NotImplementedError

    def _chain(self, root: torch.Tensor, length: int, max_tokens: int) -> Draft:
        raise NotImplementedError
