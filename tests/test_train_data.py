"""The training data every head starts from: batched self-distillation and the memory-lean EAGLE windows."""

from __future__ import annotations

import pytest
import torch

from helpers import hf_greedy
from specdecode.errors import SpecDecodeError
from specdecode.models.quantized_layers import bf16_matmul_supported
from specdecode.train import data
from specdecode.train.common import split_holdout
from specdecode.train.eagle import Features, compute_features, make_windows
from specdecode.train.features import feature_dtype, training_in_bf16
from specdecode.train.medusa import make_stream

PROMPTS = [[5, 17, 22, 9], [3, 8], [40, 41, 42, 43, 44, 45], [11, 12, 13], [30, 31, 7, 7, 7]]


def _greedy_until_eos(loaded, prompt: list[int], n: int) -> list[int]:
    answer = hf_greedy(loaded, prompt, n)
    eos = set(loaded.backend.eos_token_ids)
    for i, token in enumerate(answer):
        if token in eos:
            return answer[: i + 1]
    return answer


def test_self_distill_yields_each_greedy_answer_in_prompt_order(tiny_target, monkeypatch):
    """Answers are decoded in batches (two at a time here, so five prompts take three batches and finish
    out of order) yet come out in the prompts' order, each the target's own greedy continuation of its
    prompt cut to ``max_prompt_tokens``; ``skip`` resumes after the prompts already done."""
    monkeypatch.setattr(data, "DISTILL_BATCH", 2)
    got = list(data.self_distill(tiny_target, PROMPTS, new_tokens=10, max_prompt_tokens=5))
    assert len(got) == len(PROMPTS)
    for prompt, sequence in zip(PROMPTS, got, strict=True):
        kept = prompt[-5:]
        assert sequence[: len(kept)] == kept
        assert sequence[len(kept) :] == _greedy_until_eos(tiny_target, kept, 10)
    resumed = list(data.self_distill(tiny_target, PROMPTS, new_tokens=10, max_prompt_tokens=5, skip=3))
    assert resumed == got[3:]


def test_windows_keep_bf16_features_once_and_batches_read_them_in_fp32(tiny_target):
    """The windows index one copy of the features in their own dtype; a batch gathers the same rows in fp32
    as from fp32 features, padding rows zero and invalid."""
    backend = tiny_target.backend
    sequences = [
        PROMPTS[0] + hf_greedy(tiny_target, PROMPTS[0], 12),
        PROMPTS[1] + hf_greedy(tiny_target, PROMPTS[1], 5),
    ]
    fp32 = compute_features(backend, sequences, (1,), progress=False)
    bf16 = [Features(item.ids, item.aux.bfloat16(), item.final.bfloat16()) for item in fp32]
    lean = make_windows(bf16, window=8, steps=3)
    exact = make_windows(fp32, window=8, steps=3)
    assert lean.aux_rows.dtype == torch.bfloat16
    assert lean.final_rows.shape[0] == sum(len(s) for s in sequences) + 1
    everything = torch.arange(lean.count)
    batch, reference = lean.batch(everything), exact.batch(everything)
    assert batch.finals.dtype == torch.float32 and batch.aux.dtype == torch.float32
    torch.testing.assert_close(batch.finals, reference.finals.bfloat16().float())
    torch.testing.assert_close(batch.aux, reference.aux.bfloat16().float())
    assert torch.equal(batch.tokens, reference.tokens) and torch.equal(batch.valid, reference.valid)
    assert not batch.finals[~batch.valid].any()
    # Row j of the first sequence learns from the final hidden state read at j + 1 + step.
    torch.testing.assert_close(reference.finals[2, 0, 3], fp32[0].final[3 + 1 + 2])


def test_windows_spilled_to_files_read_as_the_ones_in_memory(tiny_target, tmp_path):
    """Rows kept in memory-mapped files (Qwen's data does not fit in memory twice) batch exactly as rows in
    memory, and the files are gone from the directory once mapped."""
    sequences = [PROMPTS[0] + hf_greedy(tiny_target, PROMPTS[0], 9), PROMPTS[2]]
    features = compute_features(tiny_target.backend, sequences, (1,), progress=False)
    spilled = make_windows(features, window=8, steps=2, spill=tmp_path / "rows")
    kept = make_windows(features, window=8, steps=2)
    assert list(tmp_path.iterdir()) == []
    everything = torch.arange(kept.count)
    got, want = spilled.batch(everything), kept.batch(everything)
    assert torch.equal(got.aux, want.aux) and torch.equal(got.finals, want.finals)


def test_heads_stream_spilled_to_a_file_keeps_the_features_precision(tiny_target, tmp_path):
    """Medusa's and Hydra's stream of final hidden states, kept in a memory-mapped file, holds what one kept in
    memory holds, in the features' own precision (bf16 is half the memory; batches read fp32), zero-padded."""
    sequences = [PROMPTS[0] + hf_greedy(tiny_target, PROMPTS[0], 9), PROMPTS[2]]
    features = [
        Features(f.ids, f.aux, f.final.to(torch.bfloat16))
        for f in compute_features(tiny_target.backend, sequences, (), progress=False)
    ]
    spilled = make_stream(features, heads=2, spill=tmp_path / "finals.bin")
    kept = make_stream(features, heads=2)
    assert list(tmp_path.iterdir()) == []
    assert spilled.finals.dtype == torch.bfloat16 and torch.equal(spilled.finals, kept.finals)
    rows = sum(len(s) for s in sequences)
    assert torch.equal(spilled.finals[:rows], torch.cat([f.final for f in features]))
    assert not spilled.finals[rows:].any() and spilled.rows == rows


def test_the_held_out_split_keeps_its_sequences_when_the_data_grows():
    """A sequence's side depends on its tokens alone: grown data (``--init`` on more conversations) keeps the first
    run's held-out sequences held out and its training sequences in training, equal sequences fall on one side, and
    tiny sets still hold out one and train on one."""
    sequences = [[i, i * 7 % 13, 3] for i in range(400)]
    first_train, first_held = split_holdout(sequences[:200], sequences[:200], 0.05, 0, "t")
    train, held = split_holdout(sequences, sequences, 0.05, 0, "t")
    assert 2 <= len(first_held) < 25 and 10 <= len(held) < 40
    assert {tuple(s) for s in first_held} <= {tuple(s) for s in held}
    assert {tuple(s) for s in first_train} <= {tuple(s) for s in train}
    assert sorted(map(tuple, train + held)) == sorted(map(tuple, sequences))
    twice = [[1, 2], [1, 2], [5], [6], [7]]
    train, held = split_holdout(twice, twice, 0.5, 0, "t")
    assert ([1, 2] in train) != ([1, 2] in held)
    for pair in ([[1], [2]], [[1, 2]]):
        train, held = split_holdout(pair, pair, 0.05, 0, "t")
        assert train and held and (len(pair) == 1 or not set(map(tuple, train)) & set(map(tuple, held)))
    with pytest.raises(SpecDecodeError, match="no training data"):
        split_holdout([], [], 0.05, 0, "t")


def test_feature_dtype_choices():
    assert feature_dtype("fp32") == torch.float32
    assert feature_dtype("bf16") == torch.bfloat16
    native = bf16_matmul_supported()
    assert feature_dtype("auto") == (torch.bfloat16 if native else torch.float32)
    assert training_in_bf16("auto") == native and not training_in_bf16("fp32") and training_in_bf16("bf16")


def test_bf16_training_learns_like_fp32(tiny_target):
    """Autocast training (bf16 matmuls, fp32 weights and losses) lowers the loss as fp32 training does."""
    from specdecode.heads.eagle import default_aux_layers
    from specdecode.train.eagle import EagleTrainConfig, train_eagle

    backend = tiny_target.backend
    sequences = [prompt + hf_greedy(tiny_target, prompt, 30) for prompt in PROMPTS]
    features = compute_features(backend, sequences, default_aux_layers(backend.num_layers), progress=False)
    losses = {}
    for bf16 in (False, True):
        config = EagleTrainConfig(epochs=6, window=16, batch_windows=2, lr=3e-3, draft_vocab=64, bf16=bf16)
        result = train_eagle(backend, features, config)
        assert all(p.dtype == torch.float32 for p in result.head.parameters())
        losses[bf16] = result.epoch_losses
    assert losses[True][-1] < 0.8 * losses[True][0]
    assert losses[True][-1] == pytest.approx(losses[False][-1], rel=0.2)
