"""The few-row product of the CPU fast path (``kernels/few_rows.cpp``): torch's result to float noise, and each row
bitwise what it gets alone, for every row count a tile takes (1 to 4 rows, and 4 plus a remainder)."""

from __future__ import annotations

import pytest
import torch

from specdecode.models.cpu_kernels import cpu_kernels_built, few_rows_linear

pytestmark = pytest.mark.skipif(not cpu_kernels_built(), reason="the CPU kernels are not built here")


def weights(out: int = 70, inner: int = 96) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)  # 70 channels: blocks of 32, tiles of 4 and a remainder of 2
    return torch.randn(out, inner, generator=generator), torch.randn(out, generator=generator)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7])
def test_the_product_is_torchs_to_float_noise(rows):
    weight, bias = weights()
    x = torch.randn(rows, weight.shape[1])
    assert torch.allclose(few_rows_linear(x, weight, bias), torch.nn.functional.linear(x, weight, bias), atol=1e-5)


@pytest.mark.parametrize("rows", [2, 3, 4, 7])
def test_each_row_gets_bitwise_what_it_gets_alone(rows):
    weight, bias = weights()
    x = torch.randn(rows, weight.shape[1])
    together = few_rows_linear(x, weight, bias)
    for row in range(rows):
        assert torch.equal(few_rows_linear(x[row : row + 1], weight, bias)[0], together[row]), row


def test_batched_inputs_keep_their_leading_shape_and_odd_sizes_go_to_torch():
    weight, bias = weights()
    x = torch.randn(1, 3, weight.shape[1])
    assert few_rows_linear(x, weight, bias).shape == (1, 3, weight.shape[0])
    odd = torch.randn(2, 10)  # an inner size the kernel's 16-float vectors do not divide
    odd_weight = torch.randn(5, 10)
    assert torch.equal(few_rows_linear(odd, odd_weight, None), torch.nn.functional.linear(odd, odd_weight))
