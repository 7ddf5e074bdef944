"""Where a drafter finds its head: an option, else one trained next to the model, else one the package ships."""

from __future__ import annotations

import pytest

from specdecode.errors import SpecDecodeError
from specdecode.heads import files
from specdecode.heads.files import CONFIG_FILE, head_directory, shipped_head


def _head(path):
    path.mkdir(parents=True)
    (path / CONFIG_FILE).write_text("{}")
    return path


@pytest.fixture
def places(tmp_path, monkeypatch):
    """A shipped head for smollm2-135m and an empty place next to the cached model."""
    monkeypatch.setattr(files, "SHIPPED_DIR", tmp_path / "shipped")
    trained = tmp_path / "cache" / "eagle-head"
    monkeypatch.setattr(files, "trained_artifact_path", lambda model, artifact: trained)
    return _head(tmp_path / "shipped" / "smollm2-135m" / "eagle-head"), trained


def find(option=None, model="smollm2-135m"):
    return head_directory(option, model, "eagle-head", "eagle", "a head", "head")


def test_the_shipped_head_is_found_when_none_was_trained(places):
    shipped, _ = places
    assert find() == shipped


def test_a_head_trained_next_to_the_model_wins_over_the_shipped_one(places):
    _, trained = places
    assert find() != trained
    _head(trained)
    assert find() == trained


def test_an_option_wins_and_is_never_replaced_by_the_shipped_head(places, tmp_path):
    assert find(str(_head(tmp_path / "mine"))) == tmp_path / "mine"
    with pytest.raises(SpecDecodeError, match="looked in .*elsewhere"):
        find(str(tmp_path / "elsewhere"))


def test_only_registry_models_get_a_shipped_head(places, tmp_path):
    _head(files.SHIPPED_DIR / "not-a-registry-model" / "eagle-head")
    assert shipped_head("not-a-registry-model", "eagle-head") is None
    with pytest.raises(SpecDecodeError, match="specdecode train eagle --model not-a-registry-model"):
        find(model="not-a-registry-model")
