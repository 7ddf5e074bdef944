"""LangChain's `ChatOpenAI` (langchain-openai, in the dev extra) against `specdecode serve`, unchanged: `invoke` and
`stream` give plain decoding's text, and `bind_tools` gets the model's call back as a parsed tool call."""

from __future__ import annotations

import pytest

from test_server import CHAT, RunningServer, make_service, solo
from test_server_tools import WEATHER, calling_model

langchain_openai = pytest.importorskip("langchain_openai", reason="langchain-openai is in the dev extra")


def chat_model(url: str, **options) -> langchain_openai.ChatOpenAI:
    return langchain_openai.ChatOpenAI(base_url=f"{url}/v1", api_key="unused", model="tiny", max_retries=0, **options)


def test_invoke_and_stream_give_plain_decodings_text(tiny_target):
    want = solo(tiny_target, CHAT, True, 12)
    with RunningServer(make_service(tiny_target)) as running:
        model = chat_model(running.url, temperature=0, max_tokens=12, stream_usage=True)
        said = model.invoke(CHAT[0]["content"])
        assert said.content == want.text
        assert said.usage_metadata["output_tokens"] == len(want.token_ids)
        pieces = list(model.stream(CHAT[0]["content"]))
        assert "".join(piece.content for piece in pieces) == want.text
        assert sum(piece.usage_metadata["output_tokens"] for piece in pieces if piece.usage_metadata) == len(
            want.token_ids
        )


def test_bind_tools_gets_the_call_parsed():
    with RunningServer(make_service(calling_model())) as running:
        model = chat_model(running.url, max_tokens=20).bind_tools([WEATHER])
        said = model.invoke(CHAT[0]["content"])
        assert [(call["name"], call["args"]) for call in said.tool_calls] == [("get_weather", {"city": "Paris"})]
        assert said.response_metadata["finish_reason"] == "tool_calls"
        streamed = None
        for piece in model.stream(CHAT[0]["content"]):
            streamed = piece if streamed is None else streamed + piece
        assert [(call["name"], call["args"]) for call in streamed.tool_calls] == [("get_weather", {"city": "Paris"})]


@pytest.mark.real_model
def test_with_structured_output_gets_an_object_of_the_schema(smollm2):
    """`with_structured_output(PydanticModel)` sends `response_format` with the model's JSON schema (langchain-openai's
    default method); the grammar holds the answer to it, so it parses into the model whatever the weights say."""
    pydantic = pytest.importorskip("pydantic")

    class Person(pydantic.BaseModel):
        name: str
        age: int

    with RunningServer(make_service(smollm2)) as running:
        model = chat_model(running.url, temperature=0, max_tokens=60).with_structured_output(Person)
        person = model.invoke("Ada Lovelace was 36. Give her name and age.")
        assert isinstance(person, Person)
