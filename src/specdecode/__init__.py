"""specdecode: lossless speculative decoding for Hugging Face causal language models.

Quick start::

    import specdecode
    gen = specdecode.load("smollm2-135m", drafter="pld")
    result = gen.generate("Summarise: ...", chat=True, max_new_tokens=128)
    print(result.text, result.stats.tokens_per_s)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from specdecode.config import DEFAULT_NUM_DRAFT_TOKENS, GenerationConfig, SamplingParams
from specdecode.errors import SpecDecodeError

if TYPE_CHECKING:
    from specdecode.generator import GenerationResult, SpeculativeGenerator, StreamEvent

DEFAULT_MODEL = "smollm2-135m"

#: Names served from ``specdecode.generator`` on first access: importing it loads torch and transformers
#: (seconds), which ``specdecode --help``, ``models`` and ``drafters`` must not pay for.
_LAZY = frozenset({"GenerationResult", "SpeculativeGenerator", "StreamEvent"})


def __getattr__(name: str) -> object:
    if name in _LAZY:
        from specdecode import generator

        return getattr(generator, name)
    raise AttributeError(f"module 'specdecode' has no attribute {name!r}")


def load(
    model: str = DEFAULT_MODEL,
    drafter: str = "pld",
    *,
    num_draft_tokens: int | str = DEFAULT_NUM_DRAFT_TOKENS,
    max_new_tokens: int = 128,
    fast_path: bool | None = None,
    device: str | None = None,
    verifier: str = "exact",
    quantize: str = "none",
    **drafter_options,
) -> SpeculativeGenerator:
    """Load ``model`` (registry short name, local directory, .gguf file or hub id) with a drafter.

    ``drafter_options`` go to the drafter, e.g. ``draft_model="qwen2.5-coder-0.5b"`` for
    ``drafter="draft-model"`` or ``max_ngram=4`` for ``drafter="pld"``.  ``fast_path`` (default on
    where supported) prepacks linear layers for fast multi-token verification on CPUs; ``device``: ``cpu``
    (default), ``cuda`` or ``cuda:N``.  ``generate_batch`` on the result decodes many prompts together.
    ``verifier``: ``exact`` (lossless, the default) or a relaxed, LOSSY one (``fly``, ``typical``, ``judge``: see
    ``specdecode verifiers``); ``generate(..., verifier=...)`` chooses per call.  ``quantize``: the target's
    weights, as ``--quantize`` (``none``, ``int8``, ``int4``, ``w4a8``, ``bf16``; a draft model is quantized by
    default, see ``--quantize-draft``).
    """
    from specdecode.drafters import check_drafter_options
    from specdecode.generator import SpeculativeGenerator
    from specdecode.models.loading import load_model
    from specdecode.models.quantize import check_quantize

    # An unknown drafter, an option it does not take or an unknown precision fails before the (slow) model load,
    # as in the CLI.
    check_drafter_options(drafter, **drafter_options)
    quantize = check_quantize(quantize, "quantize")
    defaults = GenerationConfig(max_new_tokens=max_new_tokens, num_draft_tokens=num_draft_tokens, verifier=verifier)
    target = load_model(model, fast_path=fast_path, device=device, quantize=quantize)
    return SpeculativeGenerator.build(target, drafter, defaults, **drafter_options)


__all__ = [
    "DEFAULT_MODEL",
    "GenerationConfig",
    "GenerationResult",
    "SamplingParams",
    "SpecDecodeError",
    "SpeculativeGenerator",
    "StreamEvent",
    "load",
]
