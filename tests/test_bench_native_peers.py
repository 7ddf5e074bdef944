"""``bench --peers``: which peer families run, how they are configured like our methods, what the report says of
them — and, where the optional extras are installed, llama.cpp and OpenVINO GenAI really running."""

from __future__ import annotations

import pytest

from specdecode.bench import contestants, native_peers
from specdecode.bench.cells import build_cells
from specdecode.bench.suites import resolve_settings
from specdecode.data.tasks import Prompt, Task
from specdecode.errors import SpecDecodeError


@pytest.mark.parametrize(
    ("given", "families"),
    [
        (True, ("transformers",)),
        (False, ()),
        ("none", ()),
        ("openvino", ("openvino-int8", "openvino-int4")),
        ("llamacpp, transformers,llamacpp", ("llamacpp", "transformers")),
    ],
)
def test_peer_families(given, families):
    assert resolve_settings("quick", peers=given).peers == families


def test_unknown_peer_is_refused():
    with pytest.raises(SpecDecodeError, match="unknown peer.*vllm.*choose from transformers, llamacpp"):
        resolve_settings("quick", peers="transformers,vllm")


def test_native_peers_match_our_methods(monkeypatch):
    monkeypatch.setattr(contestants, "_unavailable", lambda family, model: None)
    settings = resolve_settings(
        "quick", peers="llamacpp,openvino-int4", methods="none,pld:k=4,draft-model:qwen2.5-coder-0.5b"
    )
    specs = {spec.name: spec for spec in contestants.peer_specs(settings)}
    assert list(specs) == [
        "llamacpp-plain",
        "llamacpp-pld",
        "llamacpp-draft",
        "ov-int4-plain",
        "ov-int4-pld",
        "ov-int4-draft",
    ]
    assert specs["llamacpp-pld"].config == {"num_pred_tokens": 4, "max_ngram_size": 3}
    assert specs["ov-int4-pld"].config == {"num_assistant_tokens": 4, "max_ngram_size": 3}
    # An adaptive method is matched with the peers' fixed draft length.
    assert specs["llamacpp-draft"].config == {"assistant_model": "qwen2.5-coder-0.5b", "num_pred_tokens": 5}
    assert specs["ov-int4-draft"].matches.drafter == "draft-model"


def test_a_peer_that_cannot_run_is_skipped_with_its_reason():
    settings = resolve_settings("quick", model="/some/local/dir", peers="transformers,openvino-int8")
    assert "registered models only" in contestants.skipped_peers(settings)["openvino-int8"]
    assert [spec.family for spec in contestants.peer_specs(settings)] == ["transformers", "transformers"]


def test_an_engine_failure_is_a_one_line_error(monkeypatch):
    def crashing_run(*args, **kwargs):
        def run(prompt_ids, max_new_tokens):
            raise RuntimeError("llama_decode returned 1")

        return run

    monkeypatch.setattr(native_peers, "llamacpp_run", crashing_run)
    settings = resolve_settings("quick", peers="llamacpp")
    contestant = contestants._native_peer(settings, contestants.PeerSpec("llamacpp-plain", None, {}, "llamacpp"))
    with pytest.raises(SpecDecodeError, match="peer llamacpp-plain failed on a 3-token prompt: llama_decode") as info:
        contestant.run([1, 2, 3], 4)
    assert "\n" not in str(info.value)


def test_missing_extra_names_its_install_command(monkeypatch):
    monkeypatch.setattr(native_peers, "_importable", lambda module: module != "llama_cpp")
    reason = native_peers.unavailable("llamacpp", "smollm2-135m")
    assert reason.startswith("llama_cpp is not installed") and "[llamacpp]" in reason


def test_a_llamacpp_build_with_amx_is_refused_with_the_rebuild_command(monkeypatch):
    """Its AMX backend segfaults in decode: a clear skip, not a crash that loses the whole benchmark."""
    monkeypatch.setattr(native_peers, "_importable", lambda module: True)
    monkeypatch.setattr(native_peers, "_llamacpp_uses_amx", lambda: True)
    reason = native_peers.unavailable("llamacpp", "smollm2-135m")
    assert "AMX" in reason and "GGML_NATIVE=OFF" in reason and "\n" not in reason
    assert native_peers.unavailable("openvino-int8", "smollm2-135m") is None


def _record(tokens: list[int]) -> dict:
    return {"token_ids": tokens, "new_tokens": len(tokens), "wall_s": [1.0], "repeats_identical": True}


def _ours(tokens: list[int]) -> dict:
    counts = {"steps": len(tokens), "drafted_tokens": 0, "accepted_tokens": 0, "drafted_at": [], "accepted_at": []}
    return _record(tokens) | counts


def test_speculative_peers_are_compared_with_their_own_plain():
    task = Task("edit", "edit", [Prompt("edit/0", "x"), Prompt("edit/1", "y")])
    results = {
        "settings": {
            "model": "m",
            "baseline": "none",
            "methods": ["none", "pld"],
            "sweep": {},
            "peers": {
                "llamacpp-plain": {"matches": "none", "family": "llamacpp"},
                "llamacpp-pld": {"matches": "pld", "family": "llamacpp"},
            },
        },
        "runs": {
            "none": {"edit": {"edit/0": _ours([1, 2]), "edit/1": _ours([3, 4])}},
            "pld": {"edit": {"edit/0": _ours([1, 2]), "edit/1": _ours([3, 4])}},
            "llamacpp-plain": {"edit": {"edit/0": _record([1, 9]), "edit/1": _record([3, 4])}},
            "llamacpp-pld": {"edit": {"edit/0": _record([1, 9]), "edit/1": _record([3, 5])}},
        },
    }
    cells = {c.method: c for c in build_cells(results, [task])}
    assert cells["llamacpp-plain"].equal_to_ours_pct == 50.0
    assert cells["llamacpp-plain"].equal_to_own_plain_pct is None
    assert cells["llamacpp-pld"].equal_to_own_plain_pct == 50.0


# -- the real engines, where installed -------------------------------------------------------------------


def _needs(family: str) -> None:
    if reason := native_peers.unavailable(family, "smollm2-135m"):
        pytest.skip(f"peer {family} not installed here: {reason}")


PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10] * 4


@pytest.mark.real_model
def test_llamacpp_runs_the_models_gguf():
    _needs("llamacpp")
    plain = native_peers.llamacpp_run("smollm2-135m", threads=2)
    tokens, seconds = plain(PROMPT, 12)
    assert len(tokens) == 12 and seconds > 0
    assert plain(PROMPT, 12)[0] == tokens  # each run starts from a fresh cache
    lookup = native_peers.llamacpp_run("smollm2-135m", 2, lookup={"num_pred_tokens": 4, "max_ngram_size": 3})
    assert len(lookup(PROMPT, 12)[0]) == 12
    drafted = native_peers.llamacpp_run("smollm2-135m", 2, draft="smollm2-135m", lookup={"num_pred_tokens": 3})
    assert len(drafted(PROMPT, 12)[0]) == 12


@pytest.mark.real_model
def test_openvino_runs_its_own_export():
    _needs("openvino-int8")
    plain = native_peers.openvino_run("smollm2-135m", "int8", threads=2)
    tokens, seconds = plain(PROMPT, 12)
    assert len(tokens) == 12 and seconds > 0
    lookup = native_peers.openvino_run(
        "smollm2-135m", "int8", 2, lookup={"num_assistant_tokens": 4, "max_ngram_size": 3}
    )
    assert len(lookup(PROMPT, 12)[0]) == 12
    assert plain(PROMPT, 12)[0] == tokens  # rebuilt after the other pipeline ran: only one is alive
    exported = native_peers.openvino_export("smollm2-135m", "int8")
    assert (exported / "openvino_model.xml").is_file() and (exported / "openvino_tokenizer.xml").is_file()
