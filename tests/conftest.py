"""Shared fixtures: small real models, written to disk the way users' models are."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from replicas.model.checkpoint import convert, save_pth
from replicas.model.config import ModelConfig
from replicas.model.loader import default_model_dir
from replicas.model.rwkv7 import RWKV7, init_random

# A random model over the World vocabulary: big logits (scale) so that greedy choices are clear.
RANDOM_WORLD = ModelConfig(n_layer=2, n_embd=64, head_size=32, vocab_size=65536, ffn_dim=128,
                           w_lora=8, a_lora=8, v_lora=8, g_lora=8)


def write_random_model(directory: Path, config: ModelConfig = RANDOM_WORLD, seed: int = 0) -> Path:
    """A BlinkDL .pth of a random model, converted with the project's own converter."""
    model = init_random(RWKV7(config), seed, scale=6.0)
    pth = directory / "random.pth"
    save_pth(model, pth, torch.float32)
    convert(pth, directory / "model")
    return directory / "model"


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory) -> Path:
    return write_random_model(tmp_path_factory.mktemp("random-world"))


@pytest.fixture(scope="session")
def demo_model_dir() -> Path:
    """The trained demo model that ships in the repository: peaked logits, real text."""
    path = default_model_dir()
    assert (path / "config.json").is_file(), f"the demo model is missing at {path}"
    return path
