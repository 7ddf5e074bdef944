"""The ragged attention kernel (:mod:`specdecode.models.attention_kernel`): SDPA's results to float noise, for chains,
trees, sliding windows and bf16, and each row bitwise what it gets alone — in a chain, in a tree (its branch decoded
one token at a time) and beside other sequences — where SDPA's calls, the broken control, are not."""

from __future__ import annotations

import pytest
import torch

import specdecode.models.ragged as ragged
from specdecode.models.attention_kernel import ragged_attention_op
from specdecode.models.ragged import RaggedBatch, SequenceSlice, ragged_attention

pytestmark = pytest.mark.skipif(ragged_attention_op() is None, reason="the attention kernel is not built here")

HEADS, KV_HEADS, DIM, CAPACITY = 6, 2, 64, 96
TREE = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)


class _Module:  # what ragged_attention reads of the attention module
    class config:
        attn_logit_softcapping = None


def storage(dtype=torch.float32, seed: int = 0, dim: int = DIM) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (4, KV_HEADS, CAPACITY, dim)
    return torch.randn(shape, generator=generator).to(dtype), torch.randn(shape, generator=generator).to(dtype)


def attend(query, keys, values, sequences, window=None, kernel=True, monkeypatch=None) -> torch.Tensor:
    if not kernel:
        monkeypatch.setattr(ragged, "kernel_attends", lambda query: False)
    out, _ = ragged_attention(
        _Module, query, keys, values, None, 0.125, sliding_window=window, ragged=RaggedBatch(sequences)
    )
    if not kernel:
        monkeypatch.undo()
    return out


def mixed_batch() -> list[SequenceSlice]:
    """A decoding row, a tree of four, a chain of three and a prompt's chunk of twenty (which SDPA keeps)."""
    return [
        SequenceSlice(0, slice(0, 1), 10, torch.tensor([10]), None),
        SequenceSlice(2, slice(1, 5), 20, torch.tensor([20, 21, 21, 22]), TREE),
        SequenceSlice(1, slice(5, 8), 5, torch.tensor([5, 6, 7]), None),
        SequenceSlice(3, slice(8, 28), 0, torch.arange(20), None, invariant=False),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 4])
def test_the_kernel_computes_what_sdpa_computes(monkeypatch, dtype, window):
    keys, values = storage(dtype)
    query = torch.randn(1, HEADS, 28, DIM).to(dtype)
    got = attend(query, keys, values, mixed_batch(), window)
    expected = attend(query, keys, values, mixed_batch(), window, kernel=False, monkeypatch=monkeypatch)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(got.float(), expected.float(), atol=tolerance, rtol=tolerance)


def rows_alone_equal_rows_in_a_chain(kernel: bool, monkeypatch, dim: int = DIM) -> bool:
    keys, values = storage(dim=dim)
    query = torch.randn(1, HEADS, 5, dim, generator=torch.Generator().manual_seed(1))
    chain = attend(
        query, keys, values, [SequenceSlice(0, slice(0, 5), 30, torch.arange(30, 35), None)], None, kernel, monkeypatch
    )
    for row in range(5):
        alone = SequenceSlice(0, slice(0, 1), 30 + row, torch.tensor([30 + row]), None)
        one = attend(query[:, :, row : row + 1], keys, values, [alone], None, kernel, monkeypatch)
        if not torch.equal(one[0, 0], chain[0, row]):
            return False
    return True


@pytest.mark.parametrize("dim", [DIM, 128, 96])
def test_each_row_of_a_chain_gets_bitwise_what_it_gets_alone(monkeypatch, dim):
    """Heads of 64 and 128 dimensions score a column at a time, others a tile at a time: each the same alone."""
    assert rows_alone_equal_rows_in_a_chain(kernel=True, monkeypatch=monkeypatch, dim=dim)


@pytest.mark.parametrize("dim", [128, 96])
def test_heads_of_other_sizes_compute_what_sdpa_computes(monkeypatch, dim):
    keys, values = storage(dim=dim)
    query = torch.randn(1, HEADS, 28, dim)
    got = attend(query, keys, values, mixed_batch())
    expected = attend(query, keys, values, mixed_batch(), kernel=False, monkeypatch=monkeypatch)
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)


def test_broken_control_sdpa_gives_a_chain_row_other_bits_than_alone(monkeypatch):
    """SDPA's one call for the chain rounds its rows otherwise than a call per row: the test above can fail."""
    assert not rows_alone_equal_rows_in_a_chain(kernel=False, monkeypatch=monkeypatch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_chain_row_gets_the_same_bits_in_chains_of_any_length_on_any_thread_count(dtype):
    """The kernel cuts a call's rows into work items by their count, splits the items between the threads by cost and
    sums the values of an item's rows together: none of it may change a row's bits."""
    keys, values = storage(dtype)
    query = torch.randn(1, HEADS, 12, DIM, generator=torch.Generator().manual_seed(4)).to(dtype)
    threads = torch.get_num_threads()
    try:
        outputs = []
        for count in (1, 2):
            torch.set_num_threads(count)
            for length in range(1, 13):
                chain = SequenceSlice(0, slice(0, length), 30, torch.arange(30, 30 + length), None)
                outputs.append(attend(query[:, :, :length], keys, values, [chain])[0])
    finally:
        torch.set_num_threads(threads)
    longest = outputs[11]
    for out in outputs:
        assert torch.equal(out, longest[: len(out)])


def test_a_tree_row_gets_bitwise_what_its_branch_gets_decoded_alone():
    keys, values = storage()
    query = torch.randn(1, HEADS, 4, DIM, generator=torch.Generator().manual_seed(2))
    past = 20
    tree = attend(query, keys, values, [SequenceSlice(2, slice(0, 4), past, torch.tensor([20, 21, 21, 22]), TREE)])
    for row, branch in enumerate([[0], [0, 1], [0, 2], [0, 2, 3]]):
        alone_keys, alone_values = keys.clone(), values.clone()
        # Plain decoding of the branch has cached its nodes one after another behind the cache.
        alone_keys[2, :, past : past + len(branch)] = keys[2, :, [past + node for node in branch]]
        alone_values[2, :, past : past + len(branch)] = values[2, :, [past + node for node in branch]]
        position = past + len(branch) - 1
        alone = SequenceSlice(2, slice(0, 1), position, torch.tensor([position]), None)
        one = attend(query[:, :, row : row + 1], alone_keys, alone_values, [alone])
        assert torch.equal(one[0, 0], tree[0, row]), row


def test_a_row_gets_the_same_bits_beside_any_other_sequences():
    keys, values = storage()
    query = torch.randn(1, HEADS, 28, DIM, generator=torch.Generator().manual_seed(3))
    batched = attend(query, keys, values, mixed_batch())
    decoding = mixed_batch()[0]
    alone = attend(query[:, :, :1], keys, values, [decoding])
    assert torch.equal(alone[0, 0], batched[0, 0])


def test_heads_of_a_size_the_kernel_does_not_take_attend_through_sdpa():
    """Head size 8 is not a whole number of the kernel's 16-float vectors: SDPA attends, with no error."""
    keys, values = torch.randn(1, KV_HEADS, 16, 8), torch.randn(1, KV_HEADS, 16, 8)
    query = torch.randn(1, HEADS, 2, 8)
    out = attend(query, keys, values, [SequenceSlice(0, slice(0, 2), 4, torch.tensor([4, 5]), None)])
    assert out.shape == (1, 2, HEADS, 8) and torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_kept_tree_path_moves_in_one_call_as_indexing_moves_it(dtype):
    """``SlotPool.move`` (a verified tree's accepted path put right after the cache): every layer's keys and values in
    the kernel's one call, bitwise as indexing each tensor moves them, other slots and columns untouched."""
    pool = ragged.SlotPool(torch.device("cpu"))
    pool.layers = {layer: storage(dtype, seed=layer) for layer in range(3)}
    expected = {layer: tuple(t.clone() for t in pair) for layer, pair in pool.layers.items()}
    columns = torch.tensor([20, 22, 23, 27])  # the path through nodes 0, 2, 3 and 7 of a tree cached from column 20
    for pair in expected.values():
        for tensor in pair:
            tensor[2, :, 20:24] = tensor[2, :, columns]
    pool.move(2, 20, columns)
    for layer, pair in pool.layers.items():
        assert all(torch.equal(got, want) for got, want in zip(pair, expected[layer]))
    with pytest.raises(RuntimeError, match="ascend"):  # a column behind its target would be overwritten first
        pool.move(2, 20, torch.tensor([21, 20]))
