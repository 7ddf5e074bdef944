"""``specdecode export eagle`` and loading heads written elsewhere: the exported layout checked by
``speculators`` 0.9.0's own classes (config, model, forward), export → import drafting identically, and a
head written by ``speculators`` itself drafting losslessly here.

``speculators`` 0.9.0 needs transformers >= 5 (we pin 4.57), so it cannot share our environment: it is
installed with ``pip install --no-deps --target`` (with the transformers, huggingface_hub, tokenizers and loguru it
needs, pinned) into pytest's cache directory once, and run in a subprocess with that directory first on
``sys.path``; its training-data modules' heavy imports (``datasets``, ``hs_connectors``), which neither
configs nor models use, get empty stand-ins.  No network: the test fails, saying so.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import PROMPTS, assert_one_line_error, hf_greedy, random_eagle_head, run
from specdecode.cli import main
from specdecode.drafters import create_drafter
from specdecode.errors import SpecDecodeError
from specdecode.heads.eagle import EagleHead, HeadCache, default_aux_layers
from specdecode.heads.storage import load_eagle, save_eagle
from specdecode.models.fastpath import PackedLinear
from specdecode.train.eagle import compute_features

SPECULATORS = (
    "speculators==0.9.0",
    "transformers==5.19.0",
    "huggingface_hub==2.4.0",
    "tokenizers==0.23.3",
    "loguru==0.7.3",
)

# Run with speculators' directory first on sys.path: `check HEAD INPUTS OUT` loads an exported head through
# speculators and writes what it found; `write HEAD VERIFIER` saves a randomly initialised head the way
# speculators' trainer does (Llama layer config from the verifier's, full vocabulary, no layer ids).
SPECULATORS_SCRIPT = r'''
import importlib.abc, importlib.machinery, json, sys, types


class Absent(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Empty modules for speculators' training-data imports, never used by configs and models."""

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("datasets", "hs_connectors"):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = lambda attr: type(attr, (), {})
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, Absent())
import torch
import transformers
from safetensors.torch import load_file, save_file
from speculators import SpeculatorModelConfig, SpeculatorsConfig, VerifierConfig
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
from speculators.proposals import GreedyTokenProposalConfig

assert transformers.__version__.startswith("5."), transformers.__version__


def check(head, inputs, out):
    config = SpeculatorModelConfig.from_pretrained(head)
    assert type(config) is Eagle3SpeculatorConfig, type(config)
    layer = config.transformer_layer_config
    method = config.speculators_config.proposal_methods[0]
    report = {
        "speculators_version": config.speculators_version,
        "draft_vocab_size": config.draft_vocab_size,
        "target_vocab_size": config.target_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "aux_layers": config.eagle_aux_hidden_state_layer_ids,
        "norm_before_residual": config.norm_before_residual,
        "verifier": config.speculators_config.verifier.model_dump(),
        "proposal": [method.proposal_type, method.speculative_tokens],
        "default_proposal": config.speculators_config.default_proposal_method,
        "layer": {
            "class": type(layer).__name__,
            "hidden_size": layer.hidden_size,
            "num_attention_heads": layer.num_attention_heads,
            "num_key_value_heads": layer.num_key_value_heads,
            "head_dim": layer.head_dim,
            "intermediate_size": layer.intermediate_size,
            "num_hidden_layers": layer.num_hidden_layers,
            "rms_norm_eps": layer.rms_norm_eps,
            "rope": layer.rope_parameters,
            "max_position_embeddings": layer.max_position_embeddings,
        },
    }
    layer._attn_implementation = "eager"
    model = Eagle3DraftModel(config)
    saved = load_file(f"{head}/model.safetensors")
    keys = model.load_state_dict(saved, strict=False)
    report["missing"] = sorted(keys.missing_keys)
    report["unexpected"] = sorted(keys.unexpected_keys)
    report["ignorable_missing"] = Eagle3DraftModel._keys_to_ignore_on_load_missing
    state = model.state_dict()
    report["mismatched"] = sorted(
        name for name, tensor in saved.items() if name in state and (
            tensor.shape != state[name].shape or tensor.dtype != state[name].dtype
        )
    )
    # speculators' own forward (its first training-time-test step: true features) on the target's features.
    batch = load_file(inputs)
    model.embed_tokens.weight.data.copy_(batch["embed"])
    logits = []
    model.lm_head.register_forward_hook(lambda module, args, output: logits.append(output))
    with torch.no_grad():
        model(
            hidden_states=batch["features"],
            input_ids=batch["ids"],
            document_ids=torch.zeros_like(batch["ids"]),
            ttt_steps=1,
        )
    save_file({"logits": logits[0].contiguous()}, out)
    # transformers' loading path as users take it (resolves the layer ids against the verifier's config).
    loaded = Eagle3DraftModel.from_pretrained(head)
    loaded_state = loaded.state_dict()
    report["from_pretrained_equal"] = all(torch.equal(loaded_state[name], tensor) for name, tensor in saved.items())
    report["from_pretrained_aux_layers"] = loaded.config.eagle_aux_hidden_state_layer_ids
    print(json.dumps(report))


def write(head, verifier):
    target = transformers.AutoConfig.from_pretrained(verifier)
    layer = transformers.LlamaConfig(
        vocab_size=target.vocab_size,
        hidden_size=target.hidden_size,
        intermediate_size=target.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=target.num_attention_heads,
        num_key_value_heads=target.num_key_value_heads,
        hidden_act=target.hidden_act,
        max_position_embeddings=target.max_position_embeddings,
        rms_norm_eps=target.rms_norm_eps,
        head_dim=target.hidden_size // target.num_attention_heads,
        tie_word_embeddings=False,
        layer_types=["full_attention"],
    )
    layer.rope_parameters = dict(target.rope_parameters)
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=target.vocab_size,
        norm_before_residual=False,
        eagle_aux_hidden_state_layer_ids=None,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig.from_pretrained(verifier),
        ),
    )
    torch.manual_seed(0)
    model = Eagle3DraftModel(config)
    for weight in (model.lm_head.weight, model.embed_tokens.weight):  # speculators starts them as NaN
        torch.nn.init.normal_(weight, std=0.3)
    model.save_pretrained(head)


if sys.argv[1] == "check":
    check(*sys.argv[2:])
else:
    write(*sys.argv[2:])
'''


@pytest.fixture(scope="session")
def speculators_path(request, tmp_path_factory) -> Path:
    """A directory holding speculators 0.9.0 and the transformers 5 it needs, installed once per pytest cache
    (once per run with ``-p no:cacheprovider``)."""
    cache = getattr(request.config, "cache", None)
    root = Path(cache.mkdir("speculators-0.9.0")) if cache else tmp_path_factory.mktemp("speculators")
    target = root / "site"
    stamp = root / "installed"
    if stamp.is_file() and stamp.read_text() == "\n".join(SPECULATORS):
        return target
    shutil.rmtree(target, ignore_errors=True)
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), *SPECULATORS]
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.fail(
            "could not install speculators 0.9.0 from PyPI, which checking the export against its own classes "
            f"needs (network?): {' '.join(command)}\n{proc.stderr[-2000:]}"
        )
    stamp.write_text("\n".join(SPECULATORS))
    return target


def run_speculators(path: Path, *argv: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(path), "TRANSFORMERS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", SPECULATORS_SCRIPT, *argv], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


@pytest.fixture
def trained_for_target(trained_head, tiny_dirs, tmp_path) -> Path:
    """A copy of the tiny target's directory with the trained head where `specdecode train eagle` puts it."""
    model = tmp_path / "model"
    shutil.copytree(tiny_dirs["target"], model)
    save_eagle(trained_head, model / "eagle-head", verifier=str(model))
    return model


def drafts(target, head, prompt=PROMPTS[0]) -> tuple:
    drafter = create_drafter("eagle", target, head=head, tree_nodes=10)
    tokens, outcome = run(target, drafter, prompt, max_new_tokens=16, num_draft_tokens=4)
    stats = outcome.stats
    return tokens, stats.drafted_tokens, stats.accepted_tokens, stats.acceptance_by_position


def test_export_then_import_drafts_identically(tiny_target, trained_head, trained_for_target, tmp_path, capsys):
    out = tmp_path / "exported"
    assert main(["export", "eagle", "--model", str(trained_for_target), "--out", str(out)]) == 0
    assert str(out) in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["speculators_config"]["verifier"] == {
        "name_or_path": str(trained_for_target),
        "architectures": ["LlamaForCausalLM"],
    }
    assert config["transformer_layer_config"]["max_position_embeddings"] == 256
    tensors = load_file(str(out / "model.safetensors"))
    width = tiny_target.backend.hidden_size
    assert tensors["fc.weight"].shape == (width, 3 * width)
    assert tensors["lm_head.weight"].shape == (64, width)
    assert (tensors["d2t"].dtype, tensors["t2d"].dtype) == (torch.int64, torch.bool)
    loaded = load_eagle(out)
    for name, value in trained_head.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[name]), name
    via_option = create_drafter("eagle", tiny_target, head=str(out), int8_head=False).head.lm_head
    # The drafter's own copy may be packed for the CPU (its weight then read back from the packing; int8 rounds it).
    weight = via_option.dense_weight() if isinstance(via_option, PackedLinear) else via_option.weight
    assert torch.equal(weight, trained_head.lm_head.weight)
    assert drafts(tiny_target, loaded) == drafts(tiny_target, trained_head)


def test_a_bf16_export_holds_the_weights_rounded_to_bf16_and_drafts_losslessly(
    tiny_target, trained_head, trained_for_target, tmp_path
):
    out = tmp_path / "exported-bf16"
    assert main(["export", "eagle", "--model", str(trained_for_target), "--out", str(out), "--dtype", "bf16"]) == 0
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["fc.weight"].dtype == torch.bfloat16
    assert (tensors["d2t"].dtype, tensors["t2d"].dtype) == (torch.int64, torch.bool)
    loaded = load_eagle(out)
    rounded = trained_head.fc.weight.to(torch.bfloat16).float()
    assert torch.equal(loaded.fc.weight, rounded) and not torch.equal(loaded.fc.weight, trained_head.fc.weight)
    tokens, *_ = drafts(tiny_target, loaded)
    assert tokens == run(tiny_target, create_drafter("none", tiny_target), PROMPTS[0], max_new_tokens=16)[0]


def test_speculators_reads_the_export_as_we_do(
    tiny_target, trained_head, trained_for_target, speculators_path, tmp_path
):
    """speculators' config classes accept the export with the values we meant, its model takes every tensor
    (names, shapes, dtypes) leaving out only what it fills from the verifier, and its forward computes our
    head's logits."""
    out = tmp_path / "exported"
    assert main(["export", "eagle", "--model", str(trained_for_target), "--out", str(out)]) == 0
    backend, head = tiny_target.backend, trained_head
    ids = PROMPTS[0] + hf_greedy(tiny_target, PROMPTS[0], 10)
    (features,) = compute_features(backend, [ids], head.config.aux_layers, progress=False)
    n = len(ids) - 1  # rows: (features of j, token j+1) at position j+1
    save_file(
        {
            "features": features.aux[:n][None].contiguous(),
            "ids": features.ids[1:][None].contiguous(),
            "embed": backend.embed(torch.arange(backend.vocab_size)).detach().contiguous(),
        },
        str(tmp_path / "inputs.safetensors"),
    )
    report = json.loads(
        run_speculators(speculators_path, "check", str(out), str(tmp_path / "inputs.safetensors"), str(tmp_path / "l"))
    )
    config = head.config
    assert report["speculators_version"] == "0.9.0"
    assert (report["draft_vocab_size"], report["target_vocab_size"]) == (64, backend.vocab_size)
    assert report["target_hidden_size"] == config.hidden_size
    assert report["aux_layers"] == report["from_pretrained_aux_layers"] == list(config.aux_layers)
    assert report["norm_before_residual"] is False
    assert report["verifier"] == {"name_or_path": str(trained_for_target), "architectures": ["LlamaForCausalLM"]}
    assert report["proposal"] == ["greedy", 5] and report["default_proposal"] == "greedy"
    assert report["layer"] == {
        "class": "LlamaConfig",
        "hidden_size": config.hidden_size,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": 1,
        "rms_norm_eps": config.rms_norm_eps,
        "rope": {"rope_theta": config.rope_theta, "rope_type": "default"},
        "max_position_embeddings": 256,
    }
    assert report["unexpected"] == [] and report["mismatched"] == []
    assert set(report["missing"]) <= set(report["ignorable_missing"]) - {"d2t", "t2d"}
    assert report["from_pretrained_equal"]
    with torch.no_grad():
        cache = HeadCache(config, backend.device, backend.dtype)
        hidden = head.extend(
            head.fuse(features.aux[:n]), backend.embed(features.ids[1:]), torch.arange(1, n + 1), cache
        )
        ours = head.logits(hidden)
    theirs = load_file(str(tmp_path / "l"))["logits"][0]
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)


def test_a_head_written_by_speculators_drafts_losslessly(tiny_target, tiny_dirs, speculators_path, tmp_path):
    """No manifest, the verifier's embedding in the file, no d2t/t2d (whole vocabulary), no layer ids
    (vLLM's default layers for the target's depth), rope in transformers 5's rope_parameters."""
    head_dir = tmp_path / "theirs"
    run_speculators(speculators_path, "write", str(head_dir), str(tiny_dirs["target"]))
    assert not (head_dir / "manifest.json").exists()
    assert "embed_tokens.weight" in load_file(str(head_dir / "model.safetensors"))
    drafter = create_drafter("eagle", tiny_target, head=str(head_dir), tree_nodes=10)
    assert drafter.head.config.aux_layers == default_aux_layers(tiny_target.backend.num_layers)
    assert drafter.head.config.draft_vocab_size == tiny_target.backend.vocab_size
    for prompt in PROMPTS:
        tokens, _ = run(tiny_target, drafter, prompt, max_new_tokens=24, num_draft_tokens=4)
        assert tokens == hf_greedy(tiny_target, prompt, 24)


def speculators_style(head: EagleHead, directory: Path, **changes) -> Path:
    """``head`` saved as other tools write it: no manifest, the verifier's weights alongside, no depth of ours."""
    save_eagle(head, directory, verifier="elsewhere")
    (directory / "manifest.json").unlink()
    config = json.loads((directory / "config.json").read_text())
    del config["specdecode"]
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(directory / "model.safetensors"))
    width, vocab = head.config.hidden_size, head.config.target_vocab_size
    tensors["embed_tokens.weight"] = torch.randn(vocab, width)
    tensors["verifier_lm_head.weight"] = torch.randn(head.config.draft_vocab_size, width)
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def test_heads_from_other_tools_load_and_draft_losslessly(tiny_target, trained_head, tmp_path):
    backend = tiny_target.backend
    path = speculators_style(trained_head, tmp_path / "a", eagle_aux_hidden_state_layer_ids=None)
    assert load_eagle(path, target_num_layers=backend.num_layers).config == trained_head.config
    with pytest.raises(SpecDecodeError, match="target depth"):
        load_eagle(path)
    assert drafts(tiny_target, str(path)) == drafts(tiny_target, trained_head)
    full = speculators_style(random_eagle_head(backend, backend.vocab_size), tmp_path / "full")
    assert "d2t" not in load_file(str(full / "model.safetensors"))
    drafter = create_drafter("eagle", tiny_target, head=str(full), tree_nodes=10)
    for prompt in PROMPTS:
        assert run(tiny_target, drafter, prompt, max_new_tokens=20)[0] == hf_greedy(tiny_target, prompt, 20)


def test_a_d2t_out_of_order_drafts_the_same_tokens(tiny_target, trained_head, tmp_path):
    path = speculators_style(trained_head, tmp_path / "shuffled")
    tensors = load_file(str(path / "model.safetensors"))
    order = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    ids = (tensors["d2t"] + torch.arange(64))[order]
    tensors["d2t"] = ids - torch.arange(64)
    tensors["lm_head.weight"] = tensors["lm_head.weight"][order].contiguous()
    save_file(tensors, str(path / "model.safetensors"))
    assert drafts(tiny_target, str(path)) == drafts(tiny_target, trained_head)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"norm_before_residual": True}, "norm_before_residual are not supported"),
        ({"norm_output": True}, "norm_output"),
        ({"transformer_layer_config": {"model_type": "qwen3"}}, "only Llama-style"),
        ({"transformer_layer_config": {"num_hidden_layers": 2}}, "only one-layer"),
        ({"transformer_layer_config": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}}, "scaled RoPE"),
        ({"transformer_layer_config": {"layer_types": ["sliding_attention"]}}, "sliding-window"),
        ({"target_hidden_size": 128}, "differs from the target's"),
    ],
)
def test_what_we_do_not_implement_is_refused(trained_head, tmp_path, changes, message):
    path = speculators_style(trained_head, tmp_path / "head")
    config = json.loads((path / "config.json").read_text())
    layer_changes = changes.pop("transformer_layer_config", {})
    config.update(changes)
    config["transformer_layer_config"].update(layer_changes)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecDecodeError, match=message):
        load_eagle(path, target_num_layers=3)


def test_inconsistent_files_are_refused(trained_head, tmp_path):
    path = speculators_style(trained_head, tmp_path / "head")
    config = json.loads((path / "config.json").read_text())
    del config["norm_before_residual"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecDecodeError, match="vLLM as true"):
        load_eagle(path, target_num_layers=3)
    for edit, message in (
        (lambda t: t.pop("t2d"), "only one of d2t and t2d"),
        (lambda t: t.update(extra=torch.zeros(1)), "weights we do not implement: extra"),
        (lambda t: t.update({"layers.0.self_attn.q_proj.weight": torch.zeros(3, 3)}), "wrong shape"),
        (lambda t: t.pop("norm.weight"), "lacks weights: norm.weight"),
        (lambda t: t.update(t2d=~t["t2d"]), "t2d does not mark"),
    ):
        path = speculators_style(trained_head, tmp_path / message.replace(" ", "-"))
        tensors = load_file(str(path / "model.safetensors"))
        edit(tensors)
        save_file(tensors, str(path / "model.safetensors"))
        with pytest.raises(SpecDecodeError, match=message):
            load_eagle(path, target_num_layers=3)


def test_export_errors_are_one_line(trained_for_target, tiny_dirs, tmp_path, capsys):
    export = ["export", "eagle", "--out", str(tmp_path / "out")]
    assert_one_line_error(capsys, [*export, "--model", str(tiny_dirs["draft"])], "specdecode train eagle --model")
    assert_one_line_error(capsys, [*export, "--model", "org/hub-model"], "pass --head DIR")
    assert_one_line_error(
        capsys, [*export, "--model", str(trained_for_target), "--head", str(tmp_path / "nowhere")], "no config.json"
    )
    assert_one_line_error(
        capsys,
        [*export, "--model", str(tiny_dirs["draft"]), "--head", str(trained_for_target / "eagle-head")],
        "is for a target with",
    )
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    busy = ["export", "eagle", "--model", str(trained_for_target), "--out", str(tmp_path / "full")]
    assert_one_line_error(capsys, busy, "not an empty directory")
