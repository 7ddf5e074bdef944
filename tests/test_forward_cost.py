"""The forward-cost benchmark reports the agreed JSON shape and leaves the backend usable (no timing checks)."""

from __future__ import annotations

import json

import pytest

from specdecode.bench.forward_cost import ForwardCost, format_curve, measure_forward_cost, profile_forward
from specdecode.models.cpu_kernels import cpu_kernels_built
from specdecode.models.fastpath import apply_cpu_fast_path, fast_path_supported
from specdecode.models.hf import HFCausalLM
from tiny_models import TINY_CONTEXT, tiny_llama


@pytest.fixture(scope="module")
def backend() -> HFCausalLM:
    return HFCausalLM(tiny_llama(seed=0), "tiny-llama")


def test_json_has_exactly_the_agreed_keys(backend):
    cost = measure_forward_cost(backend, context_tokens=32, repeats=1, warmup=0)
    data = json.loads(json.dumps(cost.to_json()))
    assert set(data) == {"model", "t_ms", "ratio_8_1"}
    assert data["model"] == "tiny-llama"
    assert list(data["t_ms"]) == [str(n) for n in range(1, 17)]
    assert all(isinstance(t, float) and t > 0 for t in data["t_ms"].values())
    assert isinstance(data["ratio_8_1"], float) and data["ratio_8_1"] > 0
    assert cost.ratio_8_1 == pytest.approx(cost.t_ms["8"] / cost.t_ms["1"])


@pytest.mark.skipif(not fast_path_supported(), reason="torch build without oneDNN linear ops")
def test_runs_on_the_fast_path():
    model = tiny_llama(seed=0, layers=1)
    apply_cpu_fast_path(model)
    cost = measure_forward_cost(HFCausalLM(model, "fast"), context_tokens=8, max_new=8, repeats=2, warmup=1)
    assert list(cost.t_ms) == [str(n) for n in range(1, 9)]
    assert cost.ratio_8_1 > 0


def test_format_curve_lists_every_point():
    cost = ForwardCost(model="m", t_ms={str(n): 10.0 + n for n in range(1, 17)}, ratio_8_1=18 / 11)
    text = format_curve(cost)
    assert "m" in text.splitlines()[0]
    assert len(text.splitlines()) == 16 + 3
    assert "1.64" in text.splitlines()[-1]


def test_rejects_impossible_requests(backend):
    with pytest.raises(ValueError, match="context"):
        measure_forward_cost(backend, context_tokens=TINY_CONTEXT - 8, max_new=16)
    with pytest.raises(ValueError, match="8"):
        measure_forward_cost(backend, context_tokens=8, max_new=4)


def test_profile_is_a_table_of_operators(backend):
    text = profile_forward(backend, n_new=4, context_tokens=16)
    assert "tiny-llama" in text.splitlines()[0]
    assert "Self CPU" in text
    assert "aten::" in text


def test_relative_cost_curve_is_normalised_monotone_and_measured_once(backend, monkeypatch):
    from specdecode.models.cost import relative_cost_curve

    curve = relative_cost_curve(backend, widths=12, repeats=1)
    assert len(curve) == 12 and curve[0] == 1.0
    assert all(later >= earlier for earlier, later in zip(curve, curve[1:]))
    monkeypatch.setattr(backend, "forward", None)  # a second call must not run the model again
    assert relative_cost_curve(backend, widths=12) is curve


def test_monotone_fit_keeps_a_staircase_and_pools_only_what_decreases():
    from specdecode.models.cost import monotone_fit

    staircase = [1.0, 1.08, 1.12, 1.25, 2.18, 2.18, 2.2, 2.3]  # int4's blocks of 4 rows
    assert monotone_fit(staircase) == staircase
    assert monotone_fit([1.0, 1.3, 1.1, 1.2]) == pytest.approx([1.0, 1.2, 1.2, 1.2])
    assert monotone_fit([2.0, 1.0]) == pytest.approx([1.5, 1.5])


def test_a_measured_curve_is_kept_on_disk_for_the_next_process_on_this_machine(tmp_path, monkeypatch):
    """Another backend of the same structure reads the curve instead of measuring it; another thread count,
    another structure or an unreadable file measures again."""
    import torch

    from specdecode.models import cost

    monkeypatch.setenv("SPECDECODE_COST_CURVES", str(tmp_path / "curves.json"))
    monkeypatch.setattr(cost.OthersLoad, "busy", property(lambda self: False))  # kept even on a loaded test machine
    first = cost.relative_cost_curve(HFCausalLM(tiny_llama(seed=0), "a"))
    assert json.loads((tmp_path / "curves.json").read_text())

    def no_forwards(*args, **kwargs):
        raise AssertionError("measured although a curve was saved")

    with monkeypatch.context() as patch:
        patch.setattr(cost, "timed_rounds", no_forwards)
        assert cost.relative_cost_curve(HFCausalLM(tiny_llama(seed=1), "b")) == first  # other weights, same shapes
    measured = []
    monkeypatch.setattr(cost, "timed_rounds", lambda *a, **k: measured.append(1) or {w: [w] for w in range(1, 17)})
    previous = torch.get_num_threads()
    torch.set_num_threads(previous + 1)
    try:
        cost.relative_cost_curve(HFCausalLM(tiny_llama(seed=0), "c"))
    finally:
        torch.set_num_threads(previous)
    cost.relative_cost_curve(HFCausalLM(tiny_llama(seed=0, layers=1), "d"))
    (tmp_path / "curves.json").write_text("{not json")
    assert cost.relative_cost_curve(HFCausalLM(tiny_llama(seed=0), "e")) == tuple(float(w) for w in range(1, 17))
    assert len(measured) == 3


@pytest.mark.skipif(not cpu_kernels_built(), reason="the CPU kernels do not build here")
def test_changed_cpu_kernels_are_timed_anew(monkeypatch):
    """A curve measured with other sources of our CPU kernels (an upgrade that made a forward cheaper) is not read."""
    from specdecode.models import cost

    model = tiny_llama(seed=0, layers=1)
    before = cost.machine_and_model_key(model, "settings")
    assert cost.machine_and_model_key(model, "settings") == before
    monkeypatch.setattr(cost, "kernels_source_digest", lambda: "other kernels")
    assert cost.machine_and_model_key(model, "settings") != before


@pytest.mark.parametrize(("others_cpu_s", "busy"), [(0.01, False), (0.3, True)])
def test_others_load_is_the_share_of_the_cpus_other_processes_kept_busy(monkeypatch, others_cpu_s, busy):
    import time

    from specdecode import threads
    from specdecode.models import cost

    readings = iter([100.0, 100.0 + others_cpu_s])  # busy CPU seconds of our two CPUs
    monkeypatch.setattr(threads, "process_cpus", lambda: [0, 1])
    monkeypatch.setattr(
        threads, "sample_cpus", lambda cpus, when: threads.CpuSample(when, next(readings), time.process_time())
    )
    with cost.OthersLoad() as others:
        time.sleep(0.2)  # this process spends (almost) no CPU time meanwhile
    assert others.busy == busy and others.share == pytest.approx(others_cpu_s / 0.4, rel=0.25, abs=0.02)


def test_a_curve_timed_while_the_machine_was_busy_serves_this_process_but_is_not_kept(tmp_path, monkeypatch):
    from specdecode.models import cost

    monkeypatch.setenv("SPECDECODE_COST_CURVES", str(tmp_path / "curves.json"))
    monkeypatch.setattr(cost.OthersLoad, "busy", property(lambda self: True))
    assert cost.relative_cost_curve(HFCausalLM(tiny_llama(seed=0), "a"))
    assert not (tmp_path / "curves.json").exists()


def test_verification_costs_read_between_the_contexts_measured_and_at_the_nearest_beyond():
    from specdecode.models.cost import VerificationCosts

    costs = VerificationCosts({128: (2.0, 2.2, 2.4), 4096: (1.0, 1.3, 1.6)})
    assert costs.base == pytest.approx((1.0, 1.1, 1.2))  # normalised to one input
    assert costs.relative(3) == costs.relative(3, 100) == pytest.approx(1.2)
    assert costs.relative(3, 2112) == pytest.approx(1.4)  # halfway between 128 and 4,096 tokens
    assert costs.relative(3, 9000) == pytest.approx(1.6)
    assert costs.relative(5, 4096) == pytest.approx(2.2)  # past the curve: extrapolated along it


def test_verification_costs_measure_a_long_context_once_at_its_power_of_two_and_only_when_prepared():
    from specdecode.models.cost import LONG_CONTEXT_TOKENS, VerificationCosts

    asked = []

    def measure(context_tokens):
        asked.append(context_tokens)
        return None if context_tokens > 4096 else (1.0, 1.5)

    costs = VerificationCosts({128: (1.0, 1.1)}, measure)
    assert costs.relative(2, 3000) == pytest.approx(1.1) and asked == []  # pricing never measures
    costs.prepare(LONG_CONTEXT_TOKENS - 1)
    assert asked == []  # a short context keeps the short curve
    costs.prepare(3000)
    costs.prepare(2500)
    assert asked == [2048] and costs.relative(2, 3000) == pytest.approx(1.5)
    costs.prepare(5000)  # too long for the model to measure on: priced at the longest measured
    assert asked == [2048, 4096] and costs.relative(2, 5000) == pytest.approx(1.5)


@pytest.mark.parametrize(
    ("drafter", "draft_length", "measured"),
    [("pld", "auto", [128, 1024]), ("pld", 3, [128, 1024]), ("none", 3, [])],
)
def test_a_long_prompt_has_its_contexts_curve_measured_on_the_target(tiny_target, drafter, draft_length, measured):
    """The engine tells the policy the prompt's length before the first step; the policy measures the curve of
    that context once, on the target itself, and decoding is unchanged (== plain).  Tree drafters size their trees
    by that curve whatever the draft length, so a fixed length has it measured as ``auto`` does; plain decoding (the
    control) measures nothing."""
    from specdecode.generator import SpeculativeGenerator
    from specdecode.models.cost import _CURVES
    from specdecode.models.loading import LoadedModel

    backend = HFCausalLM(tiny_llama(seed=0, layers=1, hidden=32, context=1200), "tiny-long")
    target = LoadedModel("tiny-long", backend, tiny_target.tokenizer)
    prompt = [3 + (i * 7) % 50 for i in range(1100)]
    decoded = SpeculativeGenerator.build(target, drafter).generate(
        prompt, max_new_tokens=12, num_draft_tokens=draft_length
    )
    assert sorted(_CURVES.get(backend, {})) == measured
    plain = SpeculativeGenerator.build(target, "none").generate(prompt, max_new_tokens=12)
    assert decoded.token_ids == plain.token_ids
