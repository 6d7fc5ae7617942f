"""Init states: named initial RNN states (a persona, a task, a tuned prompt) that requests start from.

Owns reading and checking an init state's tensors against a model's shape: ours (safetensors:
`wkv` [L, H, N, N], optional `att_shift` / `ffn_shift` [L, C]) or a state-tuned model's
(RWKV-PEFT's `blocks.{i}.att.time_state` [H, N, N] a layer, key index first, in a .pth or
safetensors file). The catalog of which init states exist lives in the registry actor; each engine
holds what it was told to load.
"""

from __future__ import annotations

import hashlib
import io
import re
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
    digest: str = ""  # of the state's values (state_digest), computed when not given

    def __post_init__(self):
        if not self.digest:
            object.__setattr__(self, "digest", state_digest(self.state))

    @property
    def namespace(self) -> str:
        """The prefix cache's namespace: the state's values, so that the prefixes cached from a
        state are found again wherever the same values are loaded (after a restart, on another
        replica, under another name), and a changed state finds none."""
        return f"init:{self.digest}"


def state_digest(state: RNNState) -> str:
    """A hash of a one-row state's values, as fp32."""
    h = hashlib.blake2b(digest_size=16)
    for tensor in state.tensors():
        h.update(tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


_LAYOUTS = ("an init state holds 'wkv' [L, H, N, N] and optionally 'att_shift', 'ffn_shift' [L, C], "
           "or a state-tuned model's 'blocks.{i}.att.time_state' [H, N, N] for every layer i")
_TIME_STATE = re.compile(r"blocks\.(\d+)\.att\.time_state")


def state_from_tensors(tensors: dict[str, Tensor], config: ModelConfig) -> RNNState:
    L, C, H, N = config.n_layer, config.n_embd, config.n_head, config.head_size
    if tensors and all(isinstance(k, str) and _TIME_STATE.fullmatch(k) for k in tensors):
        tensors = _from_time_states(tensors, config)
    unknown = set(tensors) - {"wkv", "att_shift", "ffn_shift"}
    if "wkv" not in tensors or unknown or not all(isinstance(t, Tensor) for t in tensors.values()):
        raise InitStateError(_LAYOUTS)
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


def _from_time_states(tensors: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """A state-tuned model's layers as our `wkv`. Its time_state is indexed [head, key, value], as
    the training kernel keeps it; ours (and the `rwkv` package's, which loads these files with
    the same transpose) [head, value, key]. The token shifts are not tuned: zeros."""
    L, H, N = config.n_layer, config.n_head, config.head_size
    layers = sorted(int(_TIME_STATE.fullmatch(k).group(1)) for k in tensors)
    if layers != list(range(L)):
        raise InitStateError(f"a state-tuned file for this model holds blocks.0 to blocks.{L - 1}.att.time_state; "
                             f"this one has {len(layers)} layers")
    for key, tensor in tensors.items():
        if not isinstance(tensor, Tensor) or tuple(tensor.shape) != (H, N, N):
            shape = list(tensor.shape) if isinstance(tensor, Tensor) else type(tensor).__name__
            raise InitStateError(f"init state tensor {key!r} is {shape}; this model needs {[H, N, N]}")
    return {"wkv": torch.stack([tensors[f"blocks.{i}.att.time_state"].float().transpose(-1, -2) for i in range(L)])}


def state_from_bytes(data: bytes, config: ModelConfig) -> RNNState:
    """Reads an uploaded safetensors file."""
    if _is_pytorch(data):
        raise InitStateError("a PyTorch file: uploads are safetensors (safetensors.torch.save_file writes its "
                             "tensors as one), or load the .pth from the server's states directory")
    try:
        tensors = load(data)
    except Exception as err:  # safetensors raises its own error types for bad input
        raise InitStateError(f"not a safetensors file ({str(err)[:100]})") from None
    return state_from_tensors(tensors, config)


def state_file_bytes(data: bytes, config: ModelConfig) -> bytes:
    """A file of the server's states directory as the safetensors bytes that `state_from_bytes`
    reads: safetensors as they are, a PyTorch file (a state-tuned model's .pth, read with
    `weights_only`) converted. Not for uploads: those are safetensors only."""
    if not _is_pytorch(data):
        return data
    try:
        tensors = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises many types for a damaged or unsafe pickle
        raise InitStateError(f"not a PyTorch state file ({' '.join(str(err).split())[:100]})") from None
    if not isinstance(tensors, dict):
        raise InitStateError(_LAYOUTS)
    return state_to_bytes(state_from_tensors(tensors, config))


def _is_pytorch(data: bytes) -> bool:
    """Whether `data` is what torch.save writes: a zip archive, which starts with a local file header
    (a safetensors file starts with its header's length, never this many bytes)."""
    return data[:4] == b"PK\x03\x04"


def state_to_bytes(state: RNNState) -> bytes:
    """The safetensors form of a one-row state (what `state_from_bytes` reads)."""
    return save({
        "wkv": state.wkv[:, 0].contiguous().cpu(),
        "att_shift": state.att_shift[:, 0].contiguous().cpu(),
        "ffn_shift": state.ffn_shift[:, 0].contiguous().cpu(),
    })
