"""specdecode's model-free drafters as vLLM proposers, run inside vLLM's scheduler (``custom_class``).

    vllm serve MODEL --speculative-config \\
        '{"method": "custom_class", "model": "specdecode.integrations.vllm_proposer.SuffixProposer",
          "num_speculative_tokens": 8}'

with specdecode's ``src`` on vLLM's ``PYTHONPATH`` (``tools/vllm_cpu.py serve MODEL --proposer suffix`` does it).
vLLM verifies every draft against its own target, so its output stays its own whatever we propose.

vLLM builds the proposer with its ``VllmConfig`` and calls ``propose(sampled_token_ids, num_tokens_no_spec,
token_ids_cpu)`` after every step: per row of its batch, the tokens sampled this step ([] for a row that sampled
none, e.g. a prompt still being read) and the row's tokens so far (prompt + output).  It names no request and
says nothing of requests that end, so a row is tied to its drafting session by its tokens: a request's tokens
only ever grow, so the session whose last seen tokens begin the row's is that row's request (rows move when
others leave the batch).  A session no row continues has left the batch, finished or cancelled — as vLLM's own
suffix proposer reads an ended request — and is finished, so that a drafter with cross-request memory
(``suffix``'s tree of earlier outputs, ``cacheback``'s tables) learns from its output.

Only the drafter modules are imported (numpy and torch, no transformers): vLLM's venv has its own transformers.
The drafters get no target model: their one use of it is to price a tree's width on our verifier, and vLLM
verifies one chain, the most likely path of the drafter's tree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from specdecode.drafters.base import Drafter, DraftRequest, DraftSession
from specdecode.drafters.cacheback import CachebackDrafter
from specdecode.drafters.pld import PromptLookupDrafter
from specdecode.drafters.suffix import SuffixDrafter
from specdecode.types import Draft

if TYPE_CHECKING:
    from collections.abc import Sequence


def main_path(draft: Draft) -> list[int]:
    """A draft's chain as is; a tree's path through each node's first child (the drafters grow trees best
    first, so that is the path they judge most likely)."""
    if draft.parents is None:
        return list(draft.tokens)
    path, node = [], -1
    for index, parent in enumerate(draft.parents):
        if parent == node:
            path.append(draft.tokens[index])
            node = index
    return path


@dataclass
class _Tracked:
    """One request as last seen in vLLM's batch: its drafting session, row and tokens."""

    session: DraftSession
    row: int
    tokens: np.ndarray

    def continued_by(self, tokens: np.ndarray) -> bool:
        seen = len(self.tokens)
        return len(tokens) >= seen and np.array_equal(tokens[:seen], self.tokens)


class DrafterProposer:
    """A vLLM proposer drafting with one specdecode drafter: one session per request, chains of at most
    ``num_speculative_tokens`` tokens."""

    drafter_class: ClassVar[type[Drafter]]

    def __init__(self, vllm_config: Any) -> None:
        self.max_tokens = vllm_config.speculative_config.num_speculative_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        self.drafter = self.drafter_class(None)
        self.tracked: list[_Tracked] = []

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """vLLM hands its proposer the target model once loaded; a model-free drafter has no use for it."""

    def propose(
        self,
        sampled_token_ids: Sequence[Sequence[int]],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        slot_mappings: Any = None,
    ) -> list[list[int]]:
        """Per row of vLLM's batch, the draft that follows its tokens ([]: none, or a row that sampled nothing)."""
        previous, self.tracked = self.tracked, []
        rows: list[tuple[_Tracked | None, np.ndarray]] = []
        for row, sampled in enumerate(sampled_token_ids):
            length = int(num_tokens_no_spec[row])
            tokens = token_ids_cpu[row, :length]
            request = self._claim(previous, row, tokens)
            if request is None and sampled:
                prompt = tuple(int(token) for token in tokens[: length - len(sampled)])
                request = _Tracked(self.drafter.session(DraftRequest(prompt_ids=prompt)), row, tokens)
            if request is not None:  # else a prompt still being read: its session starts with its first token
                request.row, request.tokens = row, tokens.copy()
                self.tracked.append(request)
            rows.append((request, tokens))
        # Finished before anyone drafts, so that a request arriving as another ends drafts from its output.
        for ended in previous:
            ended.session.finish(ended.tokens.tolist())
        drafts: list[list[int]] = []
        for (request, tokens), sampled in zip(rows, sampled_token_ids, strict=True):
            room = min(self.max_tokens, self.max_model_len - len(tokens) - 1)
            if request is None or not sampled or room <= 0:
                drafts.append([])
            else:
                drafts.append(main_path(request.session.propose(tokens.tolist(), room))[:room])
        return drafts

    @staticmethod
    def _claim(previous: list[_Tracked], row: int, tokens: np.ndarray) -> _Tracked | None:
        """The request whose tokens ``tokens`` continue, taken out of ``previous``: the one last seen in the same
        row first (rows only move when others leave), else any."""
        candidates = sorted(range(len(previous)), key=lambda index: previous[index].row != row)
        for index in candidates:
            if previous[index].continued_by(tokens):
                return previous.pop(index)
        return None


class SuffixProposer(DrafterProposer):
    """``suffix``: suffix tries over the request and the outputs of finished requests."""

    drafter_class = SuffixDrafter


class PldProposer(DrafterProposer):
    """``pld``: prompt lookup."""

    drafter_class = PromptLookupDrafter


class CacheBackProposer(DrafterProposer):
    """``cacheback``: LRU n-gram tables shared by every request."""

    drafter_class = CachebackDrafter


#: The proposer class of each drafter name, as ``tools/vllm_cpu.py serve --proposer`` names them.
PROPOSERS: dict[str, type[DrafterProposer]] = {
    "suffix": SuffixProposer,
    "pld": PldProposer,
    "cacheback": CacheBackProposer,
}
