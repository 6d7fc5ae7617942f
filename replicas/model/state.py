"""The RNN state of RWKV-7 sequences: one type, named once, with its layout.

A sequence's whole history is this fixed-size state, whatever its length. `RNNState` holds the
states of R rows (R = max_slots for the runner's slot table, R = 1 for a cached snapshot or an
init state):

    att_shift  [L, R, C]     fp32  time-mix token shift: the previous token's normed input
    ffn_shift  [L, R, C]     fp32  channel-mix token shift
    wkv        [L, R, H, N, N] fp32  per head: rows = value index, columns = key index

Everything is fp32: the decay w is close to 1, and a low-precision state drifts over long
sequences.

A state on the host pickles as numpy arrays. States move between processes in pickles (a replica
and its engine's process, one replica and another through Ray), and torch's own pickling of a
tensor writes a zip archive: 15.7-18.7 against 3.2-3.7 ms a round trip for the 1.5B model's
12.6 MiB on an H100 machine's host (docs/gpu-history.md, "12-05c"). Ray carries numpy arrays out of band,
without a copy into the pickle.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .config import ModelConfig


def host_tensor(array) -> Tensor:
    """A tensor over a numpy array from a pickle (a copy of one that is read-only, as Ray's
    out-of-band buffers are)."""
    return torch.from_numpy(array if array.flags.writeable else array.copy())


def _state_from_arrays(*arrays) -> RNNState:
    return RNNState(*(host_tensor(a) for a in arrays))


@dataclass
class RNNState:
    att_shift: Tensor  # [L, R, C] fp32
    ffn_shift: Tensor  # [L, R, C] fp32
    wkv: Tensor  # [L, R, H, N, N] fp32

    @classmethod
    def zeros(cls, config: ModelConfig, rows: int, device: torch.device | str = "cpu") -> RNNState:
        L, C, H, N = config.n_layer, config.n_embd, config.n_head, config.head_size
        return cls(
            att_shift=torch.zeros(L, rows, C, device=device),
            ffn_shift=torch.zeros(L, rows, C, device=device),
            wkv=torch.zeros(L, rows, H, N, N, device=device),
        )

    def __reduce_ex__(self, protocol: int):
        if any(t.device.type != "cpu" for t in self.tensors()):
            return super().__reduce_ex__(protocol)
        return _state_from_arrays, tuple(t.detach().numpy() for t in self.tensors())

    @property
    def rows(self) -> int:
        return self.att_shift.shape[1]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> tuple[Tensor, Tensor, Tensor]:
        return self.att_shift, self.ffn_shift, self.wkv

    def row(self, i: int) -> RNNState:
        """A copy of row i. A slice, not an index: on a GPU an index made from a list goes up from
        pageable memory, which waits for all the device's queued work (the engine publishes a
        state at every request's end: each would have stalled the batch's decode)."""
        return RNNState(*(t[:, i : i + 1].clone(memory_format=torch.contiguous_format) for t in self.tensors()))

    def put_row(self, i: int, other: RNNState) -> None:
        """Writes other's one row into row i (a slice, as `row`)."""
        for mine, theirs in zip(self.tensors(), other.tensors(), strict=True):
            mine[:, i : i + 1].copy_(theirs)

    def take(self, rows: Sequence[int] | Tensor) -> RNNState:
        """A copy of the given rows (no aliasing with self)."""
        index = torch.as_tensor(rows, dtype=torch.long, device=self.wkv.device)
        return RNNState(*(t.index_select(1, index) for t in self.tensors()))

    def put(self, rows: Sequence[int] | Tensor, other: RNNState) -> None:
        """Writes other's rows (in order) into the given rows of self."""
        index = torch.as_tensor(rows, dtype=torch.long, device=self.wkv.device)
        for mine, theirs in zip(self.tensors(), other.tensors(), strict=True):
            mine.index_copy_(1, index, theirs.to(mine.device, mine.dtype))

    def to(self, device: torch.device | str) -> RNNState:
        return RNNState(*(t.to(device) for t in self.tensors()))

    def fits(self, config: ModelConfig) -> bool:
        L, C, H, N = config.n_layer, config.n_embd, config.n_head, config.head_size
        return (
            tuple(self.att_shift.shape) == (L, self.rows, C)
            and tuple(self.ffn_shift.shape) == (L, self.rows, C)
            and tuple(self.wkv.shape) == (L, self.rows, H, N, N)
        )
