"""Row-invariant attention in buckets (``models/row_attention.py``): plain attention's values, the same bits
for a token however many share its call, and a kernel the probe rejects sends every token its own call."""

from __future__ import annotations

import torch

from specdecode.models import row_attention
from specdecode.models.row_attention import (
    BUCKET,
    TreePlan,
    attend_chain_in_buckets,
    bucket_call,
    bucket_end,
    buckets_are_row_invariant,
    tokens_per_call,
)


def test_buckets_and_tokens_per_call():
    assert [bucket_end(p) for p in (0, BUCKET - 1, BUCKET, 3 * BUCKET + 5)] == [BUCKET, BUCKET, 2 * BUCKET, 4 * BUCKET]
    assert [tokens_per_call(groups) for groups in (1, 3, 6, 64)] == [16, 10, 5, 1]


def test_a_chain_in_buckets_is_attention_and_gives_each_token_its_lone_call_bits():
    """A chain of 12 tokens from position 58 crosses a bucket boundary at 64 and, with 4 query heads per key
    head, a call limit of 8 tokens: three calls, each row bitwise its one-token call, values as SDPA's."""
    kv_heads, groups, dim, past, n = 2, 4, 16, 58, 12
    assert buckets_are_row_invariant(kv_heads, groups, dim, torch.float32)
    generator = torch.Generator().manual_seed(1)
    keys, values = (torch.randn(1, kv_heads, 2 * BUCKET, dim, generator=generator) for _ in range(2))
    query = torch.randn(1, kv_heads * groups, n, dim, generator=generator)
    chain = attend_chain_in_buckets(query, keys, values, slice(0, n), past, None)
    for r in range(n):
        q = query[:, :, r].reshape(1, kv_heads, groups, dim)
        alone = bucket_call(q, keys, values, [past + r + 1], bucket_end(past + r), None).view(1, -1, 1, dim)
        assert torch.equal(chain[:, :, r : r + 1], alone), f"token {r}"
        seen = past + r + 1
        expected = torch.nn.functional.scaled_dot_product_attention(q, keys[:, :, :seen], values[:, :, :seen]).view(
            1, -1, 1, dim
        )
        torch.testing.assert_close(chain[:, :, r : r + 1], expected)


def test_a_kernel_whose_rows_depend_on_their_neighbours_fails_the_probe(monkeypatch):
    exact = row_attention.bucket_call

    def leaky(query, keys, values, lengths, bucket, scaling):  # every row gets a bit of the call's mean
        out = exact(query, keys, values, lengths, bucket, scaling)
        return out + 1e-3 * out.mean(dim=2, keepdim=True)

    monkeypatch.setattr(row_attention, "bucket_call", leaky)
    monkeypatch.setattr(row_attention, "_PROBED", {})
    assert not buckets_are_row_invariant(2, 4, 16, torch.float32)


def test_a_tree_plan_gives_each_node_the_bits_of_its_branch_as_a_lone_chain():
    """Seven nodes in three paths, the deepest (not in the tree's order) crossing the bucket at 64 alone: one
    batched call per bucket, every node bitwise the one-token call plain decoding of its branch makes (the
    branch written after the cache), and the slot's keys and values untouched."""
    kv_heads, groups, dim, past = 2, 4, 16, 61
    assert row_attention.batches_are_row_invariant(kv_heads, groups, dim, torch.float32)
    parents = [-1, 0, 0, 2, 3, 0, 5]  # 0-1, 0-2-3-4, 0-5-6
    branches = []
    for parent in parents:
        branches.append((branches[parent] if parent >= 0 else []) + [len(branches)])
    generator = torch.Generator().manual_seed(2)
    keys, values = (torch.randn(kv_heads, 2 * BUCKET, dim, generator=generator) for _ in range(2))
    query = torch.randn(kv_heads * groups, len(parents), dim, generator=generator)
    paths = [(branches[1], 0), (branches[4], 1), (branches[6], 1)]
    plan = TreePlan(paths, past, groups)
    assert [call.bucket for call in plan.calls] == [BUCKET, 2 * BUCKET]
    slot = [part.clone() for part in (keys, values)]
    tree = plan.attend(query, keys, values, None)
    # The plan reads the slot and never writes it: here the second call has one entry and a bucket as long as
    # the slot, where a gather built on expand().contiguous() wrote the path into the cache itself.
    assert torch.equal(keys, slot[0]) and torch.equal(values, slot[1])
    for node, branch in enumerate(branches):
        laid_out = [part.clone() for part in (keys, values)]
        for part, original in zip(laid_out, (keys, values), strict=True):
            part[:, past : past + len(branch)] = original[:, [past + b for b in branch]]
        seen = past + len(branch)
        q = query[:, node].reshape(1, kv_heads, groups, dim)
        alone = bucket_call(q, laid_out[0][None], laid_out[1][None], [seen], bucket_end(seen - 1), None)
        assert torch.equal(tree[:, :, node : node + 1], alone.view(1, -1, 1, dim)), f"node {node}"
