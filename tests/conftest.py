"""Shared fixtures: tiny randomly initialised models with a real (tiny) tokenizer, saved to disk so
that every path a user takes — ``load_model(dir)``, the CLI — runs on them in milliseconds."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from specdecode.models.loading import LoadedModel, load_model
from specdecode.threads import THREADS_ENV, process_cpus
from tiny_models import save_tiny, tiny_words


def pytest_configure(config):
    """Under pytest-xdist (``-n``, on by default) each worker runs with its share of the cores, unless the user fixed a
    count: a benchmark pins its threads (the cores by default), and two workers each pinning both cores of a
    two-core machine collapse at OpenMP's barriers (``specdecode/threads.py``); what the others leave unpinned the
    governor would share anyway."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers and not os.environ.get(THREADS_ENV):
        os.environ[THREADS_ENV] = str(max(1, len(process_cpus()) // int(workers)))


@pytest.fixture(scope="session", autouse=True)
def caches_in_temporary_files(tmp_path_factory):
    """auto's measured cost curves and rasd's datastore indexes go to files of this run (subprocesses inherit
    them), not the user's cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECDECODE_COST_CURVES", str(tmp_path_factory.mktemp("cost") / "cost-curves.json"))
        patch.setenv("SPECDECODE_DATASTORES", str(tmp_path_factory.mktemp("datastores")))  # rasd's index cache
        yield


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    """Three tiny models on disk: a target, a draft with the same vocabulary, and one with another."""
    root = tmp_path_factory.mktemp("tiny")
    return {
        "target": save_tiny(root / "target", seed=0, layers=3),
        "draft": save_tiny(root / "draft", seed=1, layers=1),
        "other-vocab": save_tiny(root / "other", seed=2, words=tiny_words(prefix="v")),
    }


@pytest.fixture(scope="session")
def tiny_target(tiny_dirs) -> LoadedModel:
    return load_model(str(tiny_dirs["target"]))


@pytest.fixture(scope="session")
def tiny_draft(tiny_dirs) -> LoadedModel:
    return load_model(str(tiny_dirs["draft"]))


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """The bundled default model (fp32), loaded once: a load is a second, and the first ``auto`` draft
    length measures the backend's cost curve (seconds on a CPU), once per loaded backend."""
    return load_model("smollm2-135m")


@pytest.fixture(autouse=True)
def one_thread_for_tiny_models(request):
    """Tiny tensors run many times faster on one thread than on two that fight over two shared cores;
    real-model tests keep the count decoding would choose, as users would (under xdist, the worker's share)."""
    if request.node.get_closest_marker("real_model"):
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def trained_head(tiny_target):
    """An EAGLE head trained for a second or two on the tiny target's own greedy continuations."""
    from helpers import hf_greedy
    from specdecode.heads.eagle import default_aux_layers
    from specdecode.train.eagle import EagleTrainConfig, compute_features, train_eagle

    backend = tiny_target.backend
    generator = torch.Generator().manual_seed(0)
    sequences = []
    for _ in range(12):
        prompt = torch.randint(0, backend.vocab_size, (5,), generator=generator).tolist()
        sequences.append(prompt + hf_greedy(tiny_target, prompt, 30))
    features = compute_features(backend, sequences, default_aux_layers(backend.num_layers), progress=False)
    config = EagleTrainConfig(epochs=8, window=32, batch_windows=4, lr=3e-3, draft_vocab=64)
    return train_eagle(backend, features, config).head
