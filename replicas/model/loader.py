"""Opening a model directory for serving: weights on a device, a runner over them, the tokenizer.

The one place that decides the device and dtype a model runs in: fp32 on the CPU (exact against
the reference), fp16 weights with an fp32 state on a GPU (cuda_runner.py says why fp16).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..tokenizer import Tokenizer, load_tokenizer
from .checkpoint import Progress, _quiet, load_model
from .config import ModelCard
from .runner import ModelRunner

if TYPE_CHECKING:
    from .cuda_runner import CudaRunner as CudaRunnerType

REPO_ROOT = Path(__file__).resolve().parents[2]


def default_model_dir() -> Path:
    """The demo model that ships in the repository (models/demo)."""
    return REPO_ROOT / "models" / "demo"


def pick_device(name: str | None = None) -> torch.device:
    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def open_tokenizer(directory: Path | None, card: ModelCard) -> Tokenizer:
    """The model's tokenizer, with the card's end-of-text token where the tokenizer names none."""
    directory = Path(directory) if directory else default_model_dir()
    tokenizer = load_tokenizer(directory / card.tokenizer)
    if card.eos_token_id is not None and tokenizer.eos_token_id is None:
        tokenizer.eos_token_id = card.eos_token_id
    return tokenizer


def open_model(
    directory: Path | None, max_slots: int, device: str | None = None, progress: Progress = _quiet
) -> tuple[ModelRunner | CudaRunnerType, Tokenizer, ModelCard]:
    directory = Path(directory) if directory else default_model_dir()
    where = pick_device(device)
    dtype = torch.float32 if where.type == "cpu" else torch.float16
    model, card = load_model(directory, where, dtype, progress)
    tokenizer = open_tokenizer(directory, card)
    if where.type == "cuda":  # CUDA graphs and Triton kernels (cuda_runner.py); Triton ships with CUDA torch
        from .cuda_runner import CudaRunner  # noqa: PLC0415 - imports Triton only where it is used

        return CudaRunner(model, max_slots), tokenizer, card
    return ModelRunner(model, max_slots), tokenizer, card
