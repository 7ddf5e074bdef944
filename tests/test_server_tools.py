"""Tool calling on `/v1/chat/completions`: the tools rendered through the chat template, the model's `<tool_call>` text
read back into OpenAI's `tool_calls` (streamed as deltas too), the history of calls and results accepted; the reading
itself as pure functions.  The model is a bigram table over a tiny word tokenizer whose template renders tools, so
that what it writes — a call — is known."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
import torch

from helpers import BigramLM
from specdecode.config import GenerationConfig
from specdecode.constraints import Constraint
from specdecode.errors import SpecDecodeError
from specdecode.models.loading import LoadedModel
from specdecode.server.tools import (
    NamedToolChoice,
    ToolCallStream,
    ToolDefinition,
    constrain_to_tool_calls,
    forced_call_schema,
    forced_calls,
)
from test_server import CHAT, RunningServer, make_service
from tiny_models import tiny_tokenizer, tiny_words

CALL = ["<tool_call>", '{"name":', '"get_weather",', '"arguments":', '{"city":', '"Paris"}}', "</tool_call>"]
TOOLS_TEMPLATE = (
    "{% if tools %}<s> system : tools {% for t in tools %}{{ t['function']['name'] }} {% endfor %}</s> {% endif %}"
    "{% for m in messages %}<s> {{ m['role'] }} : {% if m['content'] %}{{ m['content'] }} {% endif %}"
    "{% for c in m['tool_calls'] or [] %}<tool_call> {{ c['function']['name'] }} "
    "{{ c['function']['arguments']['city'] }} </tool_call> {% endfor %}</s> {% endfor %}"
    "{% if add_generation_prompt %}<s> assistant : {% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


class TableLM(BigramLM):
    """The bigram toy over a whole tokenizer's vocabulary."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__(table)
        self.vocab_size = table.shape[0]
        self.eos_token_ids = (2,)


def calling_model() -> LoadedModel:
    """After ``:`` (a chat prompt's last token) it writes one call of get_weather for Paris, then ends — or, with a
    bias of +2 on ``<tool_call>``, calls again and again."""
    tokenizer = tiny_tokenizer([*tiny_words(60), "tool", "tools", "get_weather", "Paris", *CALL])
    tokenizer.chat_template = TOOLS_TEMPLATE
    ids = tokenizer.convert_tokens_to_ids
    table = torch.zeros(len(tokenizer), len(tokenizer))
    table[:, ids("w7")] = 5.0  # anything else is followed by w7
    for before, after in zip([":", *CALL], [*CALL, "</s>"]):
        table[ids(before), :] = 0.0
        table[ids(before), ids(after)] = 5.0
    table[ids("</tool_call>"), ids("<tool_call>")] = 4.0
    return LoadedModel(name="tools", backend=TableLM(table), tokenizer=tokenizer)


@pytest.fixture(scope="module")
def tool_server():
    with RunningServer(make_service(calling_model())) as running:
        yield running


def test_a_call_is_read_into_tool_calls_with_any_drafter(tool_server):
    client = tool_server.client()
    for drafter in ("pld", "suffix", "none"):
        answer = client.chat.completions.create(
            model="tiny",
            messages=CHAT,
            tools=[WEATHER],
            max_tokens=20,
            extra_body={"speculative": {"drafter": drafter, "num_draft_tokens": 3}},
        )
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, drafter
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    told = client.chat.completions.create(model="tiny", messages=CHAT, tools=[WEATHER], max_tokens=1)
    untold = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=1)
    assert told.usage.prompt_tokens > untold.usage.prompt_tokens  # the template rendered the tool


def test_tool_choice_none_renders_no_tools_and_reads_no_calls(tool_server):
    answer = tool_server.client().chat.completions.create(
        model="tiny", messages=CHAT, tools=[WEATHER], tool_choice="none", max_tokens=20
    )
    plain = tool_server.client().chat.completions.create(model="tiny", messages=CHAT, max_tokens=20)
    choice = answer.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content == " ".join(CALL) and answer.usage.prompt_tokens == plain.usage.prompt_tokens


def test_parallel_calls_and_parallel_tool_calls_false(tool_server):
    client = tool_server.client()
    again = {"logit_bias": {str(tool_server.service.generator.target.tokenizer.convert_tokens_to_ids(CALL[0])): 2}}
    many = client.chat.completions.create(model="tiny", messages=CHAT, tools=[WEATHER], max_tokens=21, **again)
    assert many.choices[0].finish_reason == "length" and len(many.choices[0].message.tool_calls) == 3
    one = client.chat.completions.create(
        model="tiny", messages=CHAT, tools=[WEATHER], max_tokens=21, parallel_tool_calls=False, **again
    )
    assert len(one.choices[0].message.tool_calls) == 1


def test_calls_stream_as_deltas(tool_server):
    stream = tool_server.client().chat.completions.create(
        model="tiny", messages=CHAT, tools=[WEATHER], max_tokens=20, stream=True
    )
    chunks = [chunk for chunk in stream if chunk.choices]
    calls = [call for chunk in chunks for call in chunk.choices[0].delta.tool_calls or []]
    assert [(call.index, call.function.name) for call in calls] == [(0, "get_weather")]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"} and calls[0].id.startswith("call_")
    assert not "".join(chunk.choices[0].delta.content or "" for chunk in chunks).strip()
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_history_of_calls_and_results_is_rendered(tool_server):
    history = [
        *CHAT,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "w3 w4"},
    ]
    client = tool_server.client()
    answer = client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER], max_tokens=20)
    assert answer.choices[0].message.tool_calls[0].function.name == "get_weather"
    tokenizer = tool_server.service.generator.target.tokenizer
    rendered = tokenizer.apply_chat_template(
        [*CHAT, {**history[1], "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}],
        tokenize=False,
    )
    assert "<tool_call> get_weather Paris </tool_call>" in rendered  # the arguments reach the template as an object
    assert answer.usage.prompt_tokens > len(tokenizer.apply_chat_template(CHAT, tokenize=True)) + 8


@pytest.mark.parametrize(
    "fields, message",
    [
        (
            {"tool_choice": "required", "structured_outputs": {"choice": ["w1"]}},
            "tool_choice 'required' holds the output to the calls' JSON",
        ),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope', which is not among the tools"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools.0.function.name"),
        ({"tools": [{"type": "other"}]}, "tools.0.type"),
    ],
)
def test_what_cannot_be_met_is_a_400_naming_it(tool_server, fields, message):
    response = httpx.post(
        f"{tool_server.url}/v1/chat/completions", json={"messages": CHAT, "tools": [WEATHER], **fields}
    )
    assert response.status_code == 400 and message in response.json()["error"]["message"], response.text


def test_a_model_whose_template_renders_no_tools_is_a_400(tiny_target):
    with RunningServer(make_service(tiny_target)) as running:
        body = {"messages": CHAT, "tools": [WEATHER]}
        response = httpx.post(f"{running.url}/v1/chat/completions", json=body)
        assert response.status_code == 400
        assert "does not render tools" in response.json()["error"]["message"]
        completion = httpx.post(f"{running.url}/v1/completions", json={"prompt": "w1", "tools": [WEATHER]})
        assert completion.status_code == 400 and "chat/completions only" in completion.json()["error"]["message"]


CALL_TEXT = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'


@pytest.mark.parametrize("size", [1, 2, 5, 11, 1000])
def test_a_stream_reads_the_same_calls_however_the_text_is_cut(size):
    text = "Let me look. " + CALL_TEXT + "\n" + CALL_TEXT.replace('"f"', '"g"') + " done"
    stream = ToolCallStream()
    said, calls = "", []
    for start in range(0, len(text), size):
        piece, found = stream.feed(text[start : start + size])
        assert "<tool_call>" not in piece and not piece.endswith("<")
        said, calls = said + piece, calls + found
    rest, last = stream.finish()
    said, calls = said + rest, calls + last
    assert said == "Let me look. \n done"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("f", {"x": 1}),
        ("g", {"x": 1}),
    ]


def test_what_is_not_a_call_stays_text_and_parallel_false_keeps_the_first():
    broken = "<tool_call>{not json}</tool_call>"
    assert ToolCallStream().feed(broken) == (broken, [])
    assert ToolCallStream().feed("a < b <tool") == ("a < b ", [])
    unclosed = ToolCallStream()
    assert unclosed.feed('<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}') == ("", [])
    _, (call,) = unclosed.finish()
    assert json.loads(call["function"]["arguments"]) == {"x": 2}  # arguments written as JSON text are read too
    single = ToolCallStream(parallel=False)
    _, calls = single.feed(CALL_TEXT + CALL_TEXT)
    assert len(calls) == 1 and single.feed(CALL_TEXT) == ("", [])


def test_a_forced_choice_schema_admits_exactly_the_allowed_calls():
    tools = [ToolDefinition.model_validate(WEATHER)]
    required = forced_call_schema(tools, "required", parallel=True)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Paris"}}] * 2, required)
    for wrong in ([], [{"name": "other", "parameters": {}}], [{"name": "get_weather", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, required)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(
            [{"name": "get_weather", "parameters": {"city": "x"}}] * 2, forced_call_schema(tools, "required", False)
        )
    named = NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_weather"}})
    jsonschema.validate({"city": "Paris"}, forced_call_schema(tools, named, parallel=True))
    (call,) = forced_calls('{"city": "Paris"}', named)
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    calls = forced_calls('[{"name": "get_weather", "parameters": {"city": "Rome"}}]', "required")
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Rome"}]
    assert forced_calls('[{"name": "get_wea', "required") == []  # cut short by the token limit
    assert forced_calls('{"name": "get_weather"}', "required") == forced_calls("[{}]", "required") == []


@pytest.mark.real_model
def test_smollm2s_template_renders_no_tools(smollm2):
    from specdecode.generator import SpeculativeGenerator

    assert SpeculativeGenerator.build(smollm2, "none").renders_tools is False
    assert SpeculativeGenerator.build(calling_model(), "none").renders_tools is True


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_choice_holds_the_output_to_the_calls_json_schema(choice):
    """``required`` and a named function are kept by the structured-outputs grammar: the request's constraint is the
    JSON schema of the calls it allows, which the engine holds every verified row to."""
    tools = [ToolDefinition.model_validate(WEATHER)]
    if isinstance(choice, dict):
        choice = NamedToolChoice.model_validate(choice)
    schema = forced_call_schema(tools, choice, parallel=True)
    config = constrain_to_tool_calls(GenerationConfig(), schema, choice)
    assert config.constraint == Constraint.json_schema(schema)
    with pytest.raises(SpecDecodeError, match="drop the other structured output"):
        constrain_to_tool_calls(GenerationConfig(constraint=Constraint.json_object()), schema, choice)
