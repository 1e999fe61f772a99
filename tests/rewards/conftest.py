"""The rewards' fixtures: a reward model that comes with its own code."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

CUSTOM_CODE = """
from transformers import AutoModel, LlamaConfig, LlamaForSequenceClassification, LlamaModel


class TinyRMConfig(LlamaConfig):
    model_type = "asyncrl_test_rm"


class TinyRMModel(LlamaModel):
    config_class = TinyRMConfig


class TinyRMForSequenceClassification(LlamaForSequenceClassification):
    config_class = TinyRMConfig


AutoModel.register(TinyRMConfig, TinyRMModel, exist_ok=True)  # the classifier builds its body with AutoModel
"""


@pytest.fixture
def custom_code_classifier(tiny_classifier, monkeypatch, tmp_path) -> Path:
    """The tiny reward model as a checkpoint of a model type transformers does not know, whose code (config.json's
    auto_map) comes with it; transformers copies trusted code into a modules cache, here the test's own."""
    import transformers.dynamic_module_utils

    monkeypatch.setattr(transformers.dynamic_module_utils, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    path = shutil.copytree(tiny_classifier(), tmp_path / "custom-rm")
    config = json.loads((path / "config.json").read_text())
    classes = {"AutoConfig": "custom_rm.TinyRMConfig",
               "AutoModelForSequenceClassification": "custom_rm.TinyRMForSequenceClassification"}  # fmt: skip
    config.update(model_type="asyncrl_test_rm", architectures=["TinyRMForSequenceClassification"], auto_map=classes)
    (path / "config.json").write_text(json.dumps(config))
    (path / "custom_rm.py").write_text(CUSTOM_CODE)
    return path
