"""specdecode: lossless speculative decoding for Hugging Face causal language models.

Quick start::

    import specdecode
    gen = specdecode.load("smollm2-135m", drafter="pld")
    result = gen.generate("Summarise: ...", chat=True, max_new_tokens=128)
    print(result.text, result.stats.tokens_per_s)

A model already loaded with transformers::

    gen = specdecode.wrap(model, tokenizer, drafter="pld")

Drafting here, verifying on a server (``specdecode serve``)::

    gen = specdecode.remote("http://127.0.0.1:8000", drafter="pld")
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from specdecode.config import GenerationConfig
from specdecode.errors import SpecDecodeError
from specdecode.models.registry import DEFAULT_MODEL
from specdecode.sampling_params import SamplingParams

if TYPE_CHECKING:
    from specdecode.api import load, wrap
    from specdecode.generator import GenerationResult, SpeculativeGenerator, StreamEvent
    from specdecode.remote_target import remote

#: Names served on first access from the module defining them (PEP 562).  This module runs for every
#: ``import specdecode.X``, the command line's included: importing those modules here would load torch and
#: transformers (seconds) for ``specdecode --help``, ``models`` and ``drafters``.
_LAZY = {
    "load": "specdecode.api",
    "wrap": "specdecode.api",
    "remote": "specdecode.remote_target",
    "GenerationResult": "specdecode.generator",
    "SpeculativeGenerator": "specdecode.generator",
    "StreamEvent": "specdecode.generator",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'specdecode' has no attribute {name!r}")


__all__ = [
    "DEFAULT_MODEL",
    "GenerationConfig",
    "GenerationResult",
    "SamplingParams",
    "SpecDecodeError",
    "SpeculativeGenerator",
    "StreamEvent",
    "load",
    "remote",
    "wrap",
]
