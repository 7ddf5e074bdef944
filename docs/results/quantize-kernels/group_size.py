"""int4 group size: how far ``qwen2.5-coder-1.5b``'s int4 logits move from fp32's at group 64 (ours) and 128.

Teacher-forced over the chat-templated first prompt of four bench tasks; prints the mean KL(fp32 || int4) per
position and the share of positions whose top token agrees (``group-size.md`` holds one run's output)."""

from __future__ import annotations

import torch

from specdecode.bench.tasks import load_task
from specdecode.generator import SpeculativeGenerator
from specdecode.models import quantize
from specdecode.models.loading import LoadedModel, load_model

MODEL = "qwen2.5-coder-1.5b"
TASKS = ("mt-bench", "humaneval", "sharegpt", "edit")


def log_probs(model: LoadedModel, ids: torch.Tensor) -> torch.Tensor:
    cache = model.backend.new_cache()
    out = model.backend.forward(ids, cache, invariant=False).logits
    cache.release()
    return out.float().log_softmax(-1)


def main() -> None:
    reference = load_model(MODEL)
    generator = SpeculativeGenerator.build(reference, "none")
    prompts = [torch.tensor(generator.encode_prompt(load_task(t, 1, 0).prompts[0].text, chat=True)) for t in TASKS]
    exact = [log_probs(reference, ids) for ids in prompts]
    del reference, generator
    for groups in ((64, 32), (128, 64, 32)):
        quantize.INT4_GROUP_SIZES = groups
        model = load_model(MODEL, quantize="int4")
        kl = agree = positions = 0.0
        for ids, ref in zip(prompts, exact):
            approx = log_probs(model, ids)
            kl += (ref.exp() * (ref - approx)).sum().item()
            agree += (ref.argmax(-1) == approx.argmax(-1)).sum().item()
            positions += len(ids)
        print(f"group {groups[0]}: mean KL {kl / positions:.4f}, top-1 agreement {agree / positions:.3f}", flush=True)
        del model


if __name__ == "__main__":
    main()
