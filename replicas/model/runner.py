"""The model runner: RWKV-7 executed over the rows of a slot table.

It owns the weights and the states of `max_slots` slots (one `RNNState` with a row per slot)
and advances any set of distinct rows by any numbers of tokens. It knows nothing of requests,
sampling or caching: the batcher decides which rows move, the runner moves them.

Contract shared by every runner (CPU reference here, the CUDA runner in cuda_runner.py):
    prefill(rows, chunks) -> logits [len(rows), V] fp32, each row's logits after its chunk
    prefill_all(rows, chunks) -> logits [Σ len(chunk), V] fp32, after each token of each chunk in turn
    decode(rows, tokens, feed=None) -> logits [len(rows), V] fp32, one token per row (tokens may
        be a device tensor; a row where the bool tensor feed is False stays as it was)
    read_state(slot) -> RNNState (1 row, a copy);  write_state(slot, state);  reset(slot)
    warm_up(progress)  compiles and captures what serving would otherwise wait for (before requests)
A slot's state is always the model's state after the tokens it has consumed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from .config import ModelConfig
from .rwkv7 import RWKV7, Rows, WkvFn, wkv_chunked, wkv_reference
from .state import RNNState


class SlotStates:
    """What every runner does the same way with its slots' state rows (`self.states`, one row
    per slot, possibly plus scratch rows past `max_slots`): copy a slot out and in, clear it, and
    check the rows a call names."""

    config: ModelConfig
    max_slots: int
    states: RNNState
    fingerprint: str  # the weights' (RWKV7.fingerprint): the prefix cache's files name it

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def read_state(self, slot: int) -> RNNState:
        return self.states.row(slot)

    def write_state(self, slot: int, state: RNNState) -> None:
        if not state.fits(self.config) or state.rows != 1:
            raise ValueError("state does not fit this model")
        self.states.put_row(slot, state)

    def reset(self, slot: int) -> None:
        for tensor in self.states.tensors():
            tensor[:, slot].zero_()

    def _check_rows(self, rows: Sequence[int], n_inputs: int) -> None:
        if len(rows) != n_inputs or len(set(rows)) != len(rows) or not rows:
            raise ValueError(f"rows must be distinct, non-empty and match the inputs: {list(rows)}")
        if any(not 0 <= r < self.max_slots for r in rows):
            raise ValueError(f"row out of range 0..{self.max_slots - 1}: {list(rows)}")


class ModelRunner(SlotStates):
    def __init__(self, model: RWKV7, max_slots: int, wkv: WkvFn | None = None):
        self.model = model
        self.config = model.config
        self.device = next(model.parameters()).device
        self.fingerprint = model.fingerprint()
        self.max_slots = max_slots
        # on a GPU this runner is the fp32 reference of tests and benchmarks: the definition there
        self.wkv = wkv or (wkv_chunked if self.device.type == "cpu" else wkv_reference)
        self.states = RNNState.zeros(self.config, max_slots, self.device)  # the slot table's rows

    def prefill(self, rows: Sequence[int], chunks: Sequence[Sequence[int]]) -> Tensor:
        """Advances each row by its chunk (chunks may differ in length) in one batched pass."""
        return self._prefill(rows, chunks, last_only=True)

    def prefill_all(self, rows: Sequence[int], chunks: Sequence[Sequence[int]]) -> Tensor:
        """As prefill, with the logits after every token: [Σ len(chunk), V], row after row."""
        return self._prefill(rows, chunks, last_only=False)

    @torch.no_grad()
    def _prefill(self, rows: Sequence[int], chunks: Sequence[Sequence[int]], last_only: bool) -> Tensor:
        self._check_rows(rows, len(chunks))
        flat = torch.tensor([t for chunk in chunks for t in chunk], dtype=torch.long, device=self.device)
        layout = Rows([len(chunk) for chunk in chunks], device=self.device)
        first = rows[0]
        if list(rows) == list(range(first, first + len(rows))):  # a run of slots: update them in place
            view = RNNState(*(t[:, first : first + len(rows)] for t in self.states.tensors()))
            logits, _ = self.model(flat, layout, view, wkv=self.wkv, out=view, last_only=last_only)
            return logits
        state = self.states.take(rows)
        logits, _ = self.model(flat, layout, state, wkv=self.wkv, out=state, last_only=last_only)
        self.states.put(rows, state)
        return logits

    def decode(self, rows: Sequence[int], tokens: Sequence[int] | Tensor, feed: Tensor | None = None) -> Tensor:
        """Advances each row by one token (tokens: a list, or a tensor such as the sampler's). feed
        (bool [len(rows)]): where False, the row is not advanced and its logits are undefined."""
        self._check_rows(rows, len(tokens))
        tokens = tokens.tolist() if isinstance(tokens, Tensor) else list(tokens)
        if feed is None:
            return self.prefill(rows, [[t] for t in tokens])
        fed = [i for i, go in enumerate(feed.tolist()) if go]
        logits = torch.zeros(len(rows), self.vocab_size, device=self.device)
        if fed:
            logits[fed] = self.prefill([rows[i] for i in fed], [[tokens[i]] for i in fed])
        return logits

    def warm_up(self, progress: Callable[[str], None] = lambda _: None) -> None:
        """Nothing to compile or capture on the CPU (the CUDA runner's warm_up does both)."""
