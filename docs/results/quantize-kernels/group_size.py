"""int4 group size: how far ``qwen2.5-coder-1.5b``'s int4 logits move from fp32's at group 64 (ours) and 128.

Teacher-forced over the chat-templated first prompt of four bench tasks; prints the mean KL(fp32 || int4) per
position and the share of positions whose top token agrees (``group-size.md`` holds one run's output).
``../avx2/w4a8_quality.py`` measures int4 against w4a8 with the same two functions."""

from __future__ import annotations

import torch

from specdecode.data.tasks import load_task
from specdecode.generator import SpeculativeGenerator
from specdecode.models import quantize
from specdecode.models.loading import LoadedModel, load_model

MODEL = "qwen2.5-coder-1.5b"
TASKS = ("mt-bench", "humaneval", "sharegpt", "edit")


def log_probs(model: LoadedModel, ids: torch.Tensor, invariant: bool) -> torch.Tensor:
    cache = model.backend.new_cache()
    out = model.backend.forward(ids, cache, invariant=invariant).logits
    cache.release()
    return out.float().log_softmax(-1)


def fp32_reference(*, invariant: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The four prompts' token ids and the fp32 model's log-probabilities at every position."""
    reference = load_model(MODEL)
    generator = SpeculativeGenerator.build(reference, "none")
    prompts = [torch.tensor(generator.encode_prompt(load_task(t, 1, 0).prompts[0].text, chat=True)) for t in TASKS]
    return prompts, [log_probs(reference, ids, invariant) for ids in prompts]


def divergence(model: LoadedModel, prompts, exact, *, invariant: bool) -> tuple[float, float]:
    """Mean KL(fp32 || model) per position and top-1 agreement with fp32 over the prompts.  ``invariant``:
    every row through the quantized kernels (else prompts take the bf16 block copies)."""
    kl = agree = positions = 0.0
    for ids, ref in zip(prompts, exact):
        approx = log_probs(model, ids, invariant)
        kl += (ref.exp() * (ref - approx)).sum().item()
        agree += (ref.argmax(-1) == approx.argmax(-1)).sum().item()
        positions += len(ids)
    return kl / positions, agree / positions


def main() -> None:
    prompts, exact = fp32_reference(invariant=False)
    for groups in ((64, 32), (128, 64, 32)):
        quantize.INT4_GROUP_SIZES = groups
        kl, agreement = divergence(load_model(MODEL, quantize="int4"), prompts, exact, invariant=False)
        print(f"group {groups[0]}: mean KL {kl:.4f}, top-1 agreement {agreement:.3f}", flush=True)


if __name__ == "__main__":
    main()
