"""SuffixDecoding (Oliaro et al. 2024): speculate from suffix structures over this request and earlier outputs.

Agentic, repetitive and input-grounded work repeats long spans — of the prompt, of the output so far,
and of earlier outputs (the same tool call, the same boilerplate).  Instead of copying one earlier
occurrence like prompt lookup, a suffix structure knows *every* earlier occurrence of the current
suffix and how often each continuation followed it, so it can propose a tree of the frequent
continuations, and speculate further the longer (so the more trustworthy) the match is.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from specdecode.drafters import register_drafter
from specdecode.drafters._ngram_tree import (
    PayingTrees,
    Transcript,
    TreeProposal,
    check_fraction,
    check_int,
    grow_tree,
)
from specdecode.drafters.base import Drafter, DraftRequest, DraftSession
from specdecode.errors import SpecDecodeError
from specdecode.types import Draft, StepFeedback

if TYPE_CHECKING:
    from specdecode.models.loading import LoadedModel

ROOT = 0


class SuffixTrie:
    """Occurrence counts of every substring of at most ``depth`` tokens of the indexed texts.

    A depth-bounded suffix trie: node = substring, ``count(node)`` = its occurrences.  Each indexed
    token adds at most ``depth`` nodes, so ``size <= depth × tokens indexed``.  Matching is incremental:
    an *active list* holds the nodes of the text's suffixes (``active[m - 1]`` is the suffix of length
    m) and is updated per appended token in O(depth), so proposing never rescans the context.

    Nodes are integers into flat arrays and edges one int-keyed dict: no per-node Python objects,
    which keeps memory near 130 bytes per node and spares the garbage collector millions of objects.
    """

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.size = 0  # nodes, root (node 0) excluded
        self._edges: dict[int, int] = {}  # (parent << 32 | token) -> child
        self._count = array("i", [0])
        self._token = array("i", [-1])
        self._first = array("i", [-1])  # first child, -1 if none; siblings form a doubly linked list
        self._next = array("i", [-1])
        self._prev = array("i", [-1])
        self._free: list[int] = []

    def count(self, node: int) -> int:
        return self._count[node]

    def extend(self, active: list[int], token: int) -> list[int]:
        """Index ``token`` appended to a text whose suffixes are ``active``; the new active list."""
        edges, count = self._edges, self._count
        extended = []
        for node in (ROOT, *active[: self.depth - 1]):
            child = edges.get(node << 32 | token)
            if child is None:
                child = edges[node << 32 | token] = self._new_child(node, token)
            count[child] += 1
            extended.append(child)
        return extended

    def follow(self, active: list[int], token: int) -> list[int]:
        """Like ``extend`` but read-only: the suffixes of (text + token) that occur in the trie."""
        followed = []
        for node in (ROOT, *active[: self.depth - 1]):
            child = self._edges.get(node << 32 | token)
            if child is None:  # a suffix that does not occur has no longer suffix that does
                break
            followed.append(child)
        return followed

    def walk(self, tokens: Sequence[int]) -> list[int]:
        """The active list of a text ending in ``tokens``; only the last ``depth`` tokens matter."""
        active: list[int] = []
        for token in tokens[max(0, len(tokens) - self.depth) :]:
            active = self.follow(active, token)
        return active

    def add(self, tokens: Sequence[int]) -> list[int]:
        """Index a text; its active list."""
        active: list[int] = []
        for token in tokens:
            active = self.extend(active, token)
        return active

    def remove(self, tokens: Sequence[int]) -> None:
        """Undo ``add(tokens)``; nodes whose count drops to zero are freed."""
        for start in range(len(tokens)):
            path = tokens[start : start + self.depth]
            node = ROOT
            for level, token in enumerate(path):
                child = self._edges[node << 32 | token]
                self._count[child] -= 1
                if self._count[child] == 0:  # the rest of the path occurred only here: a chain of count-1 nodes
                    del self._edges[node << 32 | token]
                    self._unlink(node, child)
                    for below in path[level + 1 :]:
                        self._free.append(child)
                        child = self._edges.pop(child << 32 | below)
                    self._free.append(child)
                    self.size -= len(path) - level
                    break
                node = child

    def find(self, pattern: Sequence[int]) -> int | None:
        node: int | None = ROOT
        for token in pattern:
            node = self._edges.get(node << 32 | token)
            if node is None:
                return None
        return node

    def continuations(self, node: int, floor: float) -> list[tuple[int, float, int]]:
        """Next tokens after ``node`` by frequency — their share of the occurrences that continue at all —
        keeping those with a share of at least ``floor``, most frequent first."""
        children = []
        total = 0
        child = self._first[node]
        while child >= 0:
            children.append((self._count[child], self._token[child], child))
            total += self._count[child]
            child = self._next[child]
        least = floor * total
        children = sorted((c for c in children if c[0] >= least), key=lambda c: -c[0])
        return [(token, n / total, child) for n, token, child in children]

    def _new_child(self, parent: int, token: int) -> int:
        head = self._first[parent]
        if self._free:
            node = self._free.pop()
            self._count[node], self._token[node], self._first[node] = 0, token, -1
            self._next[node], self._prev[node] = head, -1
        else:
            node = len(self._count)
            for column, value in (
                (self._count, 0),
                (self._token, token),
                (self._first, -1),
                (self._next, head),
                (self._prev, -1),
            ):
                column.append(value)
        if head >= 0:
            self._prev[head] = node
        self._first[parent] = node
        self.size += 1
        return node

    def _unlink(self, parent: int, node: int) -> None:
        before, after = self._prev[node], self._next[node]
        if before >= 0:
            self._next[before] = after
        else:
            self._first[parent] = after
        if after >= 0:
            self._prev[after] = before


@register_drafter("suffix")
class SuffixDrafter(Drafter):
    """Suffix tries over this request and earlier outputs; proposes a tree of frequent continuations.

    Two :class:`SuffixTrie` s: one over the current prompt + output (rebuilt per request), one over the
    outputs of finished requests (kept in this object across requests — the generator keeps one drafter
    — within a budget of ``global_tokens`` tokens, oldest request evicted first; ``reset()`` empties
    it).  Each step, for every length m of the context's suffix that occurs earlier in either trie, a
    tree is grown best-first over the continuation frequencies, at most ``spec_factor`` × m deep (a
    longer match is more trustworthy); the tree with the highest expected number of accepted tokens
    wins.  Cost per step: O(tree_depth) to index the accepted tokens plus the trees grown.

    Options: ``max_nodes`` (16) draft nodes per step — on a CPU with the fast path a forward over 16 tokens
    costs well under twice one token (``docs/results/forward-cost``), and a long copy (an edit) is accepted 10+
    tokens deep; ``tree_depth`` (24) longest substring indexed, bounding match length plus speculation depth and
    memory (nodes <= tree_depth × tokens indexed); ``spec_factor`` (2.0) depth per matched token; ``min_prob``
    (0.1) least estimated path probability of a node; ``global_tokens`` (8192) earlier output tokens remembered,
    0 to disable.

    The engine caps the depth at ``num_draft_tokens`` (``auto``: up to 16).  A request's output joins the
    global trie when its session finishes.
    """

    def __init__(
        self,
        target: LoadedModel,
        max_nodes: int = 16,
        tree_depth: int = 24,
        spec_factor: float = 2.0,
        min_prob: float = 0.1,
        global_tokens: int = 8192,
    ) -> None:
        super().__init__(target)
        self.max_nodes = check_int("suffix", "max_nodes", max_nodes, 1)
        self.tree_depth = check_int("suffix", "tree_depth", tree_depth, 2)
        if isinstance(spec_factor, bool) or not isinstance(spec_factor, (int, float)) or spec_factor <= 0:
            raise SpecDecodeError(f"suffix option spec_factor must be a number > 0, got {spec_factor!r}")
        self.spec_factor = float(spec_factor)
        self.min_prob = check_fraction("suffix", "min_prob", min_prob)
        self.global_tokens = check_int("suffix", "global_tokens", global_tokens, 0)
        self.reset()

    # -- state shared across requests -------------------------------------------------------------
    def reset(self) -> None:
        self.trees = PayingTrees(self.target)
        self.global_trie = SuffixTrie(self.tree_depth)
        self.global_outputs: deque[list[int]] = deque()
        self.version = 0  # bumped whenever the global trie changes: sessions then re-match against it

    @property
    def global_size(self) -> int:
        """Output tokens currently remembered from earlier requests."""
        return sum(len(output) for output in self.global_outputs)

    def remember(self, output: list[int]) -> None:
        """Index a finished request's output in the global trie, evicting the oldest outputs."""
        output = output[-self.global_tokens :] if self.global_tokens else []
        if not output:
            return
        self.global_trie.add(output)
        self.global_outputs.append(output)
        size = self.global_size
        while size > self.global_tokens:
            oldest = self.global_outputs.popleft()
            self.global_trie.remove(oldest)
            size -= len(oldest)
        self.version += 1

    def session(self, request: DraftRequest) -> SuffixSession:
        return SuffixSession(self, list(request.prompt_ids))


class SuffixSession(DraftSession):
    """One request: its own trie over prompt + output, and where its suffix stands in both tries."""

    def __init__(self, drafter: SuffixDrafter, prompt: list[int]) -> None:
        self.drafter = drafter
        self._begin(prompt)

    def _begin(self, prompt: Sequence[int]) -> None:
        self._transcript = Transcript(prompt)
        self._prompt_len = len(prompt)
        self.local_trie = SuffixTrie(self.drafter.tree_depth)
        self._local_active = self.local_trie.add(prompt)
        self._sync_global()

    def _sync_global(self) -> None:
        self._version = self.drafter.version
        self._global_active = self.drafter.global_trie.walk(self._transcript.tokens)

    def _index(self, context: Sequence[int]) -> None:
        new = self._transcript.advance(context)
        if new is None:  # not a continuation of what we indexed: treat it as a fresh request
            self._begin(context)
            return
        global_trie = self.drafter.global_trie
        for token in new:
            self._local_active = self.local_trie.extend(self._local_active, token)
            self._global_active = global_trie.follow(self._global_active, token)
        if self._version != self.drafter.version:  # another request finished meanwhile
            self._sync_global()

    def observe(self, context: list[int], feedback: StepFeedback) -> None:
        self._index(context)
        self.drafter.trees.learn(feedback)

    def finish(self, context: list[int]) -> None:
        self._index(context)
        self.drafter.remember(self._transcript.tokens[self._prompt_len :])

    def propose(self, context: list[int], max_tokens: int) -> Draft:
        self._index(context)
        drafter = self.drafter
        best: TreeProposal | None = None
        for trie, active in ((self.local_trie, self._local_active), (drafter.global_trie, self._global_active)):
            longer_count, longer_depth = 0, 0
            for match in range(len(active), 0, -1):
                node = active[match - 1]
                bound = min(max_tokens, drafter.spec_factor * match)
                if best is not None and best.score >= bound:
                    break  # a tree's score never exceeds its depth: shorter matches cannot win
                depth = min(int(bound), trie.depth - match)
                # Equal counts mean the same occurrences as the longer match: the same tree unless deeper.
                if trie.count(node) == longer_count and depth <= longer_depth:
                    continue
                longer_count, longer_depth = trie.count(node), depth
                if depth < 1:
                    continue
                proposal = grow_tree(node, trie.continuations, drafter.max_nodes, depth, drafter.min_prob)
                if best is None or proposal.score > best.score:
                    best = proposal
        return self.drafter.trees.choose(best.draft, len(context)) if best is not None else Draft(tokens=[])
