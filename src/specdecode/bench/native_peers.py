"""The CPU engines a user would pick instead of ours: llama.cpp (through ``llama-cpp-python``) on the very
GGUF our checkpoint was de-quantized from, and OpenVINO GenAI on int8 / int4 exports made by its own
tooling (``optimum-cli export openvino``).  Both are optional extras, skipped with a message when absent: they
are imported where a run needs them, never with this module.

Each runs the benchmark's contract: prompt token ids in, exactly ``max_new_tokens`` greedy token ids out
(EOS ignored), the generation call timed, prefill included — as our generator is timed (building an
OpenVINO pipeline is not: see :func:`openvino_run`).  Neither reports
acceptance counts.  Facts that shape this module:

* ``Llama.generate`` keeps the longest common prefix of its KV cache between calls; ``reset()`` before
  every run makes each one pay its prefill, as ours does.  With ``temp=0`` it samples greedily; it never
  stops at EOS by itself (``create_completion`` does), so taking ``max_new_tokens`` tokens ignores EOS.
* ``llama-cpp-python``'s speculative hook is ``draft_model=``: prompt lookup ships
  (``LlamaPromptLookupDecoding``); a draft *model* is our :class:`_LlamaDraft`, a second ``Llama`` that
  greedily continues the context (its own prefix cache makes that incremental) — the binding has no
  other way to run llama.cpp's draft-model speculation.
* OpenVINO GenAI takes token ids (``TokenizedInputs``) and needs no tokenizer for plain decoding and
  prompt lookup; its draft-model pipeline encodes through ``openvino_tokenizer.xml``, which the export
  writes (converted with ``openvino_tokenizers`` where optimum-cli did not).
"""

from __future__ import annotations

import gc
import importlib.util
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from transformers import AutoTokenizer

from specdecode.errors import SpecDecodeError
from specdecode.models.cache import model_cache_dir
from specdecode.models.registry import ensure_gguf, ensure_model, is_registered

_LLAMACPP_HINT = "pip install -e '.[llamacpp]' (compiles llama.cpp, about 13 min on 2 cores)"
#: llama.cpp's AMX backend (built when the compiling CPU has AMX) crashes in decode (ggml-org/llama.cpp#20824):
#: build without it.
_NO_AMX_HINT = (
    "reinstall llama.cpp without its AMX backend, which segfaults here (ggml-org/llama.cpp#20824): "
    'CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON '
    '-DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON" pip install --force-reinstall --no-deps --no-cache-dir '
    "llama-cpp-python==0.3.36"
)
# optimum-intel requires torchvision, whose PyPI wheels pull a CUDA torch: it is installed without its
# dependencies, beside the extra that brings the ones it needs.
_OPENVINO_HINT = "pip install -e '.[openvino]' && pip install --no-deps optimum-intel==2.2.0 optimum==2.3.0"
#: The native peer families ``bench --peers`` accepts → (module, install hint) pairs each needs.
NATIVE_FAMILIES: dict[str, tuple[tuple[str, str], ...]] = {
    "llamacpp": (("llama_cpp", _LLAMACPP_HINT),),
    **{
        f"openvino-{weights}": (
            ("openvino_genai", _OPENVINO_HINT),
            ("openvino_tokenizers", _OPENVINO_HINT),
            ("optimum.intel", _OPENVINO_HINT),
        )
        for weights in ("int8", "int4")
    },
}
#: llama.cpp's context: prompt + generated tokens + a draft must fit.
LLAMA_CONTEXT = 4096

Run = Callable[[list[int], int], tuple[list[int], float]]  # (prompt ids, max new) → (generated ids, seconds)


def unavailable(family: str, model: str) -> str | None:
    """Why ``family`` cannot run ``model`` on this machine, or None when it can.  An unregistered model
    comes first: installing the peer would not help it."""
    if not is_registered(model):
        return f"it runs registered models only (their GGUF and checkpoint), not {model!r}"
    for module, hint in NATIVE_FAMILIES[family]:
        if not _importable(module):
            return f"{module} is not installed; {hint}"
    if family == "llamacpp" and _llamacpp_uses_amx():
        return f"its llama.cpp build runs the AMX backend; {_NO_AMX_HINT}"
    return None


def _llamacpp_uses_amx() -> bool:
    """Whether the installed llama.cpp was built with its AMX backend (a crash, not an error, would follow)."""
    import llama_cpp

    return "AMX_INT8 = 1" in llama_cpp.llama_print_system_info().decode(errors="replace")


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # the parent package of a dotted name is missing
        return False


# --------------------------------------------------------------------------------------------------------
# llama.cpp


def llamacpp_run(model: str, threads: int, draft: str | None = None, lookup: dict[str, int] | None = None) -> Run:
    """Plain decoding of ``model``'s GGUF, or with prompt lookup (``lookup``: ``max_ngram_size``,
    ``num_pred_tokens``) or a draft model's GGUF (``draft``, drafting ``lookup["num_pred_tokens"]``)."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    drafter = None
    if draft is not None:
        drafter = _LlamaDraft(_llama(draft, threads), (lookup or {}).get("num_pred_tokens", 5))
    elif lookup is not None:
        drafter = LlamaPromptLookupDecoding(**lookup)
    # With a draft model llama-cpp-python keeps logits for every token but sizes their array by ``logits_all``
    # (one batch of rows unless it is set): a prompt longer than a batch (512 tokens) then fails to evaluate.
    options = {"draft_model": drafter, "logits_all": True} if drafter is not None else {}
    llm: Llama = _llama(model, threads, **options)

    def run(prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], float]:
        start = time.perf_counter()
        llm.reset()
        if isinstance(drafter, _LlamaDraft):
            drafter.llm.reset()
        generated = []
        for token in llm.generate(prompt_ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            generated.append(token)
            if len(generated) == max_new_tokens:
                break
        return generated, time.perf_counter() - start

    return run


def _llama(model: str, threads: int, **options: Any):
    from llama_cpp import Llama

    return Llama(
        model_path=str(ensure_gguf(model)),
        n_ctx=LLAMA_CONTEXT,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
        **options,
    )


class _LlamaDraft:
    """A draft model for ``llama-cpp-python``'s speculative hook: the draft GGUF continues the context
    greedily for ``k`` tokens.  Its ``Llama.generate`` reuses the longest cached prefix, so each call
    evaluates only the tokens the target accepted since the last one."""

    def __init__(self, llm, k: int) -> None:
        self.llm, self.k = llm, k

    def __call__(self, input_ids, /, **kwargs: Any):
        drafted = []
        # reset=True (the default) is what keeps the longest cached prefix; reset=False would append the
        # whole context to the cache again.
        for token in self.llm.generate(input_ids.tolist(), top_k=1, top_p=1.0, min_p=0.0, temp=0.0):
            drafted.append(token)
            if len(drafted) == self.k:
                break
        return np.array(drafted, dtype=np.intc)


# --------------------------------------------------------------------------------------------------------
# OpenVINO GenAI


def openvino_run(
    model: str,
    weights: str,
    threads: int,
    draft: str | None = None,
    lookup: dict[str, int] | None = None,
) -> Run:
    """OpenVINO GenAI's ``LLMPipeline`` on ``model`` exported with ``weights`` (int8 / int4): plain, with
    prompt lookup (``lookup``: ``max_ngram_size``, ``num_assistant_tokens``) or with ``draft``'s export
    drafting ``lookup["num_assistant_tokens"]`` tokens.

    Every pipeline compiles its own copy of the weights, so only one is alive at a time
    (:data:`_PIPELINE`): a run builds its pipeline when another one ran last — from OpenVINO's cache of
    compiled models, warmed up with a two-token call, all untimed — and times only ``generate``."""
    import openvino as ov
    import openvino_genai as genai

    key = (model, weights, threads, draft, lookup is not None)

    def build():
        source = openvino_export(model, weights)
        properties = {"INFERENCE_NUM_THREADS": threads, "CACHE_DIR": str(source / "compiled")}
        options: dict[str, Any] = {}
        if draft is not None:
            options["draft_model"] = genai.draft_model(str(openvino_export(draft, weights)), "CPU", **properties)
        elif lookup is not None:
            options["prompt_lookup"] = True
        pipeline = genai.LLMPipeline(str(source), "CPU", **options, **properties)
        # A new pipeline's first call allocates: not decoding, so not timed.
        pipeline.generate(inputs_of([0, 1, 2, 3]), config(2))
        return pipeline

    def config(max_new_tokens: int):
        settings = genai.GenerationConfig()
        settings.max_new_tokens = max_new_tokens
        settings.ignore_eos = True
        for option, value in (lookup or {}).items():
            setattr(settings, option, value)
        return settings

    def inputs_of(prompt_ids: list[int]):
        ids = np.array([prompt_ids], dtype=np.int64)
        return genai.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids)))

    def run(prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], float]:
        pipeline = _PIPELINE.get(key, build)
        inputs, settings = inputs_of(prompt_ids), config(max_new_tokens)
        start = time.perf_counter()
        tokens = list(pipeline.generate(inputs, settings).tokens[0])
        return tokens, time.perf_counter() - start

    return run


class _OneAlive:
    """Holds one object, built on demand: asking for another key drops the held one first (so two large
    pipelines never coexist)."""

    def __init__(self) -> None:
        self.key: Any = None
        self.value: Any = None

    def get(self, key: Any, build: Callable[[], Any]) -> Any:
        if self.key != key:
            self.key, self.value = None, None
            gc.collect()
            self.value, self.key = build(), key
        return self.value


_PIPELINE = _OneAlive()


def openvino_export(model: str, weights: str) -> Path:
    """``model``'s checkpoint exported by OpenVINO's own tooling with ``weights`` compression, cached next to
    the checkpoint (``openvino-<weights>/``); exported on first use (a minute for 135M, several for 1.5B)."""
    out = model_cache_dir(model) / f"openvino-{weights}"
    if (out / "openvino_tokenizer.xml").is_file():
        return out
    source = ensure_model(model)
    partial = out.with_name(f".tmp-openvino-{weights}")
    command = [
        *(sys.executable, "-m", "optimum.commands.optimum_cli", "export", "openvino"),
        *("--model", str(source), "--task", "text-generation-with-past", "--weight-format", weights, str(partial)),
    ]
    print(f"[bench] exporting {model} to OpenVINO ({weights}) with optimum-cli", file=sys.stderr)
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise SpecDecodeError(f"optimum-cli could not export {model} to OpenVINO ({weights}): {tail[0]}")
    if not (partial / "openvino_tokenizer.xml").is_file():
        _convert_tokenizer(source, partial)
    partial.rename(out)
    return out


def _convert_tokenizer(source: Path, out: Path) -> None:
    """The tokenizer (and, where it converts, the detokenizer) as OpenVINO models: GenAI's draft-model
    pipeline encodes through it even when given token ids."""
    import openvino as ov
    from openvino_tokenizers import convert_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(source)
    ov.save_model(convert_tokenizer(tokenizer, with_detokenizer=False), out / "openvino_tokenizer.xml")
    try:
        _, detokenizer = convert_tokenizer(tokenizer, with_detokenizer=True)
    except RuntimeError:  # some tokenizers' decoders do not convert; token ids need none
        return
    ov.save_model(detokenizer, out / "openvino_detokenizer.xml")
