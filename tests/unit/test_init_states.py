"""Init state files: ours, and a state-tuned model's (RWKV-PEFT's time_state, in .pth or safetensors)."""

from __future__ import annotations

import io
import re
import zipfile

import pytest
import torch
from safetensors.torch import save

from replicas.init_states import InitStateError, state_file_bytes, state_from_bytes, state_to_bytes
from replicas.model.config import ModelConfig
from replicas.model.state import RNNState

CONFIG = ModelConfig(n_layer=3, n_embd=64, head_size=32, vocab_size=100, ffn_dim=128,
                     w_lora=4, a_lora=4, v_lora=4, g_lora=4)
H, N = CONFIG.n_head, CONFIG.head_size


def time_states(layers: int = CONFIG.n_layer, shape=(H, N, N)) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(layers)
    return {f"blocks.{i}.att.time_state": torch.randn(shape, generator=gen).bfloat16() for i in range(layers)}


def pth(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def test_a_state_tuned_file_is_read_transposed_in_either_format():
    tuned = time_states()
    from_pth = state_from_bytes(state_file_bytes(pth(tuned), CONFIG), CONFIG)
    from_safetensors = state_from_bytes(save(tuned), CONFIG)
    for state in (from_pth, from_safetensors):
        assert state.wkv.shape == (CONFIG.n_layer, 1, H, N, N) and state.wkv.dtype == torch.float32
        for i in range(CONFIG.n_layer):
            assert torch.equal(state.wkv[i, 0], tuned[f"blocks.{i}.att.time_state"].float().transpose(-1, -2))
        assert not state.att_shift.any() and not state.ffn_shift.any()


def test_an_upload_of_a_pth_says_what_to_do():
    with pytest.raises(InitStateError, match="uploads are safetensors"):
        state_from_bytes(pth(time_states()), CONFIG)


def test_our_own_files_pass_through_unchanged():
    state = RNNState.zeros(CONFIG, 1)
    state.wkv.normal_()
    ours = state_to_bytes(state)
    assert state_file_bytes(ours, CONFIG) == ours
    assert torch.equal(state_from_bytes(ours, CONFIG).wkv, state.wkv)


def zip_of(name: str) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr(name, "not a tensor")
    return buffer.getvalue()


@pytest.mark.parametrize(("data", "words"), [
    (pth(time_states(layers=2)), "this one has 2 layers"),
    (pth(time_states(shape=(H, N, N + 1))), "this model needs [2, 32, 32]"),
    (pth({**time_states(), "blocks.0.ffn.key.weight": torch.zeros(2)}), "an init state holds"),
    (pth([torch.zeros(2)]), "an init state holds"),
    (pth(torch.nn.Identity()), "not a PyTorch state file"),  # weights_only refuses the class
    (zip_of("notes.txt"), "not a PyTorch state file"),
])
def test_bad_state_files_are_refused_with_a_reason(data, words):
    with pytest.raises(InitStateError, match=re.escape(words)):
        state_from_bytes(state_file_bytes(data, CONFIG), CONFIG)
