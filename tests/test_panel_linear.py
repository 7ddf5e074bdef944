"""The CPU fast path's fp32 product (``kernels/panel_linear.cpp``): torch's result to float noise for every row count
a tile takes, and each row bitwise what it gets alone, at every width; the packing undone bitwise."""

from __future__ import annotations

import pytest
import torch

from specdecode.models.cpu_kernels import cpu_kernels_built, pack_panels, panel_linear, unpack_panels

pytestmark = pytest.mark.skipif(not cpu_kernels_built(), reason="the CPU kernels are not built here")


def weights(out: int = 80, inner: int = 90) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)  # 80 channels: 5 panels, two pairs and an odd one
    return torch.randn(out, inner, generator=generator), torch.randn(out, generator=generator)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 12, 13, 17, 25, 40])
def test_the_product_is_torchs_to_float_noise(rows):
    weight, bias = weights()
    x = torch.randn(rows, weight.shape[1])
    got = panel_linear(x, pack_panels(weight), bias)
    assert torch.allclose(got, torch.nn.functional.linear(x, weight, bias), atol=1e-4)


@pytest.mark.parametrize("rows", [2, 3, 8, 11, 12, 13, 25, 40])
def test_each_row_gets_bitwise_what_it_gets_alone(rows):
    weight, bias = weights()
    panels = pack_panels(weight)
    x = torch.randn(rows, weight.shape[1])
    together = panel_linear(x, panels, bias)
    for row in range(rows):
        assert torch.equal(panel_linear(x[row : row + 1], panels, bias)[0], together[row]), row


def test_a_control_that_sums_in_another_order_is_not_bitwise():
    """The bitwise test above can fail: torch's product of one row differs in the last bits from the same row
    among 40 (MKL blocks the sum by width)."""
    weight, _ = weights(out=512, inner=1536)
    x = torch.randn(40, weight.shape[1])
    together = torch.nn.functional.linear(x, weight)
    alone = torch.cat([torch.nn.functional.linear(x[row : row + 1], weight) for row in range(40)])
    assert not torch.equal(alone, together)
    panels = pack_panels(weight)
    assert torch.equal(
        torch.cat([panel_linear(x[row : row + 1], panels, None) for row in range(40)]), panel_linear(x, panels, None)
    )


def test_leading_shape_kept_and_packing_undone_bitwise():
    weight, bias = weights()
    panels = pack_panels(weight)
    assert panels.shape == (5, weight.shape[1], 16)
    assert torch.equal(unpack_panels(panels), weight)
    x = torch.randn(1, 3, weight.shape[1])
    assert panel_linear(x, panels, bias).shape == (1, 3, weight.shape[0])
