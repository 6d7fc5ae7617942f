"""Init states: named initial RNN states (a persona, a task, a tuned prompt) that requests start from.

Owns reading and checking an init state's tensors (safetensors: `wkv` [L, H, N, N], optional
`att_shift` / `ffn_shift` [L, C]) against a model's shape. The catalog of which init states exist
lives in the registry actor; each engine holds what it was told to load.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import torch
from safetensors.torch import load, save
from torch import Tensor

from .model.config import ModelConfig
from .model.state import RNNState


class InitStateError(ValueError):
    """An init state that cannot be used with this model; the message is for the client."""


@dataclass(frozen=True)
class InitState:
    id: str
    name: str
    state: RNNState  # one row: on the host as read, on the runner's device once an engine holds it
    default: bool = False
    version: str = field(default_factory=lambda: uuid.uuid4().hex[:8])

    @property
    def namespace(self) -> str:
        """The prefix cache's namespace: a reloaded state with the same id shares no cache entries."""
        return f"{self.id}@{self.version}"


def state_from_tensors(tensors: dict[str, Tensor], config: ModelConfig) -> RNNState:
    L, C, H, N = config.n_layer, config.n_embd, config.n_head, config.head_size
    unknown = set(tensors) - {"wkv", "att_shift", "ffn_shift"}
    if "wkv" not in tensors or unknown:
        raise InitStateError("an init state holds 'wkv' [L, H, N, N] and optionally 'att_shift', 'ffn_shift' [L, C]")
    expected = {"wkv": (L, H, N, N), "att_shift": (L, C), "ffn_shift": (L, C)}
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != expected[name]:
            raise InitStateError(
                f"init state tensor {name!r} has shape {list(tensor.shape)}; this model needs {list(expected[name])}"
            )
        if not torch.isfinite(tensor).all():
            raise InitStateError(f"init state tensor {name!r} holds NaN or infinity")
    zeros = torch.zeros(L, C)
    return RNNState(
        att_shift=tensors.get("att_shift", zeros).float().reshape(L, 1, C).clone(),
        ffn_shift=tensors.get("ffn_shift", zeros).float().reshape(L, 1, C).clone(),
        wkv=tensors["wkv"].float().reshape(L, 1, H, N, N).clone(),
    )


def state_from_bytes(data: bytes, config: ModelConfig) -> RNNState:
    """Reads an uploaded safetensors file."""
    try:
        tensors = load(data)
    except Exception as err:  # safetensors raises its own error types for bad input
        raise InitStateError(f"not a safetensors file ({str(err)[:100]})") from None
    return state_from_tensors(tensors, config)


def state_to_bytes(state: RNNState) -> bytes:
    """The safetensors form of a one-row state (what `state_from_bytes` reads)."""
    return save({
        "wkv": state.wkv[:, 0].contiguous().cpu(),
        "att_shift": state.att_shift[:, 0].contiguous().cpu(),
        "ffn_shift": state.ffn_shift[:, 0].contiguous().cpu(),
    })
