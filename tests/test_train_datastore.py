"""``specdecode train datastore``: the model's own answers, written as a datastore ``rasd`` reads, resumable."""

from __future__ import annotations

import json

import pytest

from helpers import assert_one_line_error
from specdecode.cli import main
from specdecode.data.prompts import Prompt, Task
from specdecode.drafters import create_drafter
from specdecode.generator import SpeculativeGenerator
from specdecode.train.data import encode_user_prompt

TEXTS = ["w3 w4 w5", "w9", "w3 w4 w5", "w20 w21 w3", "w7 w7 w7 w8", "w11 w12", "w30 w31 w32 w33"]


@pytest.fixture
def sharegpt(monkeypatch):
    """ShareGPT's opening turns in the benchmark's order, as these texts (the third repeats the first)."""
    task = Task("sharegpt", "chat", [Prompt(f"s/{i}", text) for i, text in enumerate(TEXTS)])

    def load_task(name, n, seed):
        assert (name, seed) == ("sharegpt", 0)
        return Task(task.name, task.category, task.prompts[:n])

    monkeypatch.setattr("specdecode.train.datastore_run.load_task", load_task)


def written(path) -> list[str]:
    return [json.loads(line)["text"] for line in path.read_text().splitlines()]


def test_answers_are_the_models_greedy_answers_to_prompts_after_the_skipped(tiny_dirs, tiny_target, tmp_path, sharegpt):
    out = tmp_path / "answers.jsonl"
    argv = ["train", "datastore", "--model", str(tiny_dirs["target"]), "--skip", "1", "--answers", "5"]
    assert main([*argv, "--new-tokens", "6", "--out", str(out)]) == 0
    plain = SpeculativeGenerator.build(tiny_target, "none")
    expected = []
    for text in ["w9", "w20 w21 w3", "w7 w7 w7 w8", "w11 w12"]:  # the repeat of a skipped prompt left out
        answer = plain.generate(encode_user_prompt(tiny_target, text), max_new_tokens=6).token_ids
        expected.append(tiny_target.tokenizer.decode(answer, skip_special_tokens=True))
    assert written(out) == expected
    create_drafter("rasd", tiny_target, datastore=str(out))  # rasd reads it


def test_a_run_cut_short_resumes_after_its_whole_lines(tiny_dirs, tmp_path, sharegpt):
    def run(out, answers: int) -> None:
        argv = ["train", "datastore", "--model", str(tiny_dirs["target"]), "--skip", "0", "--answers", str(answers)]
        assert main([*argv, "--new-tokens", "6", "--out", str(out)]) == 0

    whole, cut = tmp_path / "whole.jsonl", tmp_path / "cut.jsonl"
    run(whole, 6)
    run(cut, 2)
    with cut.open("a") as file:
        file.write('{"text": "w1')  # a line cut off mid-write
    run(cut, 6)
    assert written(cut) == written(whole) and len(written(whole)) == 6
    before = cut.read_bytes()
    run(cut, 4)  # holds more than asked: nothing to do
    assert cut.read_bytes() == before


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--answers", "0"], "--answers must be positive"),
        (["--skip", "-1"], "--skip must be zero or more"),
        (["--new-tokens", "0"], "--new-tokens must be positive"),
    ],
)
def test_bad_input_is_a_one_line_error(capsys, tmp_path, flags, message):
    assert_one_line_error(capsys, ["train", "datastore", "--out", str(tmp_path / "a.jsonl"), *flags], message)


def test_no_prompt_left_after_the_skipped_is_a_one_line_error(capsys, tiny_dirs, tmp_path, sharegpt):
    argv = ["train", "datastore", "--model", str(tiny_dirs["target"]), "--skip", "7"]
    assert_one_line_error(capsys, [*argv, "--out", str(tmp_path / "a.jsonl")], "no ShareGPT prompts after the first 7")


def test_an_out_file_in_no_directory_is_a_one_line_error(capsys, tmp_path):
    assert_one_line_error(capsys, ["train", "datastore", "--out", str(tmp_path / "none" / "a.jsonl")], "no directory")


def test_an_out_path_that_is_a_directory_or_another_file_is_a_one_line_error(capsys, tmp_path):
    assert_one_line_error(capsys, ["train", "datastore", "--out", str(tmp_path)], "is a directory")
    other = tmp_path / "notes.txt"
    other.write_text("some notes\n")
    assert_one_line_error(capsys, ["train", "datastore", "--out", str(other)], "line 1 is not a")
    assert other.read_text() == "some notes\n"
