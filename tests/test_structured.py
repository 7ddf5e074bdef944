"""Structured outputs: a constraint's grammar masks every verified row after that row's own prefix, so speculative
output equals plain constrained output — greedy, for every drafter, chains and trees, alone and in a batch that mixes
constrained and unconstrained sequences — and sampling follows the masked target exactly (chi-square, with controls
that ignore the mask, or forget to renormalise a sampled draft over what the grammar admits, and must fail)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
from types import SimpleNamespace
from typing import Annotated, Literal

import httpx
import jsonschema
import numpy as np
import openai
import pytest
import torch
from pydantic import BaseModel
from pydantic import Field as PydanticField
from tokenizers import decoders

import specdecode.engine
from helpers import DRAWS, FAIL_P, PASS_P, BigramLM, V, WrongBranchTree, chi2_pvalue
from specdecode.batch_engine import BatchEngine, BatchRequest
from specdecode.cli import main
from specdecode.config import GenerationConfig
from specdecode.constraints import Constraint, parse_constraint
from specdecode.draft_length.factory import make_policy
from specdecode.drafters import create_drafter
from specdecode.engine import speculative_decode
from specdecode.errors import SpecDecodeError
from specdecode.generator import SpeculativeGenerator
from specdecode.grammar import GrammarCompiler, GrammarFailure, SequenceGrammar
from specdecode.sampling import sampling_probs
from specdecode.sampling_params import SamplingParams
from specdecode.types import Draft
from test_batch import batch_drafters
from test_sampling_lossless import BigramDrafter
from test_server import RunningServer, make_service, solo
from test_server_tools import calling_model
from tiny_models import bpe_tokenizer, tiny_model

CHARACTERS = list('{}[]":, ') + [chr(c) for c in range(ord("a"), ord("z") + 1)] + [str(d) for d in range(10)]
MERGES = [("{", '"'), ('"', ":"), ('":', " "), (",", " "), (" ", '"'), ('"', ",")]

RECORD = {
    "type": "object",
    "properties": {
        "ab": {"type": "integer", "minimum": 0, "maximum": 999},
        "cd": {"enum": ["xy", "zzz"]},
        "ef": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["ab", "cd", "ef"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "json-schema": Constraint.json_schema(RECORD),
    "json-object": Constraint.json_object(),
    "regex": Constraint.regex(r"[a-j]{2,5}(, [0-9]{1,3}){1,3}"),
    "choice": Constraint.choice(["alpha", "beta", "gamma"]),
    "gbnf": Constraint.grammar('root ::= "[" item (", " item)* "]"\nitem ::= [a-e] [a-e]? [a-e]?'),
}
PROMPTS = [[5, 9, 13], [20, 21, 22, 20, 21, 22, 20, 21], [40, 3, 7, 41, 2, 30]]


def json_bpe(merges: list[tuple[str, str]]):
    """A tokenizer over CHARACTERS and ``merges`` (each one token too), with an end-of-sequence token."""
    pieces = [*CHARACTERS, *("".join(pair) for pair in merges), "</s>"]
    tokenizer = bpe_tokenizer(pieces, merges)
    tokenizer.backend_tokenizer.decoder = decoders.Fuse()  # the pieces' text, joined as it is
    tokenizer.add_special_tokens({"eos_token": "</s>"})
    return tokenizer


@pytest.fixture(scope="module")
def json_tokenizer():
    return json_bpe(MERGES)


@pytest.fixture(scope="module")
def json_target(json_tokenizer):
    return tiny_model(json_tokenizer, seed=0, layers=2)


@pytest.fixture(scope="module")
def json_draft(json_tokenizer):
    return tiny_model(json_tokenizer, seed=1, layers=1)


@pytest.fixture(scope="module")
def compiler(json_target):
    backend = json_target.backend
    return GrammarCompiler(json_target.tokenizer, backend.vocab_size, frozenset({json_target.tokenizer.eos_token_id}))


def decode(target, drafter, prompt, config, compiler, outcome=None) -> list[int]:
    grammar = compiler.start(config.constraint) if config.constraint is not None else None
    eos = frozenset({target.tokenizer.eos_token_id})
    chunks = speculative_decode(target.backend, drafter, prompt, config, eos, outcome, grammar=grammar)
    return [token for chunk in chunks for token in chunk]


def plain(target, prompt, config, compiler) -> list[int]:
    return decode(target, create_drafter("none", target), prompt, config, compiler)


def ending(target, drafter, prompt, config, compiler) -> tuple[list[int], str]:
    """The output and why it ended."""
    outcome = specdecode.engine.DecodeOutcome()
    return decode(target, drafter, prompt, config, compiler, outcome), outcome.finish_reason


def assert_matches(constraint: Constraint, text: str) -> None:
    """A finished output is in the constraint's language (JSON ones parse, and validate under their schema)."""
    if constraint.kind in ("json_schema", "json_object"):
        jsonschema.validate(json.loads(text), json.loads(constraint.text))
    elif constraint.kind == "choice":
        assert text in json.loads(constraint.text)


def test_plain_constrained_greedy_output_is_in_the_language_and_ends_with_stop(json_target, compiler):
    tokenizer = json_target.tokenizer
    for name, constraint in CONSTRAINTS.items():
        for prompt in PROMPTS:
            outcome = specdecode.engine.DecodeOutcome()
            config = GenerationConfig(max_new_tokens=60, constraint=constraint)
            tokens = decode(json_target, create_drafter("none", json_target), prompt, config, compiler, outcome)
            if outcome.finish_reason == "stop":
                assert_matches(constraint, tokenizer.decode(tokens))
            else:
                assert outcome.finish_reason in ("eos", "length"), name
    # The record's schema bounds every value: the tiny model's outputs complete and validate.
    for prompt in PROMPTS:
        outcome = specdecode.engine.DecodeOutcome()
        config = GenerationConfig(max_new_tokens=80, constraint=CONSTRAINTS["json-schema"])
        tokens = decode(json_target, create_drafter("none", json_target), prompt, config, compiler, outcome)
        assert outcome.finish_reason == "stop"
        assert_matches(CONSTRAINTS["json-schema"], tokenizer.decode(tokens))


@pytest.mark.parametrize("k", [3, "auto"])
def test_every_drafter_gives_plain_constrained_greedy_output(json_target, json_draft, compiler, k):
    cases = [(name, prompt) for name in CONSTRAINTS for prompt in PROMPTS]
    expected = {}
    for name, prompt in cases:
        config = GenerationConfig(max_new_tokens=40, num_draft_tokens=k, constraint=CONSTRAINTS[name])
        expected[name, tuple(prompt)] = ending(
            json_target, create_drafter("none", json_target), prompt, config, compiler
        )
    for drafter_name, drafter in batch_drafters(json_target, json_draft).items():
        for name, prompt in cases:
            config = GenerationConfig(max_new_tokens=40, num_draft_tokens=k, constraint=CONSTRAINTS[name])
            got = ending(json_target, drafter, prompt, config, compiler)
            assert got == expected[name, tuple(prompt)], f"{drafter_name} (k={k}) under {name}, prompt {prompt}"


def test_a_batch_of_eight_mixed_constrained_and_free_sequences_gets_each_its_solo_output(
    json_target, json_draft, compiler
):
    kinds = ["json-schema", None, "regex", "choice", None, "gbnf", "json-object", "json-schema"]
    requests = [
        (PROMPTS[index % len(PROMPTS)] + [index + 3], GenerationConfig(max_new_tokens=30 + 2 * index, constraint=kind))
        for index, kind in enumerate(CONSTRAINTS.get(kind) if kind else None for kind in kinds)
    ]
    expected = [plain(json_target, prompt, config, compiler) for prompt, config in requests]
    eos = frozenset({json_target.tokenizer.eos_token_id})
    for drafter_name, drafter in batch_drafters(json_target, json_draft).items():
        engine = BatchEngine(
            json_target.backend,
            drafter,
            lambda config, drafter: make_policy(config.num_draft_tokens),
            eos,
            8,
            grammar_for=lambda config: compiler.start(config.constraint),
        )
        for index, (prompt, config) in enumerate(requests):
            engine.submit(BatchRequest(prompt, config, tag=index))
        outputs: dict[int, list[int]] = {index: [] for index in range(len(requests))}
        for event in engine.run():
            outputs[event.tag].extend(event.new_tokens)
        for index, want in enumerate(expected):
            assert outputs[index] == want, f"{drafter_name}: sequence {index} ({kinds[index]}) differs from solo"


def test_rejected_grammar_valid_branches_leave_the_matcher_where_the_accepted_tokens_do(json_target, compiler):
    tokenizer = json_target.tokenizer
    constraint = CONSTRAINTS["regex"]
    prompt = PROMPTS[0]
    config = GenerationConfig(max_new_tokens=24, num_draft_tokens=4, constraint=constraint)
    truth = plain(json_target, prompt, config, compiler)
    letters = [tokenizer.convert_tokens_to_ids(c) for c in "abcdefghij"]
    digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
    swap = {a: b for group in (letters, digits) for a, b in zip(group, group[1:] + group[:1])}
    outcome = specdecode.engine.DecodeOutcome()
    # the wrong branch is grammar-valid (the true tokens shifted within what the grammar allows)
    drafter = WrongBranchTree(json_target, truth, len(prompt), lambda token: swap.get(token, token))
    assert decode(json_target, drafter, prompt, config, compiler, outcome) == truth
    assert outcome.stats.drafted_tokens > outcome.stats.accepted_tokens  # wrong branches were verified


def test_row_masks_are_each_rows_own_and_leave_the_matcher_unchanged(json_target, compiler):
    tokenizer = json_target.tokenizer
    grammar = compiler.start(CONSTRAINTS["json-schema"])
    ids = tokenizer.encode('{"ab": 12, "cd": "xy"')
    grammar.advance(ids[:3])
    before = grammar.row_masks(Draft(tokens=[]))
    rest = ids[3:9]
    wrong = tokenizer.encode("x")  # not a digit: refused after '{"ab": '
    tree = Draft(tokens=[*rest, *wrong], parents=[*range(-1, len(rest) - 1), -1])
    masks = grammar.row_masks(tree)
    assert torch.equal(grammar.row_masks(Draft(tokens=[])), before)  # consumed and rolled back
    for row, path in enumerate(tree.row_paths()):
        if grammar.valid_nodes(Draft(tokens=path)) == list(range(len(path))):
            fresh = compiler.start(CONSTRAINTS["json-schema"])
            fresh.advance(ids[:3] + path)
            assert torch.equal(masks[row], fresh.row_masks(Draft(tokens=[]))[0]), f"row {row}"
        else:
            assert masks[row].all()  # behind a refused token: never reached
    assert grammar.valid_nodes(tree) == list(range(len(rest)))  # the refused root is cut


def test_forced_tokens_are_drafted_with_no_drafter(json_target, compiler):
    config = GenerationConfig(max_new_tokens=60, constraint=CONSTRAINTS["json-schema"])
    outcome = specdecode.engine.DecodeOutcome()
    tokens = decode(json_target, create_drafter("none", json_target), PROMPTS[0], config, compiler, outcome)
    assert outcome.stats.accepted_tokens > 0  # keys, quotes and brackets came as free drafts
    assert outcome.stats.steps + outcome.stats.accepted_tokens == len(tokens)


def test_forced_bytes_llguidance_holds_back_are_drafted_as_the_tokenizer_writes_them():
    """With a token ``"x`` in the vocabulary, the quote that opens ``cd``'s value is forced but not a forced token (a
    longer token may write it): it is drafted all the same, and the sequence's own matcher does not move."""
    tokenizer = json_bpe([*MERGES, ('"', "x")])
    compiler = GrammarCompiler(tokenizer, len(tokenizer), frozenset({tokenizer.eos_token_id}))
    grammar = compiler.start(CONSTRAINTS["json-schema"])
    path = tokenizer.encode('{"ab": 12, "cd": ', add_special_tokens=False)
    walker = grammar.matcher.deep_copy()
    assert walker.try_consume_tokens(path) == len(path)
    assert walker.compute_ff_tokens() == [] and walker.compute_ff_bytes() == b'"'
    assert tokenizer.decode(grammar.forced_after(path)) == '"'
    assert tokenizer.decode(grammar.forced_after([])) == grammar.matcher.compute_ff_bytes().decode() == '{"ab": '


def test_what_the_grammar_forces_after_a_drafters_chain_is_drafted_after_it(json_target, compiler):
    grammar = compiler.start(CONSTRAINTS["json-schema"])
    accepted = json_target.tokenizer.encode('{"ab": 7, "cd": "', add_special_tokens=False)
    assert grammar.advance(accepted) == len(accepted)
    seq = SimpleNamespace(context=[1, 2, *accepted], max_context=256)
    chain = json_target.tokenizer.encode("xy", add_special_tokens=False)
    draft, own = specdecode.engine._grammar_draft(seq, grammar, Draft(chain, confidence=[0.5] * len(chain)), room=20)
    assert json_target.tokenizer.decode(draft.tokens) == 'xy", "ef": ['
    assert draft.confidence == [0.5] * len(chain) + [1.0] * (len(draft.tokens) - len(chain)) and not own
    tree = Draft([*chain, chain[0]], parents=[-1, 0, -1])  # a tree is verified as the drafter made it
    assert specdecode.engine._grammar_draft(seq, grammar, tree, room=20)[0] == tree
    assert specdecode.engine._grammar_draft(seq, grammar, Draft(chain), room=1)[0].tokens == chain[:1]
    start = compiler.start(CONSTRAINTS["json-schema"])  # the keys forced before any drafter's token
    forced, _ = specdecode.engine._grammar_draft(SimpleNamespace(context=[1, 2], max_context=256), start, tree, 20)
    assert forced.tokens and forced.confidence == [1.0] * len(forced.tokens)


# --- sampling: the constrained target distribution, exactly ------------------------------------------------

#: Tokens a b c d e; the regex alternates a letter of {a, b} with one of {c, d, e}, so what the grammar admits after
#: a token depends on the token alone and the constrained process is again a Markov chain with known rows.
ALTERNATING = r"((a|b)(c|d|e))*"
FIRST, SECOND = [0, 1], [2, 3, 4]


def masked_rows(table: torch.Tensor, sampling: SamplingParams) -> np.ndarray:
    masked = table.clone()
    for previous in range(V):
        masked[previous, FIRST if previous in FIRST else SECOND] = float("-inf")  # what it admits next: the other set
    return sampling_probs(masked, sampling).numpy()


def constrained_transitions(sampling: SamplingParams, branches: int, tokens_wanted: int) -> np.ndarray:
    """Counts [position in step, previous token, next token] of sampled constrained output, from prompt "c"."""
    g = torch.Generator().manual_seed(3)
    target_table = 2.0 * torch.randn(V, V, generator=g)
    draft_table = target_table + 1.5 * torch.randn(V, V, generator=g)
    model, drafter = BigramLM(target_table), BigramDrafter(draft_table, with_probs=True, branches=branches)
    compiler = GrammarCompiler(bpe_tokenizer(list("abcde")), V, frozenset())
    constraint = Constraint.regex(ALTERNATING)
    counts = np.zeros((5, V, V))
    produced, run = 0, 0
    while produced < tokens_wanted:
        config = GenerationConfig(
            max_new_tokens=1000,
            num_draft_tokens=3,
            sampling=dataclasses.replace(sampling, seed=run),
            constraint=constraint,
        )
        previous = 2
        for chunk in speculative_decode(model, drafter, [2], config, grammar=compiler.start(constraint)):
            for position, token in enumerate(chunk):
                counts[position, previous, token] += 1
                previous = token
            produced += len(chunk)
        run += 1
    return counts, masked_rows(target_table, sampling)


def pvalues(counts: np.ndarray, expected_rows: np.ndarray) -> list[float]:
    """One chi-square test per (position in step, previous token) with enough samples; a token the grammar refuses
    counts as a p-value of 0."""
    found = []
    for position in range(counts.shape[0]):
        for previous in range(V):
            row, expected = counts[position, previous], expected_rows[previous]
            support = expected > 0
            if row.sum() >= 500:
                found.append(0.0 if row[~support].any() else chi2_pvalue(row[support], expected[support]))
    return found


SAMPLING = {
    "rejection-chain": (SamplingParams(temperature=1.0, coupled=False), 1),
    "rejection-tree": (SamplingParams(temperature=0.9, top_k=4, coupled=False), 3),
    "coupled-chain": (SamplingParams(temperature=1.0), 1),
}


@pytest.mark.parametrize("case", list(SAMPLING))
def test_sampling_follows_the_masked_target_exactly(case):
    sampling, branches = SAMPLING[case]
    counts, expected = constrained_transitions(sampling, branches, DRAWS)
    found = pvalues(counts, expected)
    assert len(found) >= 6
    assert min(found) > PASS_P / len(found), found


def test_control_verification_that_ignores_the_mask_fails(monkeypatch):
    monkeypatch.setattr(SequenceGrammar, "row_masks", lambda self, draft: torch.ones(len(draft.tokens) + 1, V) > 0)
    monkeypatch.setattr(SequenceGrammar, "advance", lambda self, tokens: len(tokens))
    counts, expected = constrained_transitions(*SAMPLING["rejection-chain"], DRAWS // 5)
    assert min(pvalues(counts, expected)) < FAIL_P


def test_control_sampled_drafts_cut_without_renormalising_fail(monkeypatch):
    monkeypatch.setattr(specdecode.engine, "_admitted", lambda probs, admitted: probs)
    counts, expected = constrained_transitions(*SAMPLING["rejection-chain"], DRAWS)
    assert min(pvalues(counts, expected)) < FAIL_P


# --- the constraint's edges ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"json_schema": {"type": "foo"}}, "invalid JSON schema: Invalid type: foo"),
        ({"json_schema": {"type": "object", "unevaluatedProperties": False}}, "unevaluatedProperties"),
        ({"json_schema": "{not json"}, "JSON schema is not valid JSON"),
        ({"regex": "[0-9]+("}, "unclosed group"),
        ({"choice": []}, "choices must be a non-empty list"),
        ({"grammar": 'root ::= "a" | undefined_rule'}, "invalid grammar"),
        ({"regex": "a", "choice": ["b"]}, "one constraint, got 2"),
        ({"xml": "<a/>"}, "unknown constraint kind(s) xml"),
        ({"json_object": "yes"}, "json_object takes true"),
    ],
)
def test_an_invalid_constraint_is_refused_with_what_is_wrong(value, message):
    with pytest.raises(SpecDecodeError) as caught:
        parse_constraint(value)
    assert message in str(caught.value)


def test_constraints_parse_from_their_json_and_compile_once(json_target, compiler):
    for constraint in CONSTRAINTS.values():
        assert parse_constraint(constraint.to_json()) == constraint
    assert parse_constraint({"json": RECORD}) == CONSTRAINTS["json-schema"]  # vLLM's name for a schema
    assert compiler.compile(Constraint.json_schema(RECORD)) is compiler.compile(CONSTRAINTS["json-schema"])


def test_the_python_api_takes_a_constraint_on_every_call(json_target):
    generator = SpeculativeGenerator.build(json_target, "pld")
    schema = {"json_schema": RECORD}
    result = generator.generate("ab cd", max_new_tokens=80, constraint=schema)
    assert result.finish_reason == "stop"
    assert_matches(CONSTRAINTS["json-schema"], result.text)
    streamed = "".join(generator.stream("ab cd", max_new_tokens=80, constraint=schema))
    assert streamed == result.text
    batch = generator.generate_batch(["ab cd", "x y"], max_new_tokens=80, constraint={"choice": ["yes", "no"]})
    assert [item.text in ("yes", "no") for item in batch] == [True, True]
    with pytest.raises(SpecDecodeError, match="invalid regex"):
        generator.generate("ab", constraint={"regex": "("})


# --- the command line --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def json_model_dir(json_target, tmp_path_factory):
    path = tmp_path_factory.mktemp("json-model")
    json_target.backend.model.save_pretrained(path)
    json_target.tokenizer.save_pretrained(path)
    return str(path)


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("flags", "kind"),
    [
        (["--json-schema", json.dumps(RECORD)], "json-schema"),
        (["--json-object"], "json-object"),
        (["--regex", r"[a-j]{2,5}(, [0-9]{1,3}){1,3}"], "regex"),
        (["--choice", "alpha,beta,gamma"], "choice"),
    ],
)
def test_generate_takes_each_constraint_flag(capsys, json_model_dir, flags, kind):
    args = ["generate", "ab cd", "--model", json_model_dir, "--no-chat", "--max-new-tokens", "60", "--json"]
    args += ["--num-draft-tokens", "3"]
    code, out, err = cli(capsys, *args, "--drafter", "pld", *flags)
    assert code == 0, err
    result = json.loads(out)
    plain_code, plain_out, _ = cli(capsys, *args, "--drafter", "none", *flags)
    assert plain_code == 0 and json.loads(plain_out)["token_ids"] == result["token_ids"]
    if result["finish_reason"] == "stop":
        assert_matches(CONSTRAINTS[kind], result["text"])


def test_generate_reads_a_schema_or_grammar_from_a_file(capsys, json_model_dir, tmp_path):
    schema, grammar = tmp_path / "schema.json", tmp_path / "list.gbnf"
    schema.write_text(json.dumps(RECORD))
    grammar.write_text(CONSTRAINTS["gbnf"].text)
    args = ["generate", "ab", "--model", json_model_dir, "--no-chat", "--max-new-tokens", "80", "--json"]
    code, out, err = cli(capsys, *args, "--json-schema", str(schema))
    assert code == 0, err
    assert_matches(CONSTRAINTS["json-schema"], json.loads(out)["text"])
    code, out, err = cli(capsys, *args, "--grammar", str(grammar))
    assert code == 0, err
    assert json.loads(out)["text"].startswith("[")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--json-schema", '{"type": "foo"}'], "invalid JSON schema: Invalid type: foo"),
        (["--json-schema", "/no/such/schema.json"], "--json-schema: cannot read /no/such/schema.json"),
        (["--regex", "[0-9"], 'invalid regex: at 1(8): invalid regex "[0-9" (in regex): regex parse error:'),
        (["--grammar", "/no/such.gbnf"], "--grammar: cannot read /no/such.gbnf"),
    ],
)
def test_a_bad_constraint_flag_is_one_line_and_exit_2(capsys, json_model_dir, flags, message):
    code, out, err = cli(capsys, "generate", "ab", "--model", json_model_dir, *flags)
    assert code == 2
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_batch_lines_take_their_own_constraint(capsys, json_model_dir, tmp_path):
    lines = [
        {"prompt": "ab cd", "choice": ["yes", "no"]},
        {"prompt": "ab cd", "json_schema": RECORD},
        {"prompt": "ab cd"},  # the flags' constraint
        {"prompt": "ab", "regex": "("},
    ]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(line) for line in lines))
    code, out, err = cli(
        capsys, "batch", str(prompts), "--model", json_model_dir, "--no-chat", "--json", "--regex", "[a-c]{3}"
    )
    assert code == 2  # the bad line
    rows = [json.loads(row) for row in out.splitlines()]
    assert rows[0]["text"] in ("yes", "no")
    assert_matches(CONSTRAINTS["json-schema"], rows[1]["text"])
    assert len(rows[2]["text"]) == 3 and set(rows[2]["text"]) <= set("abc")
    assert "line 4: invalid regex" in rows[3]["error"]


# --- the server ------------------------------------------------------------------------------------------


class Item(BaseModel):
    cd: Literal["xy", "zzz"]
    ab: Annotated[int, PydanticField(ge=0, le=999)]
    ef: Annotated[list[Annotated[str, PydanticField(max_length=3)]], PydanticField(max_length=2)]


@pytest.fixture(scope="module")
def served(json_target):
    json_target.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    with RunningServer(make_service(json_target)) as server:
        yield server


def test_response_format_json_object_and_json_schema_on_both_endpoints(served):
    client = served.client()
    messages = [{"role": "user", "content": "ab cd"}]
    answer = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=80, response_format={"type": "json_object"}
    )
    assert isinstance(json.loads(answer.choices[0].message.content), dict)
    form = {"type": "json_schema", "json_schema": {"name": "record", "schema": RECORD, "strict": True}}
    answer = client.chat.completions.create(model="tiny", messages=messages, max_tokens=80, response_format=form)
    assert answer.choices[0].finish_reason == "stop"
    assert_matches(CONSTRAINTS["json-schema"], answer.choices[0].message.content)
    text = client.completions.create(model="tiny", prompt="ab cd", max_tokens=80, extra_body={"response_format": form})
    assert_matches(CONSTRAINTS["json-schema"], text.choices[0].text)


def test_the_openai_clients_parse_fills_a_pydantic_model(served):
    parsed = served.client().beta.chat.completions.parse(
        model="tiny", messages=[{"role": "user", "content": "ab cd"}], max_tokens=80, response_format=Item
    )
    item = parsed.choices[0].message.parsed
    assert isinstance(item, Item) and item.cd in ("xy", "zzz")


@pytest.mark.parametrize(
    "extra",
    [
        {"structured_outputs": {"choice": ["alpha", "beta"]}},
        {"structured_outputs": {"regex": "[a-c]{4}"}},
        {"structured_outputs": {"grammar": CONSTRAINTS["gbnf"].text}},
        {"structured_outputs": {"json": RECORD}},
        {"guided_choice": ["alpha", "beta"]},
        {"guided_regex": "[a-c]{4}"},
        {"guided_json": json.dumps(RECORD)},
        {"guided_grammar": CONSTRAINTS["gbnf"].text},
    ],
    ids=lambda extra: json.dumps(extra)[:40],
)
def test_vllms_fields_old_and_new(served, extra):
    client = served.client()
    answer = client.completions.create(model="tiny", prompt="ab cd", max_tokens=60, extra_body=extra)
    text = answer.choices[0].text
    if "choice" in json.dumps(extra):
        assert text in ("alpha", "beta")
    elif "regex" in json.dumps(extra):
        assert len(text) == 4 and set(text) <= set("abc")
    elif "grammar" in json.dumps(extra):
        assert text.startswith("[")
    else:
        assert_matches(CONSTRAINTS["json-schema"], text)


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
            "response_format.json_schema",
            "invalid JSON schema: Invalid type: foo",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
            "response_format.json_schema",
            "invalid JSON schema",
        ),
        ({"structured_outputs": {"regex": "[0-9"}}, "structured_outputs", "unclosed character class"),
        ({"guided_regex": "(a"}, "guided_regex", "unclosed group"),
        ({"guided_choice": []}, "guided_choice", "List should have at least 1 item"),
        ({"guided_grammar": "root ::= nothing_here"}, "guided_grammar", "invalid grammar"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "one constraint, got 2"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "one structured output"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema.json_schema", "Field required"),
        ({"response_format": {"type": "xml"}}, "response_format", "Input tag 'xml' found using 'type'"),
        ({"structured_outputs": {"choice": ["a"], "json_object": True}}, "structured_outputs", "one constraint"),
    ],
)
def test_each_bad_structured_output_is_a_400_naming_the_field(served, extra, param, message):
    answer = httpx.post(f"{served.url}/v1/completions", json={"prompt": "ab", "max_tokens": 4, **extra})
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == param and message in error["message"], error
    assert httpx.post(f"{served.url}/v1/completions", json={"prompt": "ab", "max_tokens": 4}).status_code == 200


# --- bench structured ------------------------------------------------------------------------------------


def test_bench_structured_measures_every_contestant_and_each_constrained_one_equals_plain(json_model_dir, tmp_path):
    from specdecode.bench import structured
    from specdecode.data.structured import StructuredPrompt

    settings = structured.resolve_settings(
        model=json_model_dir, methods="none,pld,suffix", max_new_tokens=60, threads=1, out=str(tmp_path)
    )
    prompts = [
        StructuredPrompt("one", "extraction", "ab cd", RECORD),
        StructuredPrompt("two", "extraction", "x y", RECORD),
    ]
    results = structured.measure_structured(settings, prompts, progress=False)
    rows = {(r["method"], r["constrained"], r["forced_drafts"]) for r in results["rows"]}
    assert rows == {("none", False, False), ("none", True, False), ("none", True, True)} | {
        (method, True, forced) for method in ("pld", "suffix") for forced in (False, True)
    }
    for row in results["rows"]:
        if row["constrained"]:
            assert row["equal_to_plain_constrained"] == 1.0 and row["valid"] == 1.0, row["method"]
            assert 0 < row["grammar_share"] < 1 and row["decode_ms_per_token"] > 0
    report = (tmp_path / "results.md").read_text()
    assert "`pld` constrained, forced drafts on" in report and "valid JSON under the schema" in report


def test_bench_structured_measures_another_server_beside_ours(served, json_target, tmp_path):
    """Our own server as the other server: its constrained answers are valid and, by text, plain constrained
    decoding's; a server that does not answer is one clear error before anything runs."""
    from specdecode.bench import structured
    from specdecode.data.structured import StructuredPrompt

    model_dir = tmp_path / "model"  # the served model, with the chat template the server applies
    json_target.backend.model.save_pretrained(model_dir)
    json_target.tokenizer.save_pretrained(model_dir)
    prompts = [StructuredPrompt("one", "extraction", "ab cd", RECORD)]
    common = {"model": str(model_dir), "methods": "pld", "max_new_tokens": 60, "threads": 1, "served_model": "tiny"}
    settings = structured.resolve_settings(**common, out=str(tmp_path / "out"), servers=f"ours={served.url}")
    results = structured.measure_structured(settings, prompts, progress=False)
    rows = {(r["method"], r["constrained"]): r for r in results["rows"] if r["server"]}
    assert set(rows) == {("ours", False), ("ours", True)}
    assert rows["ours", True]["valid"] == 1.0 and rows["ours", True]["equal_to_plain_constrained"] == 1.0
    assert rows["ours", True]["per_prompt"][0]["prefix_cache_reset"]
    assert "ours (server) constrained" in (tmp_path / "out" / "results.md").read_text()
    nobody = structured.resolve_settings(**common, out=str(tmp_path / "x"), servers="gone=http://127.0.0.1:9")
    with pytest.raises(SpecDecodeError, match="does not answer"):
        structured.measure_structured(nobody, prompts, progress=False)


def test_bench_structured_refuses_an_unknown_suite():
    from specdecode.bench import structured

    with pytest.raises(SpecDecodeError, match="--suites takes some of extraction, classification"):
        structured.resolve_settings(suites="poetry")
    with pytest.raises(SpecDecodeError, match="--quantize must be one of"):
        structured.resolve_settings(quantize="int3")


def test_a_completed_grammar_ends_with_stop_whatever_the_step_verified_after_it(json_target, compiler):
    """Forced tokens finish the choice within one step, and the row after it would choose end-of-sequence: the
    output still ends at the grammar's completion, with ``stop``, as plain decoding one token at a time ends it."""
    eos = json_target.tokenizer.eos_token_id
    sampling = SamplingParams(logit_bias={eos: 100.0})
    config = GenerationConfig(max_new_tokens=20, sampling=sampling, constraint=CONSTRAINTS["choice"])
    tokens, reason = ending(json_target, create_drafter("none", json_target), PROMPTS[0], config, compiler)
    assert reason == "stop" and eos not in tokens
    assert json_target.tokenizer.decode(tokens) in ("alpha", "beta", "gamma")


def test_a_streamed_answer_is_held_to_its_schema(served):
    form = {"type": "json_schema", "json_schema": {"name": "record", "schema": RECORD}}
    chunks = served.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "ab cd"}], max_tokens=80, response_format=form, stream=True
    )
    pieces, reasons = [], []
    for chunk in chunks:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            reasons.append(chunk.choices[0].finish_reason)
    assert reasons[-1] == "stop"
    assert_matches(CONSTRAINTS["json-schema"], "".join(pieces))


# --- what the vocabulary cannot write; a grammar that fails ends its request alone --------------------------------

#: calling_model's vocabulary is whole words: nothing writes "[" or "{", which these JSON outputs must begin with.
ARRAY_OF_OBJECTS = Constraint.json_schema({"type": "array", "items": {"type": "object"}, "minItems": 1})
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
#: "Paris" and "w7" can be written, the "[" the grammar forces after them cannot: a dead end after the first token.
DEAD_END = Constraint.regex(r"(Paris|w7)\[")
WORDS = Constraint.regex(r"(w7|Paris|tool)+")


@pytest.fixture(scope="module")
def words_model():
    return calling_model()


@pytest.fixture(scope="module")
def words_compiler(words_model):
    return GrammarCompiler(words_model.tokenizer, words_model.backend.vocab_size, frozenset({2}))


@pytest.mark.parametrize(
    "constraint", [ARRAY_OF_OBJECTS, Constraint.json_schema(PERSON), Constraint.json_object(), DEAD_END, WORDS]
)
def test_on_a_word_vocabulary_the_mask_admits_only_what_the_matcher_accepts(words_compiler, constraint):
    """llguidance reads bytes the grammar forces as written by some token; where none writes them, its own mask is the
    one after those bytes (``"arguments":`` where ``[`` is forced), whose tokens the matcher refuses."""
    grammar = words_compiler.start(constraint)
    vocab = words_compiler.vocab
    for _ in range(6):
        admitted = grammar.admitted().nonzero().flatten().tolist()
        assert all(grammar.matcher.validate_tokens([token]) == 1 for token in admitted), admitted
        assert grammar.row_masks(Draft(tokens=[]))[0].tolist() == (
            [True] * vocab if not admitted else grammar.admitted().tolist()
        )  # a dead end's row admits everything: the output ends before it
        if grammar.complete:
            break
        assert grammar.advance(admitted[-1:]) == 1


def test_a_constraint_no_token_can_begin_is_refused_before_decoding(words_model, tiny_target):
    with pytest.raises(SpecDecodeError, match=r"no token of this model's vocabulary can begin .* '\[\{'"):
        SpeculativeGenerator.build(words_model, "none").generate(
            "w1 w2", max_new_tokens=10, constraint=ARRAY_OF_OBJECTS
        )
    form = {"type": "json_schema", "json_schema": {"name": "Person", "schema": PERSON}}  # with_structured_output's
    refused = pytest.raises(openai.BadRequestError, match="no token of this model's vocabulary can begin")
    with RunningServer(make_service(tiny_target)) as running, refused:
        running.client().chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "w1 w2"}], max_tokens=10, response_format=form
        )


def test_a_dead_end_after_the_start_ends_the_output_with_stop_for_every_drafter(words_model, words_compiler):
    config = GenerationConfig(max_new_tokens=10, num_draft_tokens=3, constraint=DEAD_END)
    want = ending(words_model, create_drafter("none", words_model), [5, 6], config, words_compiler)
    assert want == ([words_model.tokenizer.convert_tokens_to_ids("w7")], "stop")
    for name in ("pld", "suffix"):
        assert ending(words_model, create_drafter(name, words_model), [5, 6], config, words_compiler) == want, name


class RefusingGrammar(SequenceGrammar):
    """A grammar whose matcher refuses what its mask admitted (the bug an unchecked llguidance mask had)."""

    def advance(self, tokens: list[int]) -> int:
        raise GrammarFailure("the grammar refuses a token its mask admits")


class UncopyableMatcher:
    """A matcher that fails where the batch's row masks are computed (it cannot be copied)."""

    def __init__(self, matcher) -> None:
        self._matcher = matcher

    def __getattr__(self, name):
        return getattr(self._matcher, name)

    def deep_copy(self):
        raise RuntimeError("the matcher cannot be copied")


REFUSED = Constraint.regex(r"(w7)+")
UNCOPYABLE = Constraint.regex(r"(w7)*")


def breaking(start):
    """``start`` (:meth:`GrammarCompiler.start`), with a failing grammar for REFUSED and for UNCOPYABLE."""

    def broken(compiler: GrammarCompiler, constraint: Constraint) -> SequenceGrammar:
        grammar = start(compiler, constraint)
        if constraint == REFUSED:
            return RefusingGrammar(
                grammar.matcher, grammar.vocab, grammar.forced_drafts, grammar.rules, grammar.tokenizer
            )
        if constraint == UNCOPYABLE:
            grammar.matcher = UncopyableMatcher(grammar.matcher)
        return grammar

    return broken


def test_a_failing_grammar_ends_its_request_alone_and_the_batch_goes_on(words_model, words_compiler):
    constraints = [None, REFUSED, DEAD_END, None, UNCOPYABLE, WORDS]
    requests = [
        ([5 + index, 6, 7], GenerationConfig(max_new_tokens=12, constraint=c)) for index, c in enumerate(constraints)
    ]
    broken = {1, 4}
    eos = frozenset({2})
    expected = {
        index: ending(words_model, create_drafter("none", words_model), prompt, config, words_compiler)
        for index, (prompt, config) in enumerate(requests)
        if index not in broken
    }
    assert expected[2][1] == "stop" and expected[0][0] and expected[5][0]
    with pytest.raises(GrammarFailure):  # alone, the failure is raised
        list(
            speculative_decode(
                words_model.backend,
                create_drafter("none", words_model),
                *requests[1],
                eos,
                grammar=breaking(GrammarCompiler.start)(words_compiler, REFUSED),
            )
        )
    for name in ("none", "pld"):
        engine = BatchEngine(
            words_model.backend,
            create_drafter(name, words_model),
            lambda config, drafter: make_policy(config.num_draft_tokens),
            eos,
            8,
            grammar_for=lambda config: breaking(GrammarCompiler.start)(words_compiler, config.constraint),
        )
        for index, (prompt, config) in enumerate(requests):
            engine.submit(BatchRequest(prompt, config, tag=index))
        outputs: dict[int, list[int]] = {index: [] for index in range(len(requests))}
        ends = {}
        for event in engine.run():
            outputs[event.tag].extend(event.new_tokens)
            if event.finished:
                ends[event.tag] = event.sequence.outcome
        for index, (tokens, reason) in expected.items():
            assert (outputs[index], ends[index].finish_reason) == (tokens, reason), f"{name}: request {index}"
            assert ends[index].error is None
        for index in broken:
            assert outputs[index] == [] and ends[index].finish_reason == "error", f"{name}: request {index}"
            assert "grammar failed" in ends[index].error


def test_through_the_server_a_failing_grammar_is_a_500_for_its_request_alone(words_model, monkeypatch):
    monkeypatch.setattr(GrammarCompiler, "start", breaking(GrammarCompiler.start))
    free = solo(words_model, "w1 w2 w3", False, 16, ignore_eos=False)
    dead_end = solo(words_model, "w1 w2 w3", False, 16, ignore_eos=False, constraint=DEAD_END)
    assert dead_end.text == "w7" and dead_end.finish_reason == "stop"
    with RunningServer(make_service(words_model)) as running:
        client = running.client()

        def ask(constraint):
            extra = {"structured_outputs": constraint.to_json()} if constraint is not None else {}
            try:
                done = client.completions.create(model="tiny", prompt="w1 w2 w3", max_tokens=16, extra_body=extra)
            except openai.InternalServerError as exc:
                return exc
            return done.choices[0].text, done.choices[0].finish_reason

        asked = [None, REFUSED, DEAD_END, None, UNCOPYABLE, None]
        with concurrent.futures.ThreadPoolExecutor(len(asked)) as pool:
            answers = list(pool.map(ask, asked))
        assert isinstance(answers[1], openai.InternalServerError) and isinstance(answers[4], openai.InternalServerError)
        assert answers[2] == ("w7", "stop")
        for index in (0, 3, 5):
            assert answers[index] == (free.text, free.finish_reason), index
        assert ask(None) == (free.text, free.finish_reason)  # still serving
