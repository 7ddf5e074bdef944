"""The target's written-out forward (:mod:`specdecode.models.target_step`): bitwise the logits and the cache
the modules give, for every chain length and for a tree, and the modules wherever it does not apply."""

from __future__ import annotations

import pytest
import torch

from helpers import tiny_qwen2
from specdecode.models.base import SequenceInput
from specdecode.models.loading import load_model
from specdecode.models.quantize import quantize_model, quantize_supported
from specdecode.models.target_step import TargetStep
from tiny_models import wrap

pytestmark = pytest.mark.skipif(not quantize_supported("w4a8"), reason="no w4a8 kernel here")

PROMPT = torch.tensor([3, 9, 14, 2, 7, 30, 11, 5, 8, 21, 4, 17])


def modules_logits(backend, tokens: torch.Tensor, cache, rows=None) -> torch.Tensor:
    return backend._run([SequenceInput(tokens, cache, logits_rows=rows)])[0].logits


def assert_chains_match_the_modules_bitwise(backend, monkeypatch) -> None:
    """Chains of 1 to 6 tokens, then a tree, through the step on one cache and the modules on another, in
    turn: the same logits bit for bit, and caches that keep agreeing (the next forward reads what the last
    one wrote)."""
    stepped_calls = []
    step_call = TargetStep.__call__
    monkeypatch.setattr(TargetStep, "__call__", lambda *args: stepped_calls.append(1) or step_call(*args))
    stepped, reference = backend.new_cache(), backend.new_cache()
    for cache in (stepped, reference):
        backend.forward(PROMPT, cache, invariant=False)
    generator = torch.Generator().manual_seed(0)
    for length in (1, 2, 3, 4, 5, 6, 1):
        tokens = torch.randint(1, 90, (length,), generator=generator)
        got = backend.forward(tokens, stepped).logits
        assert torch.equal(got, modules_logits(backend, tokens, reference))
        assert stepped.length == reference.length
    tokens = torch.tensor([5, 6, 7])
    rows = torch.tensor([2])
    got = backend.forward(tokens, stepped, logits_rows=rows).logits
    assert torch.equal(got, modules_logits(backend, tokens, reference, rows))
    # A tree: the last token, two children of it and a grandchild under the first, at their depths' positions.
    past = stepped.length
    tokens, positions = torch.tensor([9, 4, 12, 30]), torch.tensor([past, past + 1, past + 1, past + 2])
    mask = torch.eye(4, dtype=torch.bool)
    mask[:, 0] = True
    mask[3, 1] = True
    got = backend.forward(tokens, stepped, positions=positions, tree_mask=mask).logits
    reference_out = backend._run([SequenceInput(tokens, reference, positions=positions, tree_mask=mask)])[0]
    assert torch.equal(got, reference_out.logits)
    for cache in (stepped, reference):
        cache.keep(past, [0, 1, 3])  # the path through the first child, as verification keeps it
    got = backend.forward(torch.tensor([6]), stepped).logits
    assert torch.equal(got, modules_logits(backend, torch.tensor([6]), reference))
    assert len(stepped_calls) == 10  # every invariant chain and tree went through the step


def test_a_w4a8_llama_verifies_through_the_written_out_step(tiny_dirs, monkeypatch):
    backend = load_model(str(tiny_dirs["target"]), quantize="w4a8").backend
    assert_chains_match_the_modules_bitwise(backend, monkeypatch)
    assert isinstance(backend._target_step, TargetStep)


def test_a_w4a8_qwen2_with_biases_verifies_through_the_written_out_step(monkeypatch):
    torch.manual_seed(0)
    model = tiny_qwen2()
    for name, parameter in model.named_parameters():  # transformers starts biases at zero: make them count
        if name.endswith("bias"):
            torch.nn.init.normal_(parameter, std=0.5)
    quantize_model(model, "w4a8")
    backend = wrap(model.eval(), tokenizer=None).backend
    assert_chains_match_the_modules_bitwise(backend, monkeypatch)
    assert isinstance(backend._target_step, TargetStep)


@pytest.mark.parametrize("mode", ["none", "int4"])
def test_other_precisions_keep_their_modules(tiny_dirs, mode):
    """Fused int4 calls are checked on one row only, and fp32 layers are not row invariant: no step."""
    backend = load_model(str(tiny_dirs["target"]), quantize=mode).backend
    assert backend._target_step is None
