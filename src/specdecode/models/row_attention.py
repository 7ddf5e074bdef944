"""Attention for tokens that continue a sequence, bitwise the same whether a token is fed alone or with others.

Why: a quantized or bf16 model's logits come in bf16 steps, so near-ties are common, and a last-bit
difference between a verification forward and plain decoding's one-token forward can break one differently
(:mod:`specdecode.models.quantize`).  SDPA is not batch invariant: its kernel picks its blocking from the
shapes, so a row's result depends on how many rows share the call and how many keys they see.

Two ways to make the call a row gets independent of its neighbours (:mod:`specdecode.models.ragged` picks):

* **Row by row**: each new token in its own call over exactly the keys it may see — the call a one-token
  forward makes.  Exact by construction, but one kernel call per token and layer, so a 16-row forward costs far
  more than a one-row one while its linear layers cost the same (``docs/results/eagle-lookup-bf16-smollm2-135m``,
  ``tree-plan/``).
* **Buckets** (:func:`attend_chain_in_buckets`, for chains): a token at position p attends over the keys
  ``[0, bucket_end(p))``, the positions after p masked out.  A masked column adds an exact zero to every
  sum, so the result is plain attention; what matters is that the call's key length now depends on the
  bucket only.  Chain rows of one sequence that share a bucket go in one call, and plain decoding makes the
  same call with one row.  That a row gets the same bits however many rows share such a call holds when
  the kernel treats rows as independent problems at a fixed key length; it is probed once per head layout
  (:func:`buckets_are_row_invariant`), and where it does not hold every row is its own call.
* **Trees in buckets** (:class:`TreePlan`): every root-to-leaf path is a chain once its nodes are written in
  order after the cache, and the paths go side by side as batch elements of one call, each with its own
  copy of the key columns (probed too: :func:`batches_are_row_invariant`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

import torch
from torch import nn

#: Key lengths are rounded up to a multiple of this (the slot pool's capacity is one too).
BUCKET = 64
#: At most this many tokens per bucketed call (the probe checks every count up to it) ...
MAX_BUCKET_ROWS = 16
#: ... and at most this many query rows (tokens times query heads per key head): the CPU kernel cuts the
#: rows into blocks of 32, and a row in a short last block (seen: 1 or 4 rows) can come out different.
QUERY_BLOCK = 32

#: The CPU kernel behind ``scaled_dot_product_attention``, called directly: the row-invariant paths make
#: many small calls, and SDPA's choice of backend is a large part of such a call's time.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)

#: Probe results per (kv_heads, groups, head_dim, dtype, threads).
_PROBED: dict[tuple[int, int, int, torch.dtype, int], bool] = {}
_PROBED_BATCHES: dict[tuple[int, int, int, torch.dtype, int], bool] = {}


def bucket_end(position: int) -> int:
    """How many key columns the call for a token at ``position`` covers."""
    return (position // BUCKET + 1) * BUCKET


def one_row_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scaling: float | None
) -> torch.Tensor:
    """One token's attention (its heads as rows of ``query``, [1, kv_heads, groups, d]) over exactly the keys
    given; plain decoding's one-token forwards take this same call."""
    if mask is None and _FLASH_CPU is not None and query.device.type == "cpu":  # (the op wants a float mask)
        return _FLASH_CPU(query, keys, values, 0.0, False, scale=scaling)[0]
    return nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling)


def bucket_call(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    lengths: list[int],
    bucket: int,
    scaling: float | None,
) -> torch.Tensor:
    """Rows ``query`` [1, kv_heads, groups * n, d] (row g * n + r is head g of token r), token r seeing the
    first ``lengths[r]`` of ``bucket`` key columns (``keys``/``values`` [1, kv_heads, >= bucket, d])."""
    mask = _bucket_mask(bucket, tuple(lengths), query.shape[2] // len(lengths), query.dtype)
    return _FLASH_CPU(query, keys[:, :, :bucket], values[:, :, :bucket], 0.0, False, attn_mask=mask, scale=scaling)[0]


@lru_cache(maxsize=64)  # a forward needs one per sequence and bucket; a long bucket is a few MB
def _bucket_mask(bucket: int, lengths: tuple[int, ...], groups: int, dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, groups * n, bucket]: 0 where row g * n + r may look, -inf after its ``lengths[r]`` columns.
    Cached: every layer of a forward asks for the same masks, and building one costs about what the call does."""
    seen = torch.arange(bucket)[None, :] < torch.tensor(lengths)[:, None]
    mask = torch.zeros(len(lengths), bucket, dtype=dtype).masked_fill_(~seen, float("-inf"))
    return mask.repeat(groups, 1)[None, None]


def attend_chain_in_buckets(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    rows: slice,
    past: int,
    scaling: float | None,
) -> torch.Tensor:
    """The chain of new tokens ``query[:, :, rows]`` ([1, heads, T, d]; token r at position ``past + r``) over
    one slot's ``keys``/``values`` [1, kv_heads, capacity, d], in one call per bucket.  Returns [1, heads, n, d]."""
    heads, kv_heads, dim = query.shape[1], keys.shape[1], query.shape[3]
    groups = heads // kv_heads
    most = tokens_per_call(groups)
    n = rows.stop - rows.start
    outputs = []
    first = 0
    while first < n:
        bucket = bucket_end(past + first)
        last = first + 1
        while last < n and last - first < most and bucket_end(past + last) == bucket:
            last += 1
        count = last - first
        q = query[:, :, rows.start + first : rows.start + last].reshape(1, kv_heads, groups * count, dim)
        lengths = [past + r + 1 for r in range(first, last)]
        outputs.append(bucket_call(q, keys, values, lengths, bucket, scaling).view(1, heads, count, dim))
        first = last
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)


def tokens_per_call(groups: int) -> int:
    """How many tokens one bucketed call takes, with ``groups`` query heads per key head."""
    return max(1, min(MAX_BUCKET_ROWS, QUERY_BLOCK // groups))


def buckets_are_row_invariant(kv_heads: int, groups: int, dim: int, dtype: torch.dtype) -> bool:
    """Whether bucketed calls give each row bitwise what a call of that row alone gives, for this head layout
    and thread count (probed once on random values, with one block of keys and with several: the kernel
    blocks keys by 512)."""
    key = (kv_heads, groups, dim, dtype, torch.get_num_threads())
    if key not in _PROBED:
        _PROBED[key] = _FLASH_CPU is not None and all(
            _probe(kv_heads, groups, dim, dtype, bucket) for bucket in (2 * BUCKET, 10 * BUCKET)
        )
    return _PROBED[key]


def batches_are_row_invariant(kv_heads: int, groups: int, dim: int, dtype: torch.dtype) -> bool:
    """Whether a bucketed call's batch elements each get bitwise what they get in a call of their own, with
    keys gathered as :class:`TreePlan` gathers them (probed once per head layout and thread count)."""
    key = (kv_heads, groups, dim, dtype, torch.get_num_threads())
    if key not in _PROBED_BATCHES:
        _PROBED_BATCHES[key] = _FLASH_CPU is not None and all(
            _probe_batches(kv_heads, groups, dim, dtype, bucket) for bucket in (2 * BUCKET, 10 * BUCKET)
        )
    return _PROBED_BATCHES[key]


def _probe_batches(kv_heads: int, groups: int, dim: int, dtype: torch.dtype, bucket: int) -> bool:
    """Three batch elements with gathered key columns (the first in the slot's own order) against each
    alone, and the first against the plain bucket call on the slot's keys in place."""
    generator = torch.Generator().manual_seed(1)
    keys, values = (torch.randn(kv_heads, bucket, dim, generator=generator).to(dtype) for _ in range(2))
    most = tokens_per_call(groups)
    columns = torch.stack([torch.arange(bucket), *(torch.randperm(bucket, generator=generator) for _ in range(2))])
    query = torch.randn(3, kv_heads, groups * most, dim, generator=generator).to(dtype)
    seen = tuple(bucket - most + 1 + r for r in range(most))
    mask = _bucket_mask(bucket, seen, groups, dtype).expand(3, -1, -1, -1)

    def call(elements: slice) -> torch.Tensor:
        gathered = [part[:, columns[elements]].transpose(0, 1) for part in (keys, values)]
        return _FLASH_CPU(query[elements], *gathered, 0.0, False, attn_mask=mask[elements])[0]

    together = call(slice(0, 3))
    in_place = bucket_call(query[:1], keys[None], values[None], list(seen), bucket, None)
    alone = [call(slice(e, e + 1)) for e in range(3)]
    return torch.equal(together[:1], in_place) and all(torch.equal(together[e : e + 1], alone[e]) for e in range(3))


def _probe(kv_heads: int, groups: int, dim: int, dtype: torch.dtype, bucket: int) -> bool:
    generator = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(1, kv_heads, bucket, dim, generator=generator).to(dtype) for _ in range(2))
    most = tokens_per_call(groups)
    query = torch.randn(1, kv_heads, groups, most, dim, generator=generator).to(dtype)
    lengths = [bucket - most + 1 + r for r in range(most)]

    def call(count: int, start: int = 0) -> torch.Tensor:
        q = query[:, :, :, start : start + count].reshape(1, kv_heads, groups * count, dim)
        out = bucket_call(q, keys, values, lengths[start : start + count], bucket, None)
        return out.view(1, kv_heads, groups, count, dim)

    alone = torch.cat([call(1, r) for r in range(most)], dim=3)
    return all(torch.equal(call(count), alone[:, :, :, :count]) for count in range(2, most + 1))


@dataclass(frozen=True)
class _TreeCall:
    """One batched call of a tree plan: entries (a path's rows, up to a call's worth, in one bucket), each
    its own batch element with the slot's columns laid out as plain decoding of that path had cached them."""

    bucket: int
    columns: torch.Tensor  # [E, bucket] the slot column each entry reads at each key column
    rows: torch.Tensor  # [E, t] the tree's new tokens each entry's queries are (padded by repeating the last)
    lengths: tuple[tuple[int, ...], ...]  # per entry and row: how many key columns it sees

    @cached_property
    def _moved(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Where (flattened [E * bucket]) an entry's column is not the slot's own, and which slot column."""
        flat = self.columns.flatten()
        moved = torch.nonzero(flat != torch.arange(self.bucket).repeat(len(self.columns))).flatten()
        return moved, flat[moved]

    def gather(self, part: torch.Tensor) -> torch.Tensor:
        """[E, kv_heads, bucket, d] of one slot's keys or values ``part`` [kv_heads, capacity, d]: the slot's
        first ``bucket`` columns once per entry (a plain copy), then each entry's path written over them
        (gathering every column by index is slower).  ``repeat``, never ``expand().contiguous()``: with one
        entry and a bucket as long as the slot, the latter is the slot itself, and the paths would be written
        into the cache."""
        kv_heads, _, dim = part.shape
        entries = len(self.columns)
        out = part[:, : self.bucket].unsqueeze(1).repeat(1, entries, 1, 1)
        destinations, sources = self._moved
        out.view(kv_heads, entries * self.bucket, dim).index_copy_(1, destinations, part.index_select(1, sources))
        return out.transpose(0, 1)


class TreePlan:
    """A tree's new tokens in batched bucket calls, planned once per forward (every layer reads it).

    Every root-to-leaf path is a chain: its nodes, written in order after the cache, are what plain decoding of that
    branch would have cached, so its rows attend as a chain in buckets.  Paths are batch elements of one call (per
    bucket) that each gather their key columns, so a tree costs a call or two per layer where row by row makes one
    per node (timed in ``docs/results/eagle-lookup-bf16-smollm2-135m/tree-plan``).  That a batch element gets the
    bits it gets alone is probed (:func:`batches_are_row_invariant`)."""

    def __init__(self, paths: list[tuple[list[int], int]], past: int, groups: int) -> None:
        most = tokens_per_call(groups)
        entries: dict[int, list[tuple[list[int], list[int], int]]] = {}  # bucket → (path, rows, first index)
        for path, covered in paths:
            index = covered
            while index < len(path):
                bucket = bucket_end(past + index)
                end = index + 1
                while end < len(path) and end - index < most and bucket_end(past + end) == bucket:
                    end += 1
                entries.setdefault(bucket, []).append((path, path[index:end], index))
                index = end
        self.groups = groups
        self.calls: list[_TreeCall] = []
        flat_position: dict[int, int] = {}
        offset = 0
        for bucket, group in entries.items():
            width = max(len(rows) for _, rows, _ in group)
            columns = torch.arange(bucket).repeat(len(group), 1)
            padded, lengths = [], []
            for entry, (path, rows, first) in enumerate(group):
                visible = path[: bucket - past]  # a path crossing into the next bucket: its head only
                columns[entry, past : past + len(visible)] = past + torch.tensor(visible)
                padded.append(rows + rows[-1:] * (width - len(rows)))
                seen = [past + first + r + 1 for r in range(len(rows))]
                lengths.append(tuple(seen + seen[-1:] * (width - len(rows))))
                for r, node in enumerate(rows):
                    flat_position[node] = offset + entry * width + r
            self.calls.append(_TreeCall(bucket, columns, torch.tensor(padded), tuple(lengths)))
            offset += len(group) * width
        self.order = torch.tensor([flat_position[node] for node in range(len(flat_position))])
        self._masks: dict[torch.dtype, list[torch.Tensor]] = {}

    def masks(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """Per call, [E, 1, groups * t, bucket]: each entry's bucket mask."""
        if dtype not in self._masks:
            self._masks[dtype] = [
                torch.cat([_bucket_mask(call.bucket, seen, self.groups, dtype) for seen in call.lengths])
                for call in self.calls
            ]
        return self._masks[dtype]

    def attend(
        self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float | None
    ) -> torch.Tensor:
        """The tree's new tokens ``query`` [heads, n, d] over one slot's ``keys``/``values`` [kv_heads,
        capacity, d] (the tree written after the cache in its own order).  Returns [1, heads, n, d]."""
        heads, dim = query.shape[0], query.shape[2]
        kv_heads = keys.shape[0]
        outputs = []
        for call, mask in zip(self.calls, self.masks(query.dtype), strict=True):
            entries, width = call.rows.shape
            q = query[:, call.rows].transpose(0, 1).reshape(entries, kv_heads, self.groups * width, dim)
            k, v = call.gather(keys), call.gather(values)
            out = _FLASH_CPU(q, k, v, 0.0, False, attn_mask=mask, scale=scaling)[0]
            outputs.append(out.reshape(entries, heads, width, dim).transpose(0, 1).reshape(heads, entries * width, dim))
        flat = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
        return flat[:, self.order][None]
