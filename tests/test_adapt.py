"""Online adaptation (``draft-model`` with ``adapt=true``): output stays plain decoding's while the drafter's
LoRA weights change, across vocabularies too; the replay buffer and the compute budget are bounded; a saved
adapter drafts exactly as the one that saved it; bad options are one-line errors; ``bench adapt`` on tiny
models writes, resumes and checks its results."""

from __future__ import annotations

import json

import pytest
import torch

import specdecode.drafters.adapt as adapt
import specdecode.drafters.adapt_data as adapt_data
from helpers import PROMPTS, assert_one_line_error, hf_greedy, run, session_for
from specdecode.drafters import create_drafter
from specdecode.errors import SpecDecodeError
from specdecode.generator import SpeculativeGenerator
from specdecode.models.fastpath import PackedLinear
from specdecode.models.loading import load_model
from specdecode.models.quantized_layers import Int8Linear
from tiny_models import bpe_tokenizer, tiny_model

#: Train on every request, two steps each, whatever the time: a reproducible number of updates.
EVERY_REQUEST = {"adapt": "true", "adapt_budget": 1e6, "adapt_steps": 2, "adapt_lr": 1e-2}
MORE_PROMPTS = [*PROMPTS, [40, 41, 42, 43], [5, 17, 22, 9]]


def lora_weights(drafter) -> list[torch.Tensor]:
    return [p.detach().clone() for p in drafter.adapter.lora]


def changed(before: list[torch.Tensor], after: list[torch.Tensor]) -> bool:
    return any(not torch.equal(a, b) for a, b in zip(before, after))


def test_greedy_output_is_plain_decodings_while_the_weights_change(tiny_target, tiny_draft):
    drafter = create_drafter("draft-model", tiny_target, draft_model=tiny_draft, **EVERY_REQUEST)
    for prompt in MORE_PROMPTS:
        before = lora_weights(drafter)
        tokens, outcome = run(tiny_target, drafter, prompt, max_new_tokens=20, num_draft_tokens=4)
        assert tokens == hf_greedy(tiny_target, prompt, 20) and outcome.stats.drafted_tokens > 0
        assert changed(before, lora_weights(drafter))  # the request was learnt from
    assert drafter.adapter.steps == 2 * len(MORE_PROMPTS)
    # The loaded draft model is never written: its layers are still packed, LoRA lives in the drafter's copy.
    assert isinstance(tiny_draft.backend.model.model.layers[0].self_attn.q_proj, PackedLinear)


def test_the_target_drafting_for_itself_stays_untouched(tiny_target, monkeypatch):
    """LoRA on the last layer only: the copy keeps the fast path elsewhere, and the target (the draft model
    given) keeps its weights and modules — its own plain decoding is unchanged after adapting."""
    monkeypatch.setattr(adapt, "LORA_LAYERS", 1)
    drafter = create_drafter("draft-model", tiny_target, draft_model=tiny_target, **EVERY_REQUEST)
    layers = drafter.draft.backend.model.model.layers
    assert isinstance(layers[0].mlp.up_proj, PackedLinear) and not isinstance(layers[-1].mlp.up_proj, PackedLinear)
    expected = [hf_greedy(tiny_target, prompt, 16) for prompt in PROMPTS]
    for prompt, tokens in zip(PROMPTS, expected):
        assert run(tiny_target, drafter, prompt, max_new_tokens=16, num_draft_tokens=3)[0] == tokens
    assert [hf_greedy(tiny_target, prompt, 16) for prompt in PROMPTS] == expected
    mlp = tiny_target.backend.model.model.layers[-1].mlp
    assert all(isinstance(m, PackedLinear) for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))


def test_a_quantized_draft_model_adapts_its_last_layers_and_keeps_the_rest_quantized(
    tiny_dirs, tiny_target, monkeypatch
):
    """LoRA needs fp32 layers only where it trains and above (the gradient flows back through the head): the
    adapted layers and a quantized head become dense fp32 copies, the layers below keep their kernels."""
    monkeypatch.setattr(adapt, "LORA_LAYERS", 1)
    draft = load_model(str(tiny_dirs["target"]), quantize="int8")
    drafter = create_drafter("draft-model", tiny_target, draft_model=draft, **EVERY_REQUEST)
    model = drafter.draft.backend.model
    assert isinstance(model.model.layers[0].mlp.up_proj, Int8Linear)
    assert type(model.model.layers[-1].mlp.up_proj.base_layer) is torch.nn.Linear
    assert type(model.get_output_embeddings()) is torch.nn.Linear
    for prompt in MORE_PROMPTS:
        before = lora_weights(drafter)
        tokens, outcome = run(tiny_target, drafter, prompt, max_new_tokens=16, num_draft_tokens=3)
        assert tokens == hf_greedy(tiny_target, prompt, 16) and outcome.stats.drafted_tokens > 0
        assert changed(before, lora_weights(drafter))
    assert isinstance(draft.backend.model.model.layers[-1].mlp.up_proj, Int8Linear)  # the loaded model untouched


def test_a_batch_of_sessions_keeps_plain_output_when_one_finishes_and_trains(tiny_target, tiny_draft):
    """Sessions still open when another one's end updates the weights restart their drafter cache."""
    drafter = create_drafter("draft-model", tiny_target, draft_model=tiny_draft, **EVERY_REQUEST)
    generator = SpeculativeGenerator(tiny_target, drafter)
    results = generator.generate_batch(MORE_PROMPTS, batch_size=3, ignore_eos=True, max_new_tokens=18)
    for prompt, result in zip(MORE_PROMPTS, results):
        assert result.token_ids == hf_greedy(tiny_target, prompt, 18)
    assert drafter.adapter.version >= len(MORE_PROMPTS)


# -- across vocabularies ---------------------------------------------------------------------------------


def char_tokenizer(extra: list[str] = (), merges: list[tuple[str, str]] = ()):
    return bpe_tokenizer([*"abcdefgh ", *extra], merges)


@pytest.mark.parametrize("mapping", ["intersection", "text", "ngram"])
def test_across_vocabularies_output_is_plain_decodings_and_the_drafter_learns(mapping):
    """The target merges characters the drafter spells one by one; both see the same text."""
    tokenizer = char_tokenizer(["ab", "abc", "de"], [("a", "b"), ("ab", "c"), ("d", "e")])
    target, draft = tiny_model(tokenizer, 0, layers=3), tiny_model(char_tokenizer(), 1, layers=2)
    drafter = create_drafter("draft-model", target, draft_model=draft, vocab_mapping=mapping, **EVERY_REQUEST)
    prompt = tokenizer.encode("abc de fgh")
    means = []
    for _ in range(4):  # one request again and again: the drafter learns the target's answer
        before = lora_weights(drafter)
        tokens, outcome = run(target, drafter, prompt, max_new_tokens=24, num_draft_tokens=4)
        assert tokens == hf_greedy(target, prompt, 24)
        assert changed(before, lora_weights(drafter))
        means.append(outcome.stats.mean_accepted_tokens)
    assert means[-1] > means[0]
    example = drafter.adapter.buffer[-1]
    assert example.soft_rows.numel() > 0  # distillation where the target's tokens map to the drafter's
    assert 0 < example.weights.min() < example.weights.max() == 1.0  # mismatches weigh more


# -- bounds ----------------------------------------------------------------------------------------------


def test_replay_buffer_and_examples_are_bounded(tiny_target, tiny_draft, monkeypatch):
    monkeypatch.setattr(adapt, "BUFFER", 3)
    monkeypatch.setattr(adapt_data, "WINDOW", 16)
    options = {**EVERY_REQUEST, "adapt_steps": 1}
    drafter = create_drafter("draft-model", tiny_target, draft_model=tiny_draft, **options)
    for prompt in MORE_PROMPTS:
        run(tiny_target, drafter, prompt, max_new_tokens=24, num_draft_tokens=3)
        assert len(drafter.adapter.buffer) <= 3 and drafter.adapter.buffer_tokens() <= 3 * 16
    for example in drafter.adapter.buffer:
        assert example.ids.numel() <= 16 and example.soft_ids.shape[1] == adapt_data.TOPK
        assert int(example.rows.max()) + 1 < example.ids.numel()


def test_a_tiny_budget_checks_once_then_waits(tiny_target, tiny_draft):
    """Adapting is paid for by decoding time: the first request's check (two forwards) overdraws a budget of
    a millionth, and the debt carries over, so no request trains or checks after it."""
    options = {**EVERY_REQUEST, "adapt_budget": 1e-6, "adapt_steps": 5}
    drafter = create_drafter("draft-model", tiny_target, draft_model=tiny_draft, **options)
    for prompt in MORE_PROMPTS:
        run(tiny_target, drafter, prompt, max_new_tokens=12, num_draft_tokens=3)
    adapter = drafter.adapter
    assert adapter.steps == 0 and len(adapter.checks) == 1 and adapter.credit_s < 0
    assert len(adapter.buffer) == len(MORE_PROMPTS)  # what it could not learn from yet is kept


def test_an_adapter_that_predicts_worse_than_the_base_weights_stops_drafting(tiny_target, monkeypatch):
    """Training that hurts (here: every step scrambles the LoRA weights of the target drafting for itself,
    whose base weights predict every token) is caught by the check on the next request: the base weights
    draft again, exactly as a drafter without adaptation, and the output stays plain decoding's."""

    def scramble(self, example):
        with torch.no_grad():
            for p in self.lora:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 3)
        self.steps += 1

    monkeypatch.setattr(adapt.OnlineAdapter, "_step", scramble)
    drafter = create_drafter("draft-model", tiny_target, draft_model=tiny_target, **EVERY_REQUEST)
    frozen = create_drafter("draft-model", tiny_target, draft_model=tiny_target)
    for prompt in MORE_PROMPTS:
        tokens, _ = run(tiny_target, drafter, prompt, max_new_tokens=16, num_draft_tokens=3)
        assert tokens == hf_greedy(tiny_target, prompt, 16)
    adapter = drafter.adapter
    assert not adapter.drafting and min(adapter.checks) < 0 and sum(adapter.checks) < 0
    context = MORE_PROMPTS[0] + [7, 8]
    drafts = [session_for(d, MORE_PROMPTS[0]).propose(context, 4).tokens for d in (drafter, frozen)]
    assert drafts[0] == drafts[1]
    drafter.reset()
    assert adapter.drafting and not adapter.checks


def test_reset_forgets_what_was_learnt(tiny_target, tiny_draft):
    drafter = create_drafter("draft-model", tiny_target, draft_model=tiny_draft, **EVERY_REQUEST)
    initial = lora_weights(drafter)
    run(tiny_target, drafter, PROMPTS[0], max_new_tokens=12, num_draft_tokens=3)
    drafter.reset()
    assert not changed(initial, lora_weights(drafter)) and not drafter.adapter.buffer


# -- save and load ---------------------------------------------------------------------------------------


def test_saved_adapter_reloads_to_identical_drafts(tiny_target, tiny_draft, tmp_path):
    saving = create_drafter(
        "draft-model", tiny_target, draft_model=tiny_draft, adapt_save=str(tmp_path), **EVERY_REQUEST
    )
    for prompt in PROMPTS:
        run(tiny_target, saving, prompt, max_new_tokens=20, num_draft_tokens=4)
    assert (tmp_path / "adapter_model.safetensors").is_file() and (tmp_path / "adapter_config.json").is_file()
    frozen = create_drafter("draft-model", tiny_target, draft_model=tiny_draft, adapt_load=str(tmp_path))
    plain = create_drafter("draft-model", tiny_target, draft_model=tiny_draft)
    assert not changed(lora_weights(saving), lora_weights(frozen))
    context = PROMPTS[0] + hf_greedy(tiny_target, PROMPTS[0], 10)
    ids = torch.tensor(context)
    logits = [d.draft.backend.forward(ids, d.draft.backend.new_cache()).logits for d in (saving, frozen, plain)]
    assert torch.equal(logits[0], logits[1]) and not torch.equal(logits[0], logits[2])
    for end in range(len(PROMPTS[0]), len(context)):
        drafts = [session_for(d, PROMPTS[0]).propose(context[:end], 5).tokens for d in (saving, frozen)]
        assert drafts[0] == drafts[1]
    run(tiny_target, frozen, PROMPTS[1], max_new_tokens=12)  # loaded alone, it drafts frozen
    assert not changed(lora_weights(saving), lora_weights(frozen)) and frozen.adapter.steps == 0


# -- options ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"adapt": "maybe"}, "adapt must be true or false, got 'maybe'"),
        ({"adapt": "true", "adapt_budget": 0}, "adapt_budget must be a positive number, got 0"),
        ({"adapt": "true", "adapt_budget": "lots"}, "adapt_budget must be a positive number"),
        ({"adapt": "true", "adapt_steps": 1.5}, "adapt_steps must be a positive integer, got 1.5"),
        ({"adapt": "true", "adapt_lr": -1}, "adapt_lr must be a positive number"),
        ({"adapt_budget": 0.2}, "adapt_budget needs adapt=true"),
        ({"adapt": "false", "adapt_save": "x"}, "adapt_save needs adapt=true"),
        ({"adapt_load": "/nonexistent/adapter"}, "holds no adapter"),
    ],
)
def test_bad_options_are_refused(tiny_target, tiny_draft, options, message):
    with pytest.raises(SpecDecodeError, match=message):
        create_drafter("draft-model", tiny_target, draft_model=tiny_draft, **options)


def test_an_adapter_of_another_model_is_refused(tiny_target, tiny_draft, tmp_path):
    drafter = create_drafter("draft-model", tiny_target, draft_model=tiny_target, **EVERY_REQUEST)
    drafter.adapter.save(tmp_path)
    with pytest.raises(SpecDecodeError, match="does not fit this draft model"):
        create_drafter("draft-model", tiny_target, draft_model=tiny_draft, adapt_load=str(tmp_path))


def test_cli_bad_option_is_a_one_line_error(capsys, tiny_dirs):
    argv = ["generate", "w1 w2", "--model", str(tiny_dirs["target"]), "--drafter", "draft-model"]
    argv += ["--draft-model", str(tiny_dirs["draft"]), "--max-new-tokens", "4"]
    assert_one_line_error(capsys, [*argv, "--drafter-option", "adapt=maybe"], "adapt must be true or false")
    bad_steps = ["--drafter-option", "adapt=true", "--drafter-option", "adapt_steps=0"]
    assert_one_line_error(capsys, [*argv, *bad_steps], "adapt_steps must be a positive integer, got 0")
    from specdecode.cli import main

    assert main([*argv, "--drafter-option", "adapt=true", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["new_tokens"] == 4


# -- bench adapt -----------------------------------------------------------------------------------------


def test_bench_adapt_writes_resumes_and_checks_outputs(tiny_dirs, tmp_path, monkeypatch):
    from specdecode.bench import adapt as bench

    problems = [{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}(x):\n    w{i} w7 w8 here\n"} for i in range(4)]
    monkeypatch.setattr(bench, "humaneval_problems", lambda count: problems[:count])
    given = {"model": str(tiny_dirs["target"]), "draft_model": str(tiny_dirs["draft"]), "vocab_mapping": "none"}
    given |= {"requests": 3, "max_new_tokens": 6, "threads": 1, "adapt_budget": 1e6, "adapt_steps": 1}
    settings = bench.resolve_settings(**given, out=str(tmp_path))
    results = bench.measure_adapt(settings, progress=False)
    assert [len(results["records"][arm]) for arm in bench.ARMS] == [3, 3]
    summary = results["summary"]
    assert summary["identical"] == summary["compared"] == 3 and summary["adapter_steps"] == 3
    assert results["records"]["adapted"][0]["adapter_drafted"] and 1 <= summary["adapter_drafted"] <= 3
    report = (tmp_path / "results.md").read_text()
    assert "every adapted output equals the frozen one (3 of 3 requests)" in report
    assert f"the adapter drafted {summary['adapter_drafted']} of 3 requests" in report
    assert (tmp_path / "adapt.png").is_file() and (tmp_path / "adapter" / "adapter_model.safetensors").is_file()

    decoded = []
    real_decode = bench.decode
    monkeypatch.setattr(bench, "decode", lambda *args: decoded.append(args[1]["task_id"]) or real_decode(*args))
    more = bench.measure_adapt(bench.resolve_settings(**{**given, "requests": 4}, out=str(tmp_path)), progress=False)
    assert decoded == ["HumanEval/3", "HumanEval/3"]  # only the new request, frozen then adapted
    assert json.loads((tmp_path / "results.json").read_text())["summary"] == more["summary"]
    with pytest.raises(SpecDecodeError, match="holds results of other settings"):
        bench.measure_adapt(bench.resolve_settings(**{**given, "max_new_tokens": 7}, out=str(tmp_path)))


def test_bench_adapt_sharegpt_topic_takes_the_openings_that_mention_it_in_order(monkeypatch):
    from specdecode.bench import adapt as bench
    from specdecode.data import datasets

    def opening(record_id: str, text: str) -> dict:
        return {"id": f"{record_id}_0", "conversations": [{"from": "human", "value": text}]}

    records = [
        opening("a", "How do I sort a list in Python quickly?"),
        opening("b", "Write a poem about the sea and the sky."),
        opening("c", "pythonic is not the word; explain decorators in PYTHON please"),
        opening("d", "Is monty python funny? Tell me about it."),
    ]
    monkeypatch.setattr(datasets, "sharegpt_records", lambda: records)
    assert [p["task_id"] for p in bench.sharegpt_topic_problems("python", 3)] == [
        "sharegpt/a_0",
        "sharegpt/c_0",
        "sharegpt/d_0",
    ]
    with pytest.raises(SpecDecodeError, match="ShareGPT has 3 openings on 'python', asked for 4"):
        bench.sharegpt_topic_problems("python", 4)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--requests", "0"], "--requests must be a positive integer, got 0"),
        (["--task", "champ"], "--task must be one of humaneval, sharegpt, got 'champ'"),
        (["--topic", "rust"], "--topic chooses ShareGPT openings: it needs --task sharegpt"),
        (["--task", "sharegpt", "--topic", " "], "--topic must be a word"),
        (["--quantize", "int3"], "--quantize must be one of"),
        (["--quantize-draft", "int3"], "--quantize-draft must be one of"),
        (["--vocab-mapping", "bytes"], "vocab_mapping must be one of"),
        (["--adapt-budget", "0"], "adapt_budget must be a positive number"),
        (["--num-draft-tokens", "many"], "--num-draft-tokens must be auto, heuristic or a positive integer"),
    ],
)
def test_bench_adapt_bad_flags_are_one_line_errors(capsys, flags, message):
    assert_one_line_error(capsys, ["bench", "adapt", *flags], message)
