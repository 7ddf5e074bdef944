"""The prompt chunk's attention kernel (``kernels/chunk_attention.cpp``): SDPA's causal result to float noise for chunks
of any size at any cached length and head layout; a row's result depends only on what it sees (a key after it changed
leaves it bitwise alone, a key before it changed does not); the ragged forward sends a long fp32 chunk to it and keeps
SDPA for bf16, a sliding window and a tree."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import specdecode.models.ragged as ragged
from specdecode.models.attention_kernel import chunk_attention_op
from specdecode.models.ragged import RaggedBatch, SequenceSlice, ragged_attention

pytestmark = pytest.mark.skipif(
    chunk_attention_op(torch.empty(1, 64), None) is None, reason="the CPU kernels are not built here"
)

CAPACITY = 320


def storage(kv_heads: int, dim: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (3, kv_heads, CAPACITY, dim)
    return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


def kernel(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slot: int, past: int) -> torch.Tensor:
    """[n, heads, dim] for query [heads, n, dim]."""
    out = query.new_empty(query.shape[1], query.shape[0], query.shape[2])
    return chunk_attention_op(query, None)(query, keys, values, slot, past, query.shape[-1] ** -0.5, out)


def sdpa(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slot: int, past: int) -> torch.Tensor:
    n = query.shape[1]
    visible = torch.ones(n, past + n, dtype=torch.bool).tril(past)
    k, v = keys[slot : slot + 1, :, : past + n], values[slot : slot + 1, :, : past + n]
    out = nn.functional.scaled_dot_product_attention(query[None], k, v, attn_mask=visible, enable_gqa=True)
    return out[0].transpose(0, 1)


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (14, 2, 64), (4, 4, 128), (7, 1, 64)])
@pytest.mark.parametrize(("past", "n"), [(0, 128), (0, 1), (5, 7), (100, 33), (129, 50), (250, 70)])
def test_the_kernel_computes_causal_attention(heads, kv_heads, dim, past, n):
    keys, values = storage(kv_heads, dim)
    query = torch.randn(heads, n, dim, generator=torch.Generator().manual_seed(1))
    got = kernel(query, keys, values, 1, past)
    assert torch.allclose(got, sdpa(query, keys, values, 1, past), atol=1e-5, rtol=1e-5)


def test_a_query_strided_like_a_forwards_reads_the_same():
    keys, values = storage(3, 64)
    query = torch.randn(1, 40, 9, 64).transpose(1, 2)[0]  # [heads, n, dim], rows 9 x 64 floats apart
    assert torch.equal(kernel(query, keys, values, 2, 17), kernel(query.contiguous(), keys, values, 2, 17))


def test_a_row_depends_only_on_the_keys_it_sees():
    keys, values = storage(3, 64)
    query = torch.randn(9, 60, 64, generator=torch.Generator().manual_seed(2))
    before = kernel(query, keys, values, 0, 40)
    later = keys.clone()
    later[0, :, 40 + 30] += 1.0  # the key of the chunk's token 30: rows 0-29 do not see it
    after = kernel(query, later, values, 0, 40)
    assert torch.equal(after[:30], before[:30])
    assert not torch.equal(after[30:], before[30:])  # the control: the rows that see it change
    # The same rows read as part of a shorter chunk that starts later get the same bits.
    assert torch.equal(kernel(query[:, 20:], keys, values, 0, 60), before[20:])


class _Module:  # what ragged_attention reads of the attention module
    class config:
        attn_logit_softcapping = None


def forward(query, keys, values, sequences, window=None) -> torch.Tensor:
    out, _ = ragged_attention(
        _Module, query, keys, values, None, None, sliding_window=window, ragged=RaggedBatch(sequences)
    )
    return out


@pytest.mark.parametrize(
    ("dtype", "window", "tree", "takes_kernel"),
    [
        (torch.float32, None, False, True),
        (torch.bfloat16, None, False, False),
        (torch.float32, 8, False, False),
        (torch.float32, None, True, False),
    ],
)
def test_the_ragged_forward_sends_a_long_fp32_chunk_to_it(monkeypatch, dtype, window, tree, takes_kernel):
    calls = []
    real = ragged.chunk_attention_op

    def spy(query, sliding_window):
        op = real(query, sliding_window)
        if op is None:
            return None
        return lambda *args: calls.append(args[3]) or op(*args)

    monkeypatch.setattr(ragged, "chunk_attention_op", spy)
    keys, values = (tensor.to(dtype) for tensor in storage(2, 64))
    n = 24
    mask = torch.ones(n, n, dtype=torch.bool).tril() if tree else None
    sequences = [
        SequenceSlice(0, slice(0, 1), 10, torch.tensor([10]), None),
        SequenceSlice(2, slice(1, 1 + n), 30, torch.arange(30, 30 + n), mask, invariant=False),
    ]
    query = torch.randn(1, 6, 1 + n, 64).to(dtype)
    got = forward(query, keys, values, sequences, window)
    assert calls == ([2] if takes_kernel else [])
    monkeypatch.setattr(ragged, "chunk_attention_op", lambda query, sliding_window: None)
    expected = forward(query, keys, values, sequences, window)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(got.float(), expected.float(), atol=tolerance, rtol=tolerance)
