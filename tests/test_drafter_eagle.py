"""The EAGLE head and drafter: hidden states out of the target, greedy equality for any head weights
(trees, chains, batches), training that matches drafting, storage round trips, and exact sampling."""

from __future__ import annotations

import json

import pytest
import torch

import specdecode.drafters.eagle
from helpers import (
    DRAWS,
    FAIL_P,
    PROMPTS,
    BigramFeatures,
    V,
    assert_batched_greedy_is_solo,
    assert_head_drafter_samples_exactly,
    assert_one_line_error,
    check_own_token_figures,
    head_drafter_pvalues,
    hf_greedy,
    random_eagle_head,
    run,
)
from specdecode.drafters import create_drafter
from specdecode.drafters.base import DraftRequest
from specdecode.drafters.eagle import EagleDrafter
from specdecode.errors import SpecDecodeError
from specdecode.heads.eagle import HeadCache
from specdecode.heads.storage import load_eagle, save_eagle
from specdecode.models.loading import LoadedModel
from specdecode.sampling_params import SamplingParams
from specdecode.train.eagle import compute_features, make_windows, unrolled_logits


def test_target_hands_out_hidden_states_of_any_layer(tiny_target):
    backend = tiny_target.backend
    tokens = torch.tensor(PROMPTS[0])
    layers = (0, backend.num_layers)
    out = backend.forward(tokens, backend.new_cache(), hidden_layers=layers)
    width = backend.hidden_size
    assert out.hidden.shape == (len(tokens), 2 * width)
    torch.testing.assert_close(out.hidden[:, :width], backend.embed(tokens))
    final = backend.forward_layers(tokens, backend.new_cache(), output_hidden=True).hidden
    torch.testing.assert_close(out.hidden[:, width:], final)
    # In a batch each sequence gets its own rows, as alone.
    other = torch.tensor(PROMPTS[1])
    batch_pool = backend.new_pool()
    from specdecode.models.base import SequenceInput

    outs = backend.forward_batch(
        [SequenceInput(tokens, batch_pool.allocate(), hidden_layers=(1,)), SequenceInput(other, batch_pool.allocate())]
    )
    alone = backend.forward(tokens, backend.new_cache(), hidden_layers=(1,))
    assert outs[1].hidden is None
    torch.testing.assert_close(outs[0].hidden, alone.hidden, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tree_nodes", [0, 10, "auto"])
@pytest.mark.parametrize("draft_length", [3, "auto"])
def test_greedy_output_is_plain_greedy_for_any_head(tiny_target, trained_head, tree_nodes, draft_length):
    for head in (random_eagle_head(tiny_target.backend, 40), trained_head):
        drafter = create_drafter("eagle", tiny_target, head=head, tree_nodes=tree_nodes)
        for prompt in PROMPTS:
            tokens, _ = run(tiny_target, drafter, prompt, max_new_tokens=24, num_draft_tokens=draft_length)
            assert tokens == hf_greedy(tiny_target, prompt, 24)


def test_trained_head_gets_drafts_accepted(tiny_target, trained_head):
    """The head's own drafts (the lookup off: it would help either head)."""
    drafter = create_drafter("eagle", tiny_target, head=trained_head, tree_nodes=10, lookup=False)
    accepted = 0
    for prompt in PROMPTS[:2]:
        _, outcome = run(tiny_target, drafter, prompt, max_new_tokens=24, num_draft_tokens=4)
        accepted += outcome.stats.accepted_tokens
    untrained_head = random_eagle_head(tiny_target.backend, 64)
    untrained = create_drafter("eagle", tiny_target, head=untrained_head, tree_nodes=10, lookup=False)
    baseline = sum(
        run(tiny_target, untrained, p, max_new_tokens=24, num_draft_tokens=4)[1].stats.accepted_tokens
        for p in PROMPTS[:2]
    )
    assert accepted > baseline


def test_batched_greedy_equals_solo(tiny_target, trained_head):
    drafter = create_drafter("eagle", tiny_target, head=trained_head)
    assert_batched_greedy_is_solo(tiny_target, drafter, PROMPTS, batch_size=3)


def test_training_unroll_matches_drafting(tiny_target, trained_head):
    """The training-time-test attention sees exactly what a chain draft sees at inference: the logits of
    step k at row j equal a chain drafted from position j, fed the same tokens."""
    backend, head = tiny_target.backend, trained_head
    ids = PROMPTS[0] + hf_greedy(tiny_target, PROMPTS[0], 10)
    (features,) = compute_features(backend, [ids], head.config.aux_layers, progress=False)
    steps = 3
    windows = make_windows([features], window=32, steps=steps)
    with torch.no_grad():
        unrolled = unrolled_logits(head, backend.embed, windows.batch(torch.arange(windows.count)))
    for row in (0, 4, 7):
        cache = HeadCache(head.config, backend.device, backend.dtype)
        with torch.no_grad():
            pairs = head.fuse(features.aux[: row + 1])
            tokens = features.ids[1 : row + 2]
            out = head.extend(pairs, backend.embed(tokens), torch.arange(1, row + 2), cache)[-1]
            for step in range(steps):
                torch.testing.assert_close(head.logits(out), unrolled[step][0, row], rtol=1e-4, atol=1e-4)
                token = features.ids[row + 2 + step : row + 3 + step]
                out = head.extend(out[None], backend.embed(token), torch.tensor([row + 2 + step]), cache)[0]


def test_held_out_acceptance_on_the_targets_own_tokens_counts_the_rows_drafting_meets(tiny_target, trained_head):
    """A sequence the target wrote itself (greedy from its first token) is all own rows: both figures agree.  The
    control: random tokens, which the target would not have written, are almost never read as its own."""
    from specdecode.train.common import target_views
    from specdecode.train.eagle import held_out_acceptance

    backend, head = tiny_target.backend, trained_head
    _, layerwise = target_views(backend, "eagle")

    def measured(ids: list[int]):
        (features,) = compute_features(backend, [ids], head.config.aux_layers, progress=False)
        return held_out_acceptance(head, layerwise, backend.embed, make_windows([features], 16, 3), batch_windows=4)

    check_own_token_figures(tiny_target, measured)


def test_training_can_start_from_a_trained_head(tiny_target, tiny_draft, trained_head):
    """``train eagle --init DIR``: the run starts from that head's weights and keeps its draft vocabulary (with a
    zero learning rate it ends where it started); a head for another target is refused."""
    from specdecode.heads.eagle import default_aux_layers
    from specdecode.train.eagle import EagleTrainConfig, train_eagle, weights_digest

    backend = tiny_target.backend
    sequences = [[5, 17, 22, 9, *hf_greedy(tiny_target, [5, 17, 22, 9], 24)], [7, *hf_greedy(tiny_target, [7], 24)]]
    features = compute_features(backend, sequences, default_aux_layers(backend.num_layers), progress=False)
    config = EagleTrainConfig(epochs=1, window=16, batch_windows=2, lr=0.0, draft_vocab=8, holdout=0.5)
    result = train_eagle(backend, features, config, initial=trained_head)
    assert torch.equal(result.head.target_ids, trained_head.target_ids)  # not 8 tokens: the head's own 64
    assert weights_digest(result.head) == weights_digest(trained_head)
    with pytest.raises(SpecDecodeError, match="the head to start from is for a target"):
        train_eagle(backend, features, config, initial=random_eagle_head(tiny_draft.backend, 48))


def test_train_eagle_refuses_an_init_directory_without_a_head_before_loading_anything(capsys, tmp_path):
    assert_one_line_error(capsys, ["train", "eagle", "--init", str(tmp_path)], "no EAGLE head there")


def test_head_round_trips_through_the_speculators_layout(tiny_target, trained_head, tmp_path):
    save_eagle(trained_head, tmp_path / "head", verifier="tiny")
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["draft_vocab_size"] == 64
    loaded = load_eagle(tmp_path / "head")
    drafts = []
    for head in (trained_head, loaded):
        drafter = create_drafter("eagle", tiny_target, head=head)
        tokens, outcome = run(tiny_target, drafter, PROMPTS[0], max_new_tokens=12, num_draft_tokens=4)
        stats = outcome.stats
        drafts.append((tokens, stats.drafted_tokens, stats.accepted_tokens, stats.acceptance_by_position))
    assert drafts[0] == drafts[1]
    for name, value in trained_head.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[name]), name


def test_a_tampered_head_is_refused(trained_head, tmp_path):
    save_eagle(trained_head, tmp_path / "head", verifier="tiny")
    (tmp_path / "head" / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(SpecDecodeError, match="SHA-256"):
        load_eagle(tmp_path / "head")


def test_missing_or_mismatched_head_gives_clear_errors(tiny_target, tiny_draft, tmp_path):
    with pytest.raises(SpecDecodeError, match="specdecode train eagle"):
        create_drafter("eagle", tiny_target, head=str(tmp_path / "nowhere"))
    other = random_eagle_head(tiny_draft.backend, 16)  # the tiny draft model has another depth
    with pytest.raises(SpecDecodeError, match="the head is for a target"):
        create_drafter("eagle", tiny_target, head=other)
    with pytest.raises(SpecDecodeError, match="top-k"):
        create_drafter("eagle", tiny_target, head=random_eagle_head(tiny_target.backend, 16), top_k=0)


# -- exact sampling with a head, on a toy model whose distribution is known --------------------------


def test_sampling_with_a_head_reproduces_the_target_distribution():
    g = torch.Generator().manual_seed(3)
    table = 2.0 * torch.randn(V, V, generator=g)
    model = BigramFeatures(table)
    target = LoadedModel(name="bigram", backend=model, tokenizer=None)
    head = random_eagle_head(model, V - 1, seed=1)  # one token is never drafted: output must not change
    drafter = EagleDrafter(target, head=head)
    assert_head_drafter_samples_exactly(model, table, drafter, draws=DRAWS // 2)  # eagle drafts slowest


def bigram_eagle(**options) -> tuple[BigramFeatures, torch.Tensor, EagleDrafter]:
    g = torch.Generator().manual_seed(3)
    table = 2.0 * torch.randn(V, V, generator=g)
    model = BigramFeatures(table)
    target = LoadedModel(name="bigram", backend=model, tokenizer=None)
    head = random_eagle_head(model, V - 1, seed=1)  # one token is never drafted: output must not change
    return model, table, EagleDrafter(target, head=head, **options)


def test_iid_sampled_trees_reproduce_the_target_distribution():
    """``samples=2``: two i.i.d. draws under every node (a tree of 2 + 4 nodes), verified by ``spectr``, which reads
    such nodes with its own plan (recursive rejection sampling of i.i.d. siblings: tests/test_multidraft_verify.py)."""
    model, table, drafter = bigram_eagle(samples=2, tree_nodes=6)
    assert_head_drafter_samples_exactly(model, table, drafter, draws=DRAWS // 2, verifier="spectr")


def test_iid_siblings_share_one_distribution_row_and_fill_whole_levels():
    model, _, drafter = bigram_eagle(samples=3, tree_nodes=12)
    session = drafter.session(DraftRequest(prompt_ids=(0, 1), sampling=SamplingParams(temperature=0.9)))
    session.observe_prompt(torch.cat([model.vectors[[0]]] * len(session.hidden_layers), dim=-1))
    draft = session.propose([0, 1], max_tokens=4)
    assert draft.parents == [-1, -1, -1, 0, 0, 0, 1, 1, 1, 2, 2, 2]  # a third level (27 more) would not fit 12
    for first in range(0, 12, 3):
        assert all(torch.equal(draft.probs[first], draft.probs[first + i]) for i in (1, 2))


def test_a_sampled_tree_drawn_from_other_distributions_than_it_reports_fails_the_same_test(monkeypatch):
    """The control: the siblings are drawn from the head's distribution sharpened, but the draft reports the head's own
    (as a drafter would that forgot the temperature); the verifier then keeps too many likely tokens."""
    real = specdecode.drafters.eagle.iid_draws

    def from_sharpened(probs, samples, generator):
        return real(probs**2 / (probs**2).sum(-1, keepdim=True), samples, generator)

    monkeypatch.setattr(specdecode.drafters.eagle, "iid_draws", from_sharpened)
    model, table, drafter = bigram_eagle(samples=2, tree_nodes=6)
    assert min(head_drafter_pvalues(model, table, drafter, DRAWS // 4, "spectr")) < FAIL_P


def test_the_trainer_prints_both_held_out_figures(capsys, tmp_path):
    import argparse

    from specdecode.train.common import HeldOutAcceptance, TrainResult, report_training

    args = argparse.Namespace(model="m", out=None)
    own = TrainResult(rows=100, held_out_rows=40, acceptance=HeldOutAcceptance([0.5, 0.5], [0.25, 0.5], own_rows=30))
    report_training(args, own, "eagle head", 64, "drafting step", 1.0, tmp_path, "eagle", "head")
    printed = capsys.readouterr().out
    assert "top-1 acceptance per drafting step 50%, 50% (a greedy chain of 2 would average 0.75" in printed
    assert (
        "on the target's own tokens (30 held-out rows, as drafting meets them) 25%, 50% (a chain would average 0.38)"
        in printed
    )
