"""Batched decoding: every sequence of a batch gets exactly its solo output, whatever the others draft;
requests join and leave between steps; the batch-aware draft length drafts less as the batch grows."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import fixed_depth_engine, random_eagle_head, untrained_drafter_options
from specdecode import batch_plan
from specdecode.batch_engine import BatchEngine, BatchRequest
from specdecode.batch_plan import plan_batch
from specdecode.cli import main
from specdecode.config import GenerationConfig
from specdecode.draft_length.base import FixedLength
from specdecode.draft_length.cost_model import CostModel
from specdecode.draft_length.sequence import CostModelLength
from specdecode.drafters import available_drafters, create_drafter, drafter_class
from specdecode.engine import speculative_decode
from specdecode.errors import SpecDecodeError
from specdecode.generator import SpeculativeGenerator
from specdecode.heads.medusa import heads_for_target
from specdecode.models.cost import VerificationCosts, linear_curve
from specdecode.models.loading import load_model
from specdecode.models.quantize import quantize_supported

REPEATS = [12, 13, 14, 12, 13, 14, 12, 13]
BATCH_PROMPTS = [
    [7],  # one token
    [5, 17, 22, 9, 30, 41],
    REPEATS,  # repetitive: copying drafters find matches
    list(range(3, 60)) + list(range(3, 40)),  # long and grounded
    [1, 6, 9, 8, 7, 2, 1, 5, 8, 9, 10, 2, 1, 5, 8],  # chat-like, with </s> (2) inside the prompt
    [44, 45, 46, 47, 44, 45, 46],
    [30, 31] * 6,
    [88, 3, 71],
]
MAX_NEW = [24, 40, 33, 17, 40, 8, 29, 40]


def batch_drafters(target, draft):
    """Every registered drafter; the trained ones with untrained weights (greedy output is exact whatever
    they draft)."""
    options = untrained_drafter_options(target, draft, draft_vocab=48, exit_layer=1)
    return {name: create_drafter(name, target, **options.get(name, {})) for name in available_drafters()}


def solo(target, prompt, config, eos):
    drafter = create_drafter("none", target)
    return [t for chunk in speculative_decode(target.backend, drafter, prompt, config, eos) for t in chunk]


def run_batch(target, drafter, requests, eos, batch_size, num_draft_tokens):
    policies = {}

    def policy_for(config, drafter):
        from specdecode.draft_length.factory import make_policy

        return policies.setdefault(config.num_draft_tokens, make_policy(config.num_draft_tokens))

    engine = BatchEngine(target.backend, drafter, policy_for, eos, batch_size)
    for index, (prompt, config) in enumerate(requests):
        engine.submit(BatchRequest(prompt, config, tag=index))
    outputs: dict[int, list[int]] = {index: [] for index in range(len(requests))}
    finished = set()
    for event in engine.run():
        outputs[event.tag].extend(event.new_tokens)
        if event.finished:
            finished.add(event.tag)
        assert engine.pool.active == len(engine.running)  # a finished sequence's slot is free at once
    assert finished == set(outputs)
    return outputs


@pytest.mark.parametrize("k", [3, "auto"])
def test_every_drafter_gives_each_sequence_its_solo_greedy_output(tiny_target, tiny_draft, k):
    # An EOS that one sequence hits early (and maybe others too): solo runs stop at it the same way.
    eos = frozenset({solo(tiny_target, BATCH_PROMPTS[1], GenerationConfig(max_new_tokens=40), frozenset())[6]})
    requests = [
        (prompt, GenerationConfig(max_new_tokens=n, num_draft_tokens=k)) for prompt, n in zip(BATCH_PROMPTS, MAX_NEW)
    ]
    expected = [solo(tiny_target, prompt, config, eos) for prompt, config in requests]
    assert any(len(out) < config.max_new_tokens for out, (_, config) in zip(expected, requests))  # EOS was hit
    for name, drafter in batch_drafters(tiny_target, tiny_draft).items():
        outputs = run_batch(tiny_target, drafter, requests, eos, batch_size=8, num_draft_tokens=k)
        for index, want in enumerate(expected):
            assert outputs[index] == want, f"{name} (k={k}): sequence {index} differs from its solo output"


@pytest.mark.skipif(not quantize_supported("bf16"), reason="this CPU has no oneDNN bf16 matmul")
def test_trees_of_a_batch_on_a_bf16_target_give_each_sequence_its_solo_output(tiny_dirs):
    """A bf16 target verifies rows row-invariantly, trees path by path (``TreePlan``), each sequence in its own
    slot: in a batch every sequence must still get exactly its solo plain output, prompts on either side of the
    64-key bucket included."""
    target = load_model(str(tiny_dirs["target"]), quantize="bf16")
    backend = target.backend
    drafters = {
        "eagle": create_drafter("eagle", target, head=random_eagle_head(backend, 48)),
        "hydra": create_drafter("hydra", target, heads=heads_for_target(backend, "hydra", 3, torch.arange(48))),
        "pld": create_drafter("pld", target),
    }
    prompts = [*BATCH_PROMPTS, list(range(3, 61)), list(range(5, 64))]  # 58 and 59 tokens: trees cross 64
    requests = [
        (prompt, GenerationConfig(max_new_tokens=n, num_draft_tokens="auto"))
        for prompt, n in zip(prompts, [*MAX_NEW, 24, 24])
    ]
    expected = [solo(target, prompt, config, frozenset()) for prompt, config in requests]
    for name, drafter in drafters.items():
        outputs = run_batch(target, drafter, requests, frozenset(), batch_size=4, num_draft_tokens="auto")
        for index, want in enumerate(expected):
            assert outputs[index] == want, f"{name}: sequence {index} differs from its solo output"


def test_requests_join_and_leave_between_steps(tiny_target):
    requests = [
        (prompt, GenerationConfig(max_new_tokens=n, ignore_eos=True)) for prompt, n in zip(BATCH_PROMPTS, MAX_NEW)
    ]
    expected = [solo(tiny_target, prompt, config, frozenset()) for prompt, config in requests]
    outputs = run_batch(tiny_target, create_drafter("suffix", tiny_target), requests, frozenset(), 3, "auto")
    assert [outputs[i] for i in range(len(requests))] == expected


def test_cancel_frees_the_slot_and_the_rest_complete(tiny_target):
    engine = fixed_depth_engine(tiny_target, "pld", 3)
    config = GenerationConfig(max_new_tokens=30, ignore_eos=True)
    for index, prompt in enumerate(BATCH_PROMPTS[:4]):
        engine.submit(BatchRequest(prompt, config, tag=index))
    engine.step()
    assert engine.pool.active == 4
    assert engine.cancel(2) and engine.pool.active == 3
    assert not engine.cancel(2)
    done = {event.tag: event.sequence.generated for event in engine.run() if event.finished}
    assert set(done) == {0, 1, 3}
    assert done[1] == solo(tiny_target, BATCH_PROMPTS[1], config, frozenset())
    assert engine.pool.active == 0


def test_generate_batch_keeps_input_order_and_reports_bad_prompts_in_place(tiny_target):
    generator = SpeculativeGenerator.build(tiny_target, "pld")
    prompts = ["w1 w2 w3 w4 w1 w2 w3", "", "w9 w10 w11", [5, 17, 22]]
    results = generator.generate_batch(prompts, max_new_tokens=16, ignore_eos=True, batch_size=2)
    assert isinstance(results[1], SpecDecodeError)
    for prompt, result in zip(prompts, results):
        if prompt:
            assert result.token_ids == generator.generate(prompt, max_new_tokens=16, ignore_eos=True).token_ids
    assert results[3].stats.new_tokens == 16


def test_batch_stop_strings_cut_each_sequence(tiny_target):
    generator = SpeculativeGenerator.build(tiny_target, "pld")
    full = generator.generate("w1 w2 w3 w4 w1 w2 w3", max_new_tokens=30, ignore_eos=True)
    stop = " ".join(full.text.split()[4:6])
    cut, other = generator.generate_batch(
        ["w1 w2 w3 w4 w1 w2 w3", "w9 w10"], max_new_tokens=30, ignore_eos=True, stop=[stop]
    )
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.index(stop)]
    assert other.text == generator.generate("w9 w10", max_new_tokens=30, ignore_eos=True, stop=[stop]).text


def test_cli_batch_prints_one_line_per_prompt_in_order_and_names_bad_lines(tiny_dirs, tmp_path, capsys):
    path = tmp_path / "prompts.jsonl"
    lines = [
        {"prompt": "w1 w2 w3 w4 w1 w2 w3", "max_new_tokens": 5},
        "not json",
        {"messages": [{"role": "user", "content": "w5 w6"}]},
        {"prompt": "w7", "temperature": -1},
        {"prompt": "w8 w9", "colour": "blue"},
    ]
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    code = main(
        [
            "batch",
            str(path),
            "--model",
            str(tiny_dirs["target"]),
            "--json",
            "--max-new-tokens",
            "7",
            "--ignore-eos",
            "--batch-size",
            "2",
        ]
    )
    captured = capsys.readouterr()
    rows = [json.loads(line) for line in captured.out.splitlines()]
    assert code == 2
    assert [row["index"] for row in rows] == [0, 1, 2, 3, 4]
    assert len(rows[0]["token_ids"]) == 5 and len(rows[2]["token_ids"]) == 7
    assert rows[1]["error"].startswith("line 2: not valid JSON")
    assert "line 4" in rows[3]["error"] and "temperature" in rows[3]["error"]
    assert "line 5" in rows[4]["error"] and "colour" in rows[4]["error"]
    assert "Traceback" not in captured.err and captured.err.count("specdecode: error: line") == 3


def test_cli_batch_without_prompts_is_one_clean_error(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert main(["batch", str(empty)]) == 2
    assert main(["batch", str(tmp_path / "missing.jsonl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("specdecode: error:") for line in err)


def _trained_auto(acceptance: float) -> CostModel:
    policy = CostModel(curve=VerificationCosts.of(linear_curve(1.3, widths=16)))
    policy.acceptance_after[False] = []
    policy.prior_acceptance = acceptance
    return policy


def test_auto_drafts_less_per_sequence_as_the_batch_grows():
    shared = _trained_auto(0.8)
    depths = {b: plan_batch([shared.fork() for _ in range(b)], [16] * b) for b in (1, 2, 4, 8, 16)}
    per_sequence = {b: sum(d) / b for b, d in depths.items()}
    assert per_sequence[1] >= per_sequence[4] >= per_sequence[16]
    assert per_sequence[1] > per_sequence[16]
    assert depths[1][0] == shared.fork().next_length(16)  # one sequence: the solo choice


def test_plan_batch_gives_more_depth_to_the_likelier_sequence():
    confident, doubtful = _trained_auto(0.9).fork(), _trained_auto(0.3).fork()
    doubtful.acceptance_after = confident.acceptance_after = {True: [], False: []}
    doubtful.model.prior_acceptance = 0.3
    depths = plan_batch([confident, doubtful, FixedLength(2)], [16, 16, 16])
    assert depths[0] > depths[1] and depths[2] == 2
    assert plan_batch([confident, doubtful], [0, 0]) == [0, 0]


def test_plan_batch_weighs_drafts_already_proposed_by_their_confidences(monkeypatch):
    # Same sequence history: only the drafts differ.  A sure copy is verified deeper than a doubtful guess;
    # an empty draft costs nothing, and no draft is planned deeper than it is.
    monkeypatch.setattr(batch_plan, "STEP_COST_SLACK", 0.15)  # room for several drafted tokens
    shared = _trained_auto(0.6)
    policies = [shared.fork() for _ in range(4)]
    sure, guess, empty, short = [0.95] * 12, [0.15] * 12, [], [0.95] * 2
    depths = plan_batch(policies, [16] * 4, [sure, guess, empty, short])
    assert depths[0] > depths[1] and depths[0] > 2
    assert depths[2] == 0 and depths[3] <= 2
    assert plan_batch([shared.fork() for _ in range(2)], [16] * 2, [short, guess])[0] == 2
    # One sequence alone chooses the same way; the limit still binds.
    (alone_sure,) = plan_batch([shared.fork()], [16], [sure])
    (alone_guess,) = plan_batch([shared.fork()], [16], [guess])
    assert alone_sure > alone_guess and alone_sure <= len(sure)
    assert plan_batch([shared.fork()], [3], [sure]) == [3]


def test_a_batch_of_untimed_context_readers_drafts_shallow_like_one_alone():
    # Confidence drafters whose first forward read the prompt: before their cost is timed, the plan asks at
    # most UNTIMED_DEPTH of them in a batch, as next_length does for one sequence.
    shared = _trained_auto(0.9)
    shared.reads_context = True

    def readers(count: int) -> list[CostModelLength]:
        forks = [shared.fork() for _ in range(count)]
        for fork in forks:
            fork.uses_confidence = True
        return forks

    assert readers(1)[0].next_length(16) == 2
    assert max(plan_batch(readers(4), [16] * 4)) <= 2
    shared.draft_cost.add(2, 0.002)
    shared.draft_cost.add(2, 0.002)
    assert max(plan_batch(readers(4), [16] * 4)) > 2


def test_drafters_never_import_the_transformers_backend():
    from pathlib import Path

    import specdecode.drafters

    folder = Path(specdecode.drafters.__file__).parent
    for path in folder.glob("*.py"):
        imports = [line for line in path.read_text().splitlines() if line.startswith(("import ", "from "))]
        assert not [line for line in imports if "models.hf" in line or "verify" in line], path.name
    assert drafter_class("layer-skip")  # the registry still finds them all
