"""The long-context task (``longctx-N``): prompts built deterministically from text no other task and no training
draws, cut to the requested tokens and to the model's window; lossless decoding over thousands of tokens; the
verification cost curve measured, cached and reported per context length."""

from __future__ import annotations

import json
import re

import pytest
import torch
from tokenizers import pre_tokenizers

from helpers import DRAWS, BigramFeatures, V, assert_head_drafter_samples_exactly, hf_greedy, random_eagle_head, run
from specdecode.batch_engine import BatchEngine, BatchRequest
from specdecode.bench import report, runner
from specdecode.bench.cells import build_cells
from specdecode.bench.common import PromptEncoder, check_known_tasks
from specdecode.bench.forward_cost import print_forward_cost
from specdecode.bench.suites import SUITES, resolve_settings
from specdecode.config import GenerationConfig
from specdecode.data import grounded
from specdecode.data.long_context import (
    ASKED_WITHIN_CHARS,
    DEFAULT_CONTEXT_TOKENS,
    MIN_CONTEXT_TOKENS,
    context_tokens_of,
    expand,
    fit_prompt,
)
from specdecode.data.prompts import Prompt
from specdecode.data.tasks import TASK_NAMES, known_task, load_task, load_tasks
from specdecode.draft_length.factory import make_policy
from specdecode.drafters import create_drafter
from specdecode.drafters.eagle import DEFAULT_WINDOW, EagleDrafter
from specdecode.errors import SpecDecodeError
from specdecode.heads.eagle import HeadCache
from specdecode.models.hf import HFCausalLM
from specdecode.models.loading import LoadedModel
from specdecode.train.cli import DEFAULT_TASKS
from tiny_models import save_tiny, tiny_llama, tiny_tokenizer, tiny_words, wrap


def word_and_punctuation_tokenizer():
    """The tiny models' tokenizer splitting punctuation from words too: about as many tokens as a BPE's on code and
    prose (every one of them unknown to its vocabulary), so prompts are cut as for a real model."""
    tokenizer = tiny_tokenizer(tiny_words())
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return tokenizer


# --------------------------------------------------------------------------------------------------------
# The prompts


def test_prompts_are_deterministic_balanced_and_ask_about_what_any_cut_keeps():
    task = load_task("longctx-4096", 8, seed=0)
    again = load_task("longctx-4096", 8, seed=0)
    assert [(p.id, p.text) for p in task.prompts] == [(p.id, p.text) for p in again.prompts]
    assert [p.id for p in load_task("longctx-4096", 3, seed=0).prompts] == [p.id for p in task.prompts[:3]]
    assert [p.id for p in load_task("longctx-4096", 8, seed=1).prompts] != [p.id for p in task.prompts]
    assert task.name == "longctx-4096" and task.category == "longctx"
    kinds = [p.id.split("/")[1] for p in task.prompts]
    assert sorted(kinds) == ["code"] * 4 + ["document"] * 4
    for prompt in task.prompts:
        assert prompt.id.startswith("longctx-4096/") and prompt.grounded and prompt.context_tokens == 4096
        assert prompt.document in prompt.text
        assert len(prompt.document) >= 4096 * 4  # more than the tokens asked for, in any BPE tokenizer's characters
        asked = re.search(r"take the function `([\w.]+)`|the section \"([^\"]+)\"", prompt.text)
        assert asked, prompt.text[-300:]
        name = asked.group(1) or asked.group(2)
        early = prompt.document[:ASKED_WITHIN_CHARS]
        assert (f"def {name.rsplit('.', 1)[-1]}(" in early) if asked.group(1) else (name in early)
    # The same sources at another length: longer documents, the same requests.
    longer = load_task("longctx-8192", 8, seed=0).prompts
    assert [p.id.split("/", 1)[1] for p in longer] == [p.id.split("/", 1)[1] for p in task.prompts]
    assert all(
        len(b.document) > len(a.document) and b.document.startswith(a.document[:1000])
        for a, b in zip(task.prompts, longer)
    )


def test_documents_come_from_text_no_other_task_and_no_training_draws():
    """IDLE's and lib2to3's modules and pydoc's topics: the grounded tasks skip those directories, training takes its
    prompts from the other tasks (and ShareGPT), and no suite runs ``longctx`` unless it is named."""
    stdlib_modules = {module for module, _ in grounded._stdlib_files()}
    task = load_task("longctx-2048", 40, seed=0)
    files = {path for p in task.prompts for path in re.findall(r"^# File: (\S+)$", p.document, re.MULTILINE)}
    assert files and all(path.split("/")[0] in grounded._SKIP_DIRS for path in files)
    assert not {path.removesuffix(".py").replace("/", ".") for path in files} & stdlib_modules
    assert not any(module.startswith(("idlelib", "lib2to3", "pydoc_data")) for module in stdlib_modules)
    assert all(not name.startswith("longctx") for name in DEFAULT_TASKS.split(","))
    assert all(not name.startswith("longctx") for suite in SUITES.values() for name in suite.tasks)
    assert "longctx" not in TASK_NAMES


def test_task_names_lengths_and_refusals(tmp_path):
    assert known_task("longctx") and known_task("longctx-16384") and not known_task("longctx-x")
    assert context_tokens_of("longctx-6000") == 6000 and context_tokens_of("edit") is None
    assert expand(["edit", "longctx", "longctx-4096"]) == ("edit", *(f"longctx-{n}" for n in DEFAULT_CONTEXT_TOKENS))
    assert [t.name for t in load_tasks(["longctx"], 1)] == [f"longctx-{n}" for n in DEFAULT_CONTEXT_TOKENS]
    with pytest.raises(SpecDecodeError, match=f"{MIN_CONTEXT_TOKENS} to"):
        load_task("longctx-100", 1)
    with pytest.raises(SpecDecodeError, match="name one, such as longctx-4096"):
        load_task("longctx", 1)
    with pytest.raises(SpecDecodeError, match="longctx-N"):
        check_known_tasks(["longctx4096"])
    settings = resolve_settings("quick", tasks="edit,longctx", long_context_tokens="2048,6000", draft_lengths="none")
    assert settings.tasks == ("edit", "longctx-2048", "longctx-6000")
    with pytest.raises(SpecDecodeError, match="name it in --tasks"):
        resolve_settings("quick", tasks="edit", long_context_tokens="4096")
    with pytest.raises(SpecDecodeError, match="positive integers"):
        resolve_settings("quick", tasks="longctx", long_context_tokens="4k")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "p1", "task": "qa", "text": "Why?"}) + "\n")
    with pytest.raises(SpecDecodeError, match="not of --prompts"):
        resolve_settings("quick", prompts_file=prompts, long_context_tokens="4096")


# --------------------------------------------------------------------------------------------------------
# Fitting to a tokenizer and a window


def _words(text: str) -> int:
    return len(text.split())


def test_fit_cuts_the_document_at_the_last_line_that_fits():
    document = "".join(f"line {i} " + "word " * 20 + "\n" for i in range(400))
    prompt = Prompt(
        "longctx-2048/x", f"Read this.\n\n{document}\nWhat does line 3 say?", True, document, context_tokens=2048
    )
    fitted = fit_prompt(prompt, _words, 2048)
    assert _words(fitted.text) <= 2048 < _words(fitted.text) + 22  # one more line would not fit
    assert fitted.document.endswith("\n") and document.startswith(fitted.document)
    assert fitted.text == f"Read this.\n\n{fitted.document}\nWhat does line 3 say?"
    assert fit_prompt(fitted, _words, 2048) is fitted  # what fits is kept as written
    with pytest.raises(SpecDecodeError, match="too few to keep what it asks about"):
        fit_prompt(prompt, _words, 100)


def test_the_encoder_fits_prompts_to_the_model_and_its_window(capsys):
    """A tiny model with a 3,000-token window: 2,048-token prompts are cut to 2,048 tokens, 4,096-token
    ones to the window less the new tokens, said once per length."""
    target = wrap(tiny_llama(seed=0, context=3000), word_and_punctuation_tokenizer())
    encoder = PromptEncoder(target, "tiny", 64)
    for name, expected in (("longctx-2048", 2048), ("longctx-4096", 3000 - 64)):
        lengths = [len(encoded.ids) for encoded in encoder.encode_tasks([load_task(name, 4)])]
        assert all(expected - 40 <= n <= expected for n in lengths), lengths
    assert capsys.readouterr().err.count("prompts of 4096 tokens are cut to 2936") == 1


@pytest.mark.real_model
def test_smollm2_prompts_have_the_requested_tokens_and_never_overflow_its_window(smollm2):
    encoder = PromptEncoder(smollm2, "smollm2-135m", 32)
    window = smollm2.backend.max_context
    assert window == 8192  # max_position_embeddings of its config
    for name, expected in (("longctx-4096", 4096), ("longctx-16384", window - 32)):
        for encoded in encoder.encode_tasks([load_task(name, 2)]):
            assert expected - 64 <= len(encoded.ids) <= expected
            assert encoded.ids == smollm2.tokenizer.apply_chat_template(
                [{"role": "user", "content": encoded.text}], add_generation_prompt=True, tokenize=True
            )


# --------------------------------------------------------------------------------------------------------
# Lossless over a long context


def test_greedy_output_over_thousands_of_tokens_equals_plain():
    """A 3,000-token prompt on a tiny model with a 4,096-token window: drafts rejected (lookups, another model) and
    drafts accepted in full (the target as its own draft model) leave the target's own greedy tokens."""
    tokenizer = tiny_tokenizer(tiny_words())
    target = wrap(tiny_llama(seed=0, context=4096), tokenizer, "long")
    draft = wrap(tiny_llama(seed=1, layers=1, context=4096), tokenizer, "long-draft")
    block = [(i * 7) % 90 + 3 for i in range(150)]
    prompt = [1, *(block * 20)][:3000]
    expected = hf_greedy(target, prompt, 40)
    drafters = {
        "none": create_drafter("none", target),
        "pld": create_drafter("pld", target),
        "suffix": create_drafter("suffix", target),
        "draft-model": create_drafter("draft-model", target, draft_model=draft),
        "draft-model (itself)": create_drafter("draft-model", target, draft_model=target),
    }
    for name, drafter in drafters.items():
        tokens, outcome = run(target, drafter, prompt, max_new_tokens=40, num_draft_tokens=4)
        assert tokens == expected, name
        assert (outcome.stats.drafted_tokens > 0) == (name != "none"), name
    assert outcome.stats.accepted_tokens == outcome.stats.drafted_tokens == 32  # 8 steps of 4 drafted + 1


# --------------------------------------------------------------------------------------------------------
# The benchmark and its report


def long_context_bench(tmp_path, context: int, out: str, **flags):
    """Benchmark settings on a tiny model of ``context`` tokens (its own directory under ``tmp_path``, made once):
    one prompt a task, 8 new tokens, one repeat, one thread, no sweep and no peers, and ``flags``."""
    model = tmp_path / f"long-{context}"
    if not model.exists():
        save_tiny(model, seed=0, context=context)
        word_and_punctuation_tokenizer().save_pretrained(model)
    return resolve_settings(
        "quick",
        model=str(model),
        prompts_per_task=1,
        max_new_tokens=8,
        repeats=1,
        threads=1,
        draft_lengths="none",
        peers=False,
        out=str(tmp_path / out),
        **flags,
    )


def test_bench_runs_longctx_and_reports_speedup_against_context_length(tmp_path):
    settings = long_context_bench(
        tmp_path, 4096, "out", methods="none,pld:k=3", tasks="longctx", long_context_tokens="2048,3000"
    )
    results = runner.run_benchmark(settings, progress=False)
    tokens = {task: [p["prompt_tokens"] for p in prompts] for task, prompts in results["prompts"].items()}
    assert set(tokens) == {"longctx-2048", "longctx-3000"}
    assert all(2048 - 40 <= n <= 2048 for n in tokens["longctx-2048"])
    assert all(cell["equal_to_plain_pct"] == 100.0 for cell in results["cells"])
    text = (settings.out / "results.md").read_text()
    section = text.split("## Speed-up against context length")[1]
    assert "| method | 2048 (" in section and " 3000 (" in section and "| `pld:k=3` |" in section
    assert sorted(results["cost_curves"]) == ["longctx-2048", "longctx-3000"]  # measured after that many tokens
    assert all(len(curve) == 16 and curve[0] == 1.0 for curve in results["cost_curves"].values())
    verifying = next(line for line in section.splitlines() if line.startswith("| *verifying 5 inputs"))
    assert verifying.count("x |") == 2
    end_to_end = section.split("(the same work for every method):")[1].split("Decoding after")[0]
    decoding = section.split("measured on this machine):")[1]
    assert "| `none` | 1.00x | 1.00x |" in end_to_end and "| `none` | 1.00x | 1.00x |" in decoding
    record = results["runs"]["pld:k=3"]["longctx-2048"]
    (prompt,) = record
    assert 0 < record[prompt]["prefill_s"] < record[prompt]["wall_s"][0]  # the prompt's reading, timed apart
    assert report.markdown(results, build_cells(results, settings.load_tasks())) == text


def test_bench_measures_the_curves_long_requests_are_priced_by_before_timing_any(tmp_path, monkeypatch):
    """`auto` prices a request of 5,000 tokens by the curve after 4,096 (the report's is after 5,000): the benchmark
    measures it before its first timed request, so that no request's decoding holds seconds of forwards timing a
    curve (without that step the warm-up, on the first task's prompt of 2,048 tokens, does not reach it and a timed
    request measures it)."""
    from specdecode.models import cost

    monkeypatch.setenv("SPECDECODE_COST_CURVES", str(tmp_path / "curves.json"))
    measured, timing = [], []
    timed_rounds = cost.timed_rounds

    def recording(backend, context_tokens, *args, **kwargs):
        measured.append((context_tokens, bool(timing)))
        return timed_rounds(backend, context_tokens, *args, **kwargs)

    monkeypatch.setattr(cost, "timed_rounds", recording)
    run_group = runner.run_group
    monkeypatch.setattr(runner, "run_group", lambda *args, **kwargs: timing.append(1) or run_group(*args, **kwargs))

    def bench(out: str) -> None:
        settings = long_context_bench(tmp_path, 8192, out, methods="none,pld", tasks="longctx-2048,longctx-5000")
        runner.run_benchmark(settings, progress=False)

    bench("out")
    assert {2048, 4096, 5000} <= {context for context, _ in measured}
    assert not any(during for _, during in measured)
    monkeypatch.setattr(runner, "verification_costs", lambda backend: None)  # the control: nothing measured ahead
    monkeypatch.setenv("SPECDECODE_COST_CURVES", str(tmp_path / "other-curves.json"))
    cost._CURVES.clear()
    measured.clear()
    timing.clear()
    bench("control")
    assert (4096, True) in measured


# --------------------------------------------------------------------------------------------------------
# The cost curve at long contexts


def test_cost_curves_are_kept_per_context_length(tmp_path, monkeypatch):
    from specdecode.models import cost

    monkeypatch.setenv("SPECDECODE_COST_CURVES", str(tmp_path / "curves.json"))
    monkeypatch.setattr(cost.OthersLoad, "busy", property(lambda self: False))
    measured = []

    def timed(backend, context_tokens, widths, repeats, warmup):
        measured.append(context_tokens)
        return {w: [w * (1 + context_tokens / 1000)] for w in range(1, widths + 1)}

    monkeypatch.setattr(cost, "timed_rounds", timed)
    backend = HFCausalLM(tiny_llama(seed=0, context=4096), "a")
    short = cost.relative_cost_curve(backend, widths=8)
    long = cost.relative_cost_curve(backend, widths=8, context_tokens=2000)
    assert measured == [cost.CURVE_CONTEXT_TOKENS, 2000]
    assert cost.relative_cost_curve(backend, widths=8, context_tokens=2000) is long
    assert cost.relative_cost_curve(backend, widths=8) is short
    saved = json.loads((tmp_path / "curves.json").read_text())
    assert sorted(entry["context_tokens"] for entry in saved.values()) == [cost.CURVE_CONTEXT_TOKENS, 2000]
    other = HFCausalLM(tiny_llama(seed=1, context=4096), "b")  # same structure: read from disk, per context
    assert cost.relative_cost_curve(other, widths=8, context_tokens=2000) == long
    assert cost.relative_cost_curve(other, widths=8, context_tokens=3000)
    assert measured == [cost.CURVE_CONTEXT_TOKENS, 2000, 3000]
    # Past the window a curve is measured at the longest context that leaves room for its widths.
    assert cost.relative_cost_curve(other, widths=8, context_tokens=10_000)
    assert measured[-1] == 4096 - 8


def test_forward_cost_compares_context_lengths(tiny_dirs, capsys):
    print_forward_cost(str(tiny_dirs["target"]), None, 1, "16,64", 8, 1, as_json=False, with_profiles=False)
    text = capsys.readouterr().out
    assert "after 16 cached tokens:" in text and "after 64 cached tokens:" in text
    table = text.split("against context length")[1].splitlines()
    assert "ctx 16" in table[1] and "ctx 64" in table[1] and table[2].split()[0] == "t(1)"
    assert [line.split()[0] for line in table[3:]] == [str(n) for n in range(1, 9)]
    print_forward_cost(str(tiny_dirs["target"]), None, 1, "16,64", 8, 1, as_json=True, with_profiles=False)
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["context_tokens"] for line in lines] == [16, 64]
    assert all(set(line) == {"model", "t_ms", "ratio_8_1", "quantize", "context_tokens"} for line in lines)
    with pytest.raises(SpecDecodeError, match="exceeds the model's context"):
        print_forward_cost(str(tiny_dirs["target"]), None, 1, "16,250", 8, 1, as_json=True, with_profiles=False)
    with pytest.raises(SpecDecodeError, match="--context-tokens"):
        print_forward_cost(str(tiny_dirs["target"]), None, 1, "16,x", 8, 1, as_json=True, with_profiles=False)


# --------------------------------------------------------------------------------------------------------
# A draft head with constant memory (LongSpec)


def test_head_cache_keeps_sinks_and_the_recent_window():
    from specdecode.heads.eagle import EagleConfig

    config = EagleConfig(
        8, 2, 1, 4, 16, 1e-6, 1e4, target_vocab_size=10, draft_vocab_size=10, aux_layers=(0,), target_num_layers=1
    )
    cache = HeadCache(config, torch.device("cpu"), torch.float32, window=100)
    positions = torch.arange(1000, dtype=torch.float32)
    for start in range(0, 1000, 50):
        entries = positions[start : start + 50].expand(1, 4, 50).transpose(1, 2)
        cache.append(entries, entries)
        cache.commit()
        assert cache.length <= HeadCache.SINKS + 100 + HeadCache.BLOCK and cache.committed == cache.length
    kept = cache.keys[0, : cache.length, 0].tolist()
    assert kept[:4] == [0, 1, 2, 3] and kept[4:] == list(range(1000 - cache.length + 4, 1000))
    cache.append(torch.zeros(1, 3, 4), torch.zeros(1, 3, 4))  # a draft's guesses
    cache.crop(cache.committed)
    assert cache.length == cache.committed
    unbounded = HeadCache(config, torch.device("cpu"), torch.float32)
    unbounded.append(torch.zeros(1, 900, 4), torch.zeros(1, 900, 4))
    unbounded.commit()
    assert unbounded.length == unbounded.committed == 900


def _run_keeping_the_session(target, drafter, prompt, **config):
    """:func:`helpers.run`, and the drafting session it opened."""
    sessions = []
    opened = drafter.session
    drafter.session = lambda request: sessions.append(opened(request)) or sessions[-1]
    tokens, outcome = run(target, drafter, prompt, **config)
    return tokens, outcome, sessions[0]


@pytest.mark.parametrize("tree_nodes", [0, "auto"])
def test_eagle_with_a_window_keeps_its_memory_bounded_and_greedy_output_exact(tree_nodes):
    """A 1,200-token prompt: the head's cache holds at most the sinks, the window and a block with ``window=64``, the
    whole context without; the output is the target's either way."""
    tokenizer = tiny_tokenizer(tiny_words())
    target = wrap(tiny_llama(seed=0, context=4096), tokenizer, "long")
    block = [(i * 7) % 90 + 3 for i in range(150)]
    prompt = [1, *(block * 10)][:1200]
    expected = hf_greedy(target, prompt, 48)
    for window in (64, 0):
        head = random_eagle_head(target.backend, 40)
        drafter = create_drafter("eagle", target, head=head, tree_nodes=tree_nodes, window=window)
        tokens, outcome, session = _run_keeping_the_session(
            target, drafter, prompt, max_new_tokens=48, num_draft_tokens=4
        )
        assert tokens == expected and outcome.stats.drafted_tokens > 0
        if window:
            assert session.cache.committed <= HeadCache.SINKS + window + HeadCache.BLOCK
        else:
            assert session.cache.committed == session.committed >= len(prompt)
    assert create_drafter("eagle", target, head=random_eagle_head(target.backend, 40)).window == DEFAULT_WINDOW
    with pytest.raises(SpecDecodeError, match="window"):
        create_drafter("eagle", target, head=random_eagle_head(target.backend, 40), window=-1)


def test_eagle_with_a_window_batched_at_8_equals_plain():
    """Eight prompts of 600 to 1,300 tokens decoded together, each evicting from its own head cache."""
    target = wrap(tiny_llama(seed=0, context=4096), tiny_tokenizer(tiny_words()), "long")
    drafter = create_drafter("eagle", target, head=random_eagle_head(target.backend, 40), window=32)
    engine = BatchEngine(
        target.backend, drafter, lambda config, d: make_policy(config.num_draft_tokens), frozenset(), max_batch_size=8
    )
    prompts = [[1, *[(i * (3 + n)) % 90 + 3 for i in range(600 + 100 * n)]] for n in range(8)]
    for n, prompt in enumerate(prompts):
        engine.submit(
            BatchRequest(prompt, GenerationConfig(max_new_tokens=24, ignore_eos=True, num_draft_tokens=3), tag=n)
        )
    got: dict[int, list[int]] = {n: [] for n in range(len(prompts))}
    for event in engine.run():
        got[event.tag] += event.new_tokens
    for n, prompt in enumerate(prompts):
        assert got[n] == hf_greedy(target, prompt, 24), n


def test_sampling_with_a_windowed_head_reproduces_the_target_distribution():
    """The bigram toy's requests run 500 tokens: a window of 16 evicts from the head's cache within each."""
    table = 2.0 * torch.randn(V, V, generator=torch.Generator().manual_seed(3))
    model = BigramFeatures(table)
    drafter = EagleDrafter(
        LoadedModel(name="bigram", backend=model, tokenizer=None),
        head=random_eagle_head(model, V - 1, seed=1),
        window=16,
    )
    assert HeadCache.SINKS + 16 + HeadCache.BLOCK < 500
    assert_head_drafter_samples_exactly(model, table, drafter, draws=DRAWS // 2)


def test_a_windowed_head_reads_a_long_prompt_as_its_sinks_and_window_and_keeps_what_reading_it_all_keeps():
    """``HeadCache.unread``: the rows a commit would drop at once are not computed; the entries kept are those a
    head that read every row keeps (a one-layer head's keys and values of a row depend on that row alone)."""
    from specdecode.drafters.base import DraftRequest
    from specdecode.sampling_params import SamplingParams

    target = wrap(tiny_llama(seed=0, context=4096), tiny_tokenizer(tiny_words()), "long")
    head = random_eagle_head(target.backend, 40)
    prompt = [1, *[(i * 7) % 90 + 3 for i in range(1199)]]
    features = target.backend.forward(
        torch.tensor(prompt[:-1]), target.backend.new_cache(), hidden_layers=head.config.aux_layers, invariant=False
    ).hidden
    session = create_drafter("eagle", target, head=head, window=64, lookup=False).session(
        DraftRequest(prompt_ids=tuple(prompt), sampling=SamplingParams())
    )
    assert session.cache.unread(1199) == (HeadCache.SINKS, 1199 - 64)  # a new cache: its sinks and window are read
    session.observe_prompt(features)
    session.propose(prompt, 4)
    # Every row of the prompt through a head with the same window, committed the usual way.
    whole = HeadCache(head.config, torch.device("cpu"), torch.float32, window=64)
    with torch.no_grad():
        head.extend(head.fuse(features), target.backend.embed(torch.tensor(prompt[1:])), torch.arange(1, 1200), whole)
    whole.commit()
    assert session.cache.committed == whole.committed == HeadCache.SINKS + 64
    torch.testing.assert_close(session.cache.keys[:, : whole.length], whole.keys[:, : whole.length])
    torch.testing.assert_close(session.cache.values[:, : whole.length], whole.values[:, : whole.length])
