"""RASD (``rasd``): the datastore's index and cache, bad datastores, fusion with another drafter's tree; greedy output
equal to plain (tiny model, SmolLM2, a batch of 8), sampling exact (chi-square, with a broken variant that must
fail)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import specdecode.drafters.rasd
from helpers import (
    DRAWS,
    FAIL_P,
    PASS_P,
    PROMPTS,
    ParityBigramLM,
    V,
    assert_one_line_error,
    chain_pvalues,
    hf_greedy,
    parity_counts,
    random_eagle_head,
    run,
)
from specdecode.bench.common import check_known_tasks
from specdecode.bench.methods import parse_method
from specdecode.data.datastore import Datastore
from specdecode.data.tasks import TASK_NAMES, load_task
from specdecode.drafters import check_drafter_options, create_drafter
from specdecode.drafters.rasd import fuse
from specdecode.errors import SpecDecodeError
from specdecode.generator import SpeculativeGenerator
from specdecode.models.loading import LoadedModel
from specdecode.sampling import sampling_probs
from specdecode.sampling_params import SamplingParams
from specdecode.types import Draft
from tiny_models import tiny_tokenizer


@pytest.fixture(autouse=True)
def datastores_in_a_temporary_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_DATASTORES", str(tmp_path / "datastores"))


def write_jsonl(path, texts: list[str]):
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return path


@pytest.fixture(scope="module")
def copied(tiny_target):
    """Texts the tiny target's greedy answers copy from: each prompt with its answer, and the same answer with a
    detour of wrong tokens, so that retrieval is right, then branches, then wrong."""
    texts = []
    for prompt in [*PROMPTS, [3, 4, 5]]:
        answer = hf_greedy(tiny_target, prompt, 64)
        texts.append(prompt + answer)
        texts.append(prompt + answer[:20] + [9, 10, 11] + answer[20:])
    return [tiny_target.tokenizer.decode(ids) for ids in texts]


# -- the datastore ---------------------------------------------------------------------------------------


def test_continuations_are_what_followed_each_occurrence_with_counts(tmp_path):
    tokenizer = tiny_tokenizer(["a", "b", "c", "d"])
    store = Datastore.open(write_jsonl(tmp_path / "ds.jsonl", ["a b c a b d", "a b c", "d"]), tokenizer)
    a, b, c, d = (tokenizer.convert_tokens_to_ids(word) for word in "abcd")
    assert store.size == 10 and store.texts == 3
    length, start, end = store.longest_suffix([d, a, b], 1, 8)
    assert (length, end - start) == (2, 3)  # "a b" thrice; "d a b" nowhere
    found = {token: count for token, count, _, _ in store.continuations(start, end, length)}
    assert found == {c: 2, d: 1}  # the end of the second text is no continuation
    assert store.longest_suffix([b, b], 2, 8) == (0, 0, 0)


def test_a_second_open_tokenizes_nothing_and_a_new_file_alone_is_tokenized(tmp_path, capsys):
    tokenizer = tiny_tokenizer(["a", "b", "c"])
    folder = tmp_path / "code"
    (folder / "deep").mkdir(parents=True)
    (folder / "one.txt").write_text("a b c")
    (folder / "deep" / "two.txt").write_text("c b a")
    (folder / "binary.bin").write_bytes(b"\xff\xfe\x00")
    (folder / ".hidden").write_text("a a a")
    first = Datastore.open(folder, tokenizer)
    assert "tokenizing 2 of 2 texts" in capsys.readouterr().err
    again = Datastore.open(folder, tokenizer)
    assert capsys.readouterr().err == "" and np.array_equal(first.tokens, again.tokens)
    (folder / "three.txt").write_text("b b")
    grown = Datastore.open(folder, tokenizer)
    assert "tokenizing 1 of 3 texts" in capsys.readouterr().err and grown.size == first.size + 2
    calls = []
    original = tokenizer.__class__.__call__
    tokenizer.__class__.__call__ = lambda self, *a, **k: calls.append(a) or original(self, *a, **k)
    try:
        Datastore.open(folder, tokenizer)
    finally:
        tokenizer.__class__.__call__ = original
    assert calls == []


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "does not exist"),
        ("", "has no text to index"),
        ('{"text": "a"}\n{"text": ', "line 2: not valid JSON"),
        ('{"text": 3}', "line 1: expected an object with a string 'text'"),
    ],
)
def test_bad_datastores_are_one_line_errors(tmp_path, content, message):
    path = tmp_path / "ds.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SpecDecodeError, match=message) as raised:
        Datastore.open(path, tiny_tokenizer(["a"]))
    assert "\n" not in str(raised.value)


def test_an_empty_folder_and_a_lone_text_file_are_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecDecodeError, match="has no text to index"):
        Datastore.open(tmp_path / "empty", tiny_tokenizer(["a"]))
    (tmp_path / "notes.txt").write_text("a")
    with pytest.raises(SpecDecodeError, match="a directory of text files or a .jsonl file"):
        Datastore.open(tmp_path / "notes.txt", tiny_tokenizer(["a"]))


def test_the_command_line_says_what_rasd_needs(tiny_dirs, tmp_path, capsys):
    target = str(tiny_dirs["target"])
    argv = ["generate", "w1 w2", "--model", target, "--drafter", "rasd", "--max-new-tokens", "4"]
    assert_one_line_error(capsys, argv, "drafter 'rasd' needs --drafter-option datastore=PATH")
    missing = str(tmp_path / "nowhere")
    assert_one_line_error(capsys, [*argv, "--drafter-option", f"datastore={missing}"], "does not exist")
    datastore = f"datastore={write_jsonl(tmp_path / 'ds.jsonl', ['w1 w2 w3'])}"
    assert_one_line_error(capsys, [*argv, "--drafter-option", datastore, "--drafter-option", "with=nope"], "nope")
    assert_one_line_error(
        capsys, [*argv, "--drafter-option", datastore, "--drafter-option", "heads=x"], "joining 'suffix'"
    )


def test_options_and_method_specs(tiny_target, tmp_path):
    path = str(write_jsonl(tmp_path / "ds.jsonl", ["w1 w2 w3"]))
    assert parse_method(f"rasd:datastore={path}").draft_model is None  # with=suffix: no draft model
    assert parse_method(f"rasd:m:with=draft-model:datastore={path}").draft_model == "m"
    with pytest.raises(SpecDecodeError, match="needs a draft model"):
        parse_method(f"rasd:with=hsd:datastore={path}")
    with pytest.raises(SpecDecodeError, match="not with=suffix"):
        create_drafter("rasd", tiny_target, datastore=path, draft_model=tiny_target)
    with pytest.raises(SpecDecodeError, match="not rasd"):
        create_drafter("rasd", tiny_target, datastore=path, **{"with": "rasd"})
    retrieval = create_drafter("rasd", tiny_target, datastore=path)
    with pytest.raises(SpecDecodeError, match="not rasd"):
        create_drafter("rasd", tiny_target, datastore=path, **{"with": retrieval})
    with pytest.raises(SpecDecodeError, match="its own draft model"):
        create_drafter("rasd", tiny_target, datastore=path, draft_model=tiny_target, **{"with": retrieval.inner})


def test_options_rasd_does_not_take_are_passed_on_to_the_drafter_it_joins(tiny_target, tmp_path):
    path = str(write_jsonl(tmp_path / "ds.jsonl", ["w1 w2 w3"]))
    retrieval = create_drafter("rasd", tiny_target, datastore=path, max_ngram=5, min_prob=0.2, **{"with": "pld"})
    assert retrieval.inner.ngram_sizes == range(5, 0, -1)  # pld's, passed on
    assert retrieval.min_prob == 0.2  # rasd's own (suffix takes one too: rasd's comes first)
    with pytest.raises(
        SpecDecodeError, match=r"drafter 'rasd' \(joining 'suffix'\) does not take option\(s\): max-ngram"
    ):
        check_drafter_options("rasd", datastore=path, max_ngram=5)  # the default, suffix, has no n-gram sizes
    with pytest.raises(SpecDecodeError, match="does not take option"):  # a drafter object comes with its options
        create_drafter("rasd", tiny_target, datastore=path, max_ngram=5, **{"with": retrieval.inner})
    method = parse_method(f"rasd:datastore={path}:with=pld:max_ngram=5")
    assert dict(method.options)["max_ngram"] == 5


def test_the_complete_task_asks_for_bodies_that_only_the_code_base_holds():
    prompts = load_task("complete", 6).prompts
    assert len({p.id for p in prompts}) == 6
    for prompt in prompts:
        header = prompt.text.split("```python\n", 1)[1].rsplit("\n```", 1)[0]
        assert prompt.document.startswith(header) and len(prompt.document) > len(header) + 20
        assert prompt.document not in prompt.text
    assert "complete" not in TASK_NAMES  # asked for by name only: the suites run what they ran
    check_known_tasks(["complete"])


# -- fusion ------------------------------------------------------------------------------------------------


def test_fusion_shares_the_longest_common_prefix_and_appends_the_rest_as_point_masses():
    inner = Draft(tokens=[5, 6, 7], probs=torch.full((3, 10), 0.1))  # a sampled chain
    tree = Draft(tokens=[5, 6, 9, 8], parents=[-1, 0, 1, -1], confidence=[0.9, 0.8, 0.7, 0.2])
    draft, retrieved, appended = fuse(inner, tree, [0, 1, 2, 3])
    assert draft.tokens == [5, 6, 7, 9, 8] and draft.parents == [-1, 0, 1, 1, -1]
    assert appended == [False, False, True, True]
    assert retrieved == {0: 0.9, 1: 0.8, 3: 0.7, 4: 0.2}
    assert torch.equal(draft.probs[:3], inner.probs)  # the sampled nodes first, with the rows they were drawn from
    assert draft.probs[3, 9] == 1 and draft.probs[4, 8] == 1 and draft.probs[3:].sum() == 2


# -- greedy: the target's own output -------------------------------------------------------------------------


def joined_drafter(name: str, tiny_target, tiny_draft):
    options = {
        "draft-model": {"draft_model": tiny_draft},
        "eagle": {"head": random_eagle_head(tiny_target.backend, 48)},
    }
    return create_drafter(name, tiny_target, **options.get(name, {}))


@pytest.mark.parametrize("joined", ["none", "pld", "suffix", "stand", "draft-model", "eagle"])
def test_greedy_output_equals_plain_and_the_datastore_is_copied(tiny_target, tiny_draft, copied, tmp_path, joined):
    path = str(write_jsonl(tmp_path / "ds.jsonl", copied))
    drafter = create_drafter(
        "rasd", tiny_target, datastore=path, **{"with": joined_drafter(joined, tiny_target, tiny_draft)}
    )
    alone = joined_drafter(joined, tiny_target, tiny_draft)
    steps = {"rasd": 0, joined: 0}
    for k in (4, "auto"):
        for prompt in PROMPTS:
            tokens, outcome = run(tiny_target, drafter, prompt, max_new_tokens=48, num_draft_tokens=k)
            assert tokens == hf_greedy(tiny_target, prompt, 48), (joined, k, prompt)
            _, without = run(tiny_target, alone, prompt, max_new_tokens=48, num_draft_tokens=k)
            steps["rasd"] += outcome.stats.steps
            steps[joined] += without.stats.steps
    assert steps["rasd"] < steps[joined]  # every answer is in the datastore: fewer steps than the joined drafter's


def test_a_batch_gives_every_sequence_its_solo_output(tiny_target, copied, tmp_path):
    path = str(write_jsonl(tmp_path / "ds.jsonl", copied))
    generator = SpeculativeGenerator.build(tiny_target, "rasd", datastore=path, **{"with": "suffix"})
    plain = SpeculativeGenerator.build(tiny_target, "none")
    prompts = [tiny_target.tokenizer.decode(p) for p in [*PROMPTS, [3, 4, 5], [8, 9], [40, 41, 42], [3], [77, 5]]]
    solo = [plain.generate(p, chat=False, max_new_tokens=30, ignore_eos=True) for p in prompts]
    config = generator.config_for(max_new_tokens=30, ignore_eos=True)
    batch = generator.run_batch([(p, config) for p in prompts], chat=False, batch_size=8)
    assert [r.token_ids for r in batch] == [r.token_ids for r in solo]
    assert sum(r.stats.accepted_tokens for r in batch) > 0


# -- sampling: exact, chi-square --------------------------------------------------------------------------


def parity_pvalues(tmp_path, sampling: SamplingParams, tokens_wanted: int) -> list[float]:
    """Stand's sampled trees (with their rows) and the datastore's point masses fused, over many seeded requests:
    one chi-square test per (parity, position in step, previous token)."""
    table = 2.0 * torch.randn(2, V, V, generator=torch.Generator().manual_seed(3))
    model = ParityBigramLM(table)
    tokenizer = tiny_tokenizer(["t3", "t4"])  # ids 0..4: <unk>, <s>, </s>, t3, t4
    rng = np.random.default_rng(0)
    texts = [tokenizer.decode(rng.integers(0, V, 40).tolist()) for _ in range(30)]
    stand = create_drafter("stand", None, template="2,1", topk=3, max_ngram=2)
    path = str(write_jsonl(tmp_path / "ds.jsonl", texts))
    target = LoadedModel("parity", model, tokenizer)
    drafter = create_drafter("rasd", target, datastore=path, min_match=1, max_nodes=4, **{"with": stand})
    fused = 0
    original = specdecode.drafters.rasd.fuse

    def counting(inner, tree, order):
        nonlocal fused
        result = original(inner, tree, order)
        fused += inner.probs is not None and any(result[2])
        return result

    specdecode.drafters.rasd.fuse = counting
    try:
        counts, _, steps = parity_counts(model, drafter, sampling, tokens_wanted)
    finally:
        specdecode.drafters.rasd.fuse = original
    assert fused > steps / 4  # sampled nodes and retrieved point masses verified together, often
    expected = sampling_probs(table, sampling).numpy()
    return [p for parity in range(2) for p in chain_pvalues(counts[parity], expected[parity])]


SAMPLING = SamplingParams(temperature=0.9, top_k=4)


def test_sampling_through_the_engine_is_lossless(tmp_path):
    pvalues = parity_pvalues(tmp_path, SAMPLING, DRAWS)
    assert len(pvalues) >= 16
    assert min(pvalues) > PASS_P / len(pvalues), pvalues  # Bonferroni over the strata


def test_retrieved_nodes_reported_as_drawn_from_a_spread_fail_the_same_test(tmp_path, monkeypatch):
    """A retrieved token is chosen, not drawn: a row that spreads its mass (as if it were sampled) biases what is
    kept."""
    monkeypatch.setattr(
        specdecode.drafters.rasd, "point_masses", lambda tokens, like: torch.full((len(tokens), like.shape[1]), 0.2)
    )
    assert min(parity_pvalues(tmp_path, SAMPLING, DRAWS)) < FAIL_P


# -- SmolLM2 -----------------------------------------------------------------------------------------------

CODE = '''def moving_average(values, window):
    """The mean of every run of ``window`` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    total = sum(values[:window])
    averages = [total / window]
    for index in range(window, len(values)):
        total += values[index] - values[index - window]
        averages.append(total / window)
    return averages
'''


@pytest.mark.real_model
def test_smollm2_greedy_output_is_plain_alone_and_in_a_batch_of_8(smollm2, tmp_path):
    folder = tmp_path / "code"
    folder.mkdir()
    (folder / "stats.py").write_text(CODE)
    plain = SpeculativeGenerator.build(smollm2, "none")
    prompts = [
        "Write a Python function moving_average(values, window) that returns the mean of every window.",
        "Complete this code:\n\ndef moving_average(values, window):\n",
        "What is 2 + 2? Answer with one number.",
        "List three colours.",
    ] * 2
    solo = [plain.generate(p, chat=True, max_new_tokens=24) for p in prompts]
    for joined in ("pld", "suffix"):
        generator = SpeculativeGenerator.build(smollm2, "rasd", datastore=str(folder), **{"with": joined})
        for prompt, expected in zip(prompts[:2], solo):
            assert generator.generate(prompt, chat=True, max_new_tokens=24).token_ids == expected.token_ids, joined
        config = generator.config_for(max_new_tokens=24)
        batch = generator.run_batch([(p, config) for p in prompts], chat=True, batch_size=8)
        for index, (alone, together) in enumerate(zip(solo, batch)):
            assert together.token_ids == alone.token_ids, f"{joined}: sequence {index} differs from plain"
