"""The Python API's entry points: a model loaded with a drafter (``specdecode.load``), or a transformers model already
loaded (``specdecode.wrap``), as a generator."""

from __future__ import annotations

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdecode.config import DEFAULT_NUM_DRAFT_TOKENS, GenerationConfig
from specdecode.drafters import check_drafter_options
from specdecode.generator import SpeculativeGenerator
from specdecode.models.loading import from_transformers, load_model
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
    weights, as ``--quantize`` (``none``, ``int8``, ``int4``, ``w4a8``, ``bf16``, or ``auto``: the fastest of them on
    this CPU, timed once per machine and model, printed on stderr and kept in ``generator.target.quantize``; a draft
    model is quantized by default, see ``--quantize-draft``).
    """
    # An unknown drafter, an option it does not take or an unknown precision fails before the (slow) model load,
    # as in the CLI.
    check_drafter_options(drafter, **drafter_options)
    quantize = check_quantize(quantize, "quantize")
    defaults = GenerationConfig(max_new_tokens=max_new_tokens, num_draft_tokens=num_draft_tokens, verifier=verifier)
    target = load_model(model, fast_path=fast_path, device=device, quantize=quantize)
    return SpeculativeGenerator.build(target, drafter, defaults, **drafter_options)


def wrap(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    drafter: str = "pld",
    *,
    name: str | None = None,
    num_draft_tokens: int | str = DEFAULT_NUM_DRAFT_TOKENS,
    max_new_tokens: int = 128,
    verifier: str = "exact",
    fast_path: bool = False,
    **drafter_options,
) -> SpeculativeGenerator:
    """A speculative generator over a transformers causal LM and tokenizer you have already loaded.

    Greedy output is token for token the model's own greedy output (``model.generate(..., do_sample=False)``), on
    whatever device and in whatever precision the model is.  ``fast_path=True`` (fp32 on a CPU) prepacks the model's
    linear layers in place for cheap multi-token verification: faster, but it changes rounding in the last bits,
    so the text is then that of plain decoding through the packed model.  ``name`` labels stats and caches
    (default: the model's ``name_or_path``).  The other arguments are :func:`load`'s.
    """
    check_drafter_options(drafter, **drafter_options)
    defaults = GenerationConfig(max_new_tokens=max_new_tokens, num_draft_tokens=num_draft_tokens, verifier=verifier)
    label = name or getattr(getattr(model, "config", None), "name_or_path", "") or type(model).__name__
    target = from_transformers(model, tokenizer, label, fast_path=fast_path)
    return SpeculativeGenerator.build(target, drafter, defaults, **drafter_options)
