"""``specdecode bench multidraft``: its exact acceptances agree with the verifiers' own decisions sampled, the optimum
is reached by ``optimal-md`` and bounds the others, and the command writes its table and refuses bad flags."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from specdecode.bench import multidraft, multidraft_prompts
from specdecode.cli import main
from specdecode.types import Draft
from specdecode.verify.rejection import rejection_level


def test_rejection_sampling_keeps_what_the_benchmark_says():
    """The baseline is the verifier's own recursive rejection sampling: its kept tokens over 40,000 sampled nodes of
    four i.i.d. drafts fit the closed form."""
    settings = multidraft.resolve_settings(out="unused")
    target, drafted = multidraft.toy_tables(settings, temperature=1.0)
    p, q = target[0], drafted[0]
    expected = multidraft.rejection_kept(p, q, 4)
    generator, rng = torch.Generator().manual_seed(0), np.random.default_rng(0)
    counts, samples = np.zeros(len(p)), 40_000
    pt, qt = torch.from_numpy(p), torch.from_numpy(q).expand(4, -1)
    for _ in range(samples):
        tokens = rng.choice(len(p), size=4, p=q).tolist()
        kept, token = rejection_level(pt, [0, 1, 2, 3], Draft(tokens, qt, [-1] * 4), qt, generator)
        if kept is not None:
            counts[token] += 1
    assert np.all(np.abs(counts / samples - expected) < 5 * np.sqrt(expected / samples) + 1e-4)


def test_optimal_md_reaches_the_optimum_which_bounds_every_verifier(tmp_path):
    results = multidraft.measure_multidraft(multidraft.resolve_settings(out=str(tmp_path), temperatures="0.8,1.5"))
    for cell in results["cells"]:
        optimum = cell["optimum_node_acceptance"]
        assert cell["optimal-md"]["node_acceptance"] == pytest.approx(optimum, abs=1e-7)
        for verifier in ("rejection", "spectr"):
            assert cell[verifier]["node_acceptance"] <= optimum + 1e-9
            assert cell[verifier]["tokens_per_step"] <= cell["optimal-md"]["tokens_per_step"] + 1e-9
        if cell["drafts"] == 1:  # one draft: all three are speculative sampling
            assert cell["rejection"] == pytest.approx(cell["spectr"]) and cell["rejection"]["node_acceptance"] == (
                pytest.approx(optimum)
            )
    assert json.loads((tmp_path / "results.json").read_text())["cells"] == results["cells"]
    assert "| 4 | 1.5 |" in (tmp_path / "results.md").read_text()


def test_the_command_writes_the_table_and_refuses_bad_flags(tmp_path, capsys):
    flags = ["--drafts", "2", "--temperatures", "1.0", "--vocab", "5", "--depth", "2", "--out", str(tmp_path)]
    assert main(["bench", "multidraft", *flags]) == 0
    assert "| 2 | 1 |" in capsys.readouterr().out
    assert main(["bench", "multidraft", "--temperatures", "hot", "--out", str(tmp_path)]) == 2
    assert main(["bench", "multidraft", "--drafts", "0", "--out", str(tmp_path)]) == 2
    assert main(["bench", "multidraft", "--noise", "-1", "--out", str(tmp_path)]) == 2
    assert "--noise must be a number >= 0" in capsys.readouterr().err


def test_with_a_model_flags_of_the_toy_are_refused_and_the_tree_is_full(capsys, tmp_path):
    out = ["--out", str(tmp_path)]
    assert main(["bench", "--model", "smollm2-135m", "multidraft", "--vocab", "5", *out]) == 2
    assert "unknown setting(s): vocab" in capsys.readouterr().err
    assert main(["bench", "multidraft", "--trials", "3", *out]) == 2  # --trials is for --model
    assert main(["bench", "--model", "smollm2-135m", "multidraft", "--trials", "0", *out]) == 2
    assert "--trials must be a positive integer" in capsys.readouterr().err
    assert multidraft_prompts.tree_nodes(4, 3) == 4 + 16 + 64


@pytest.mark.real_model
def test_on_real_prompts_every_verifier_is_judged_on_the_same_steps(tmp_path):
    """The shipped EAGLE head drafts 2 i.i.d. tokens per node on smollm2-135m; each step is judged by all three."""
    settings = multidraft_prompts.resolve_settings(
        model="smollm2-135m", tasks="mt-bench,humaneval", max_new_tokens=12, drafts="2", depth=2, trials=4,
        out=str(tmp_path),
    )  # fmt: skip
    results = multidraft_prompts.measure_prompt_multidraft(settings, progress=False)
    (cell,) = results["cells"]
    assert cell["steps"] > 0 and cell["tokens"] >= 12
    for verifier in multidraft.VERIFIERS:
        assert 1.0 <= cell[verifier]["tokens_per_step"] <= 3.0
        assert cell["root_acceptance"][verifier] <= cell["root_acceptance"]["optimum"] + 1e-9
    assert "| 2 | 0.8 |" in (tmp_path / "results.md").read_text()


def test_a_first_node_s_acceptances_are_bounded_by_the_optimum_which_optimal_md_reaches_on_a_small_vocabulary():
    settings = multidraft.resolve_settings(out="unused")
    target, drafted = multidraft.toy_tables(settings, temperature=0.8)
    for p, q in zip(target, drafted):
        found = multidraft_prompts.root_acceptance(p, q, 4)
        assert found["optimal-md"] == pytest.approx(found["optimum"], abs=1e-7)
        assert found["rejection"] <= found["spectr"] + 1e-9 <= found["optimum"] + 2e-9
