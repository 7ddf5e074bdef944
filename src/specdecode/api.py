"""The Python API's entry point: a model loaded with a drafter, as a generator (``specdecode.load``)."""

from __future__ import annotations

from specdecode.config import DEFAULT_NUM_DRAFT_TOKENS, GenerationConfig
from specdecode.drafters import check_drafter_options
from specdecode.generator import SpeculativeGenerator
from specdecode.models.loading import load_model
from specdecode.models.quantize import check_quantize
from specdecode.models.registry import DEFAULT_MODEL


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
    # An unknown drafter, an option it does not take or an unknown precision fails before the (slow) model load,
    # as in the CLI.
    check_drafter_options(drafter, **drafter_options)
    quantize = check_quantize(quantize, "quantize")
    defaults = GenerationConfig(max_new_tokens=max_new_tokens, num_draft_tokens=num_draft_tokens, verifier=verifier)
    target = load_model(model, fast_path=fast_path, device=device, quantize=quantize)
    return SpeculativeGenerator.build(target, drafter, defaults, **drafter_options)
