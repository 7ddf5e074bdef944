"""How far ``qwen2.5-coder-1.5b``'s int4 and w4a8 logits move from fp32's.

Teacher-forced over the chat-templated first prompt of four bench tasks, every position through the
quantized kernels (``invariant=True``: no bf16 block copies); prints the mean KL(fp32 || quantized) per
position and the share of positions whose top token agrees with fp32's.  The same measure as
``../quantize-kernels/group_size.py``."""

from __future__ import annotations

import torch

from specdecode.bench.tasks import load_task
from specdecode.generator import SpeculativeGenerator
from specdecode.models.loading import LoadedModel, load_model

MODEL = "qwen2.5-coder-1.5b"
TASKS = ("mt-bench", "humaneval", "sharegpt", "edit")


def log_probs(model: LoadedModel, ids: torch.Tensor) -> torch.Tensor:
    cache = model.backend.new_cache()
    out = model.backend.forward(ids, cache).logits
    cache.release()
    return out.float().log_softmax(-1)


def main() -> None:
    reference = load_model(MODEL)
    generator = SpeculativeGenerator.build(reference, "none")
    prompts = [torch.tensor(generator.encode_prompt(load_task(t, 1, 0).prompts[0].text, chat=True)) for t in TASKS]
    exact = [log_probs(reference, ids) for ids in prompts]
    del reference, generator
    for mode in ("int4", "w4a8"):
        model = load_model(MODEL, quantize=mode)
        kl = agree = positions = 0.0
        for ids, ref in zip(prompts, exact):
            approx = log_probs(model, ids)
            kl += (ref.exp() * (ref - approx)).sum().item()
            agree += (ref.argmax(-1) == approx.argmax(-1)).sum().item()
            positions += len(ids)
        print(f"{mode}: mean KL {kl / positions:.4f}, top-1 agreement {agree / positions:.3f}", flush=True)
        del model


if __name__ == "__main__":
    main()
