"""The greedy head's choices (``kernels/greedy_head.cpp``) must be bitwise the fp32 LM head's argmax, ties and
near-ties included; a control without the bound's recomputation shows those cases are there to fail; a greedy
request reads them and a request that reads anything more of the logits does not."""

from __future__ import annotations

import pytest
import torch

from helpers import run, tiny_qwen2
from specdecode.drafters import create_drafter
from specdecode.engine import TargetVerifier
from specdecode.models import hf
from specdecode.models.cpu_kernels import PANEL, pack_panels, panel_linear
from specdecode.models.fastpath import apply_cpu_fast_path
from specdecode.models.greedy_head import GreedyHead, greedy_head_supported
from specdecode.models.hf import HFCausalLM
from specdecode.models.loading import LoadedModel
from specdecode.sampling import argmax_last
from specdecode.sampling_params import SamplingParams
from tiny_models import tiny_llama, tiny_tokenizer, tiny_words, wrap

pytestmark = pytest.mark.skipif(
    not greedy_head_supported(), reason="the greedy head needs AVX512_BF16 and our CPU kernels (not here)"
)


def full_choices(x: torch.Tensor, panels: torch.Tensor) -> list[int]:
    return argmax_last(panel_linear(x, panels, None))


def near_ties(vocab: int, inner: int, rows: int, gap: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A head whose largest logits for each row are within ``gap`` of each other in fp32, far closer than bf16 can
    tell apart (each such token's weight row adds noise orthogonal to the row, which bf16 rounds differently), with
    an exact tie (a repeated weight row) among them."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, inner, generator=generator) * 0.05
    x = torch.randn(rows, inner, generator=generator) * 3
    for row in range(rows):
        base = row * 8
        direction = x[row] / x[row].norm() ** 2
        for offset in range(4):  # four tokens whose logits are 40 + offset * gap, in shuffled order
            noise = torch.randn(inner, generator=generator) * 0.05
            noise -= (noise @ x[row]) * direction
            weight[base + (offset * 3) % 4] = direction * (40 + offset * gap) + noise
        weight[base + 5] = weight[base + 1]  # an exact tie with the largest (offset 3), at a later index
    return weight, x


@pytest.mark.parametrize("inner", [64, 576])
@pytest.mark.parametrize("vocab", [16, 48, 2000 // PANEL * PANEL])
def test_choices_are_the_full_products_argmax_for_random_heads(vocab, inner):
    generator = torch.Generator().manual_seed(vocab + inner)
    panels = pack_panels(torch.randn(vocab, inner, generator=generator) * 0.1)
    head = GreedyHead(panels)
    for rows in (1, 3, 8, 9, 19):
        for scale in (1e-3, 1.0, 40.0):
            x = torch.randn(rows, inner, generator=generator) * scale
            assert head(x).tolist() == full_choices(x, panels)


def test_choices_break_near_ties_and_ties_as_the_fp32_logits_do():
    weight, x = near_ties(vocab=1024, inner=576, rows=24, gap=1e-5, seed=1)
    panels = pack_panels(weight)
    assert GreedyHead(panels)(x).tolist() == full_choices(x, panels)


def test_without_the_bound_bf16_alone_would_choose_differently():
    """The control: the same kernel with its bound zeroed (only the bf16 maximum recomputed) misses the fp32 choice
    on some of these rows, so the test above can fail."""
    weight, x = near_ties(vocab=1024, inner=576, rows=24, gap=1e-5, seed=1)
    panels = pack_panels(weight)
    broken = GreedyHead(panels)
    broken.scale = 0.0
    assert broken(x).tolist() != full_choices(x, panels)


def test_non_finite_rows_take_the_full_product():
    generator = torch.Generator().manual_seed(3)
    panels = pack_panels(torch.randn(64, 32, generator=generator))
    x = torch.randn(4, 32, generator=generator)
    x[1, 3], x[2, 0] = float("inf"), float("nan")
    assert GreedyHead(panels)(x).tolist() == full_choices(x, panels)


def tiny_fast(kind: str = "llama") -> LoadedModel:
    """A tiny Llama or Qwen2 on the CPU fast path (its head a panel product: what the greedy head screens)."""
    model = tiny_llama(seed=0) if kind == "llama" else tiny_qwen2()
    apply_cpu_fast_path(model)
    return wrap(model, tiny_tokenizer(tiny_words()), name=f"tiny-fast-{kind}")


class Recorder:
    """For each verification forward: whether its sequence asked for choices only, and whether it got them (not the
    forwards that time the cost curve, which ask for choices too)."""

    def __init__(self, backend: HFCausalLM, monkeypatch) -> None:
        self.asked: list[bool] = []
        self.returned: list[bool] = []
        self.verifying = False
        forward, verify = backend.forward_batch, TargetVerifier.__call__

        def forward_batch(inputs):
            outputs = forward(inputs)
            if self.verifying:
                self.asked.append(inputs[0].choices_only)
                self.returned.append(outputs[0].choices is not None)
            return outputs

        def verifying(verifier, *args):
            self.verifying = True
            try:
                return verify(verifier, *args)
            finally:
                self.verifying = False

        backend.forward_batch = forward_batch
        monkeypatch.setattr(TargetVerifier, "__call__", verifying)


PROMPT = [5, 9, 17, 5, 9, 17, 40, 41, 42, 5, 9]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("drafter", ["none", "pld"])
def test_greedy_decoding_reads_choices_and_gives_the_logits_output(drafter, kind, monkeypatch):
    target = tiny_fast(kind)
    recorder = Recorder(target.backend, monkeypatch)
    chosen, _ = run(target, create_drafter(drafter, target), PROMPT, max_new_tokens=40, num_draft_tokens=3)
    assert recorder.asked and all(recorder.asked) and all(recorder.returned)
    monkeypatch.setattr(hf.HFCausalLM, "_greedy_head", lambda self: None)
    assert run(target, create_drafter(drafter, target), PROMPT, max_new_tokens=40, num_draft_tokens=3)[0] == chosen


@pytest.mark.parametrize(
    "drafter, settings",
    [
        ("none", {"logprobs": 2}),
        ("none", {"sampling": SamplingParams(repetition_penalty=1.3)}),
        ("none", {"sampling": SamplingParams(temperature=0.7, seed=1)}),
        ("recycling", {}),
    ],
)
def test_requests_reading_more_than_the_choices_get_the_logits(drafter, settings, monkeypatch):
    target = tiny_fast()
    recorder = Recorder(target.backend, monkeypatch)
    run(target, create_drafter(drafter, target), PROMPT, max_new_tokens=12, num_draft_tokens=3, **settings)
    assert recorder.asked and not any(recorder.asked) and not any(recorder.returned)
