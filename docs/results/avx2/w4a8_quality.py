"""How far ``qwen2.5-coder-1.5b``'s int4 and w4a8 logits move from fp32's.

Teacher-forced over the chat-templated first prompt of four bench tasks, every position through the
quantized kernels (``invariant=True``: no bf16 block copies); prints the mean KL(fp32 || quantized) per
position and the share of positions whose top token agrees with fp32's.  The same measure, and the same
functions, as ``../quantize-kernels/group_size.py``."""

from __future__ import annotations

import sys
from pathlib import Path

from specdecode.models.loading import load_model

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "quantize-kernels"))
from group_size import MODEL, divergence, fp32_reference  # noqa: E402


def main() -> None:
    prompts, exact = fp32_reference(invariant=True)
    for mode in ("int4", "w4a8"):
        kl, agreement = divergence(load_model(MODEL, quantize=mode), prompts, exact, invariant=True)
        print(f"{mode}: mean KL {kl:.4f}, top-1 agreement {agreement:.3f}", flush=True)


if __name__ == "__main__":
    main()
