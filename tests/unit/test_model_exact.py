"""The model runner against the reference implementation (`rwkv` 0.8.32, cpu fp32).

Random checkpoints of several shapes (not only the released ratios) are written in BlinkDL's
.pth format; the reference package reads the same file. Every comparison is relative error
‖ours − ref‖ / ‖ref‖ ≤ 1e-4.
"""

import os

os.environ["RWKV_V7_ON"] = "1"  # must precede the import of rwkv.model
os.environ.setdefault("RWKV_JIT_ON", "0")

import pytest
import torch

from replicas.init_states import state_from_tensors
from replicas.model import rwkv7
from replicas.model.checkpoint import save_pth
from replicas.model.config import ModelConfig
from replicas.model.runner import ModelRunner
from replicas.model.rwkv7 import RWKV7, init_random

TOLERANCE = 1e-4

SHAPES = {
    "L1-C64-H1": ModelConfig(1, 64, 64, 97, 100, 4, 4, 4, 4),
    "L3-C128-H4x32": ModelConfig(3, 128, 32, 300, 200, 8, 12, 6, 10),
    "L2-C192-H3x64": ModelConfig(2, 192, 64, 1000, 768, 16, 16, 8, 32),
    "L4-C96-H6x16": ModelConfig(4, 96, 16, 64, 384, 32, 8, 16, 24),
    "L1-C512-H8x64": ModelConfig(1, 512, 64, 2048, 1024, 16, 16, 8, 32),  # 1 MB matrices: oneDNN's path
}


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.fixture(scope="module", params=sorted(SHAPES))
def pair(request, tmp_path_factory):
    """(our runner with 4 slots, the reference model) over one random checkpoint."""
    from rwkv.model import RWKV  # noqa: PLC0415 - imported after RWKV_V7_ON is set

    config = SHAPES[request.param]
    model = init_random(RWKV7(config), seed=sorted(SHAPES).index(request.param)).eval()
    path = tmp_path_factory.mktemp("ckpt") / "model.pth"
    save_pth(model, path)
    reference = RWKV(str(path.with_suffix("")), "cpu fp32")
    return ModelRunner(model, max_slots=4), reference


def reference_run(reference, tokens, state=None):
    logits, state = reference.forward(list(tokens), state)
    return logits, state


def prompt(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_one_token(pair):
    runner, reference = pair
    ours = runner.prefill([0], [[7]])[0]
    ref, _ = reference_run(reference, [7])
    assert rel_err(ours, ref) <= TOLERANCE


def test_multi_token_prompt(pair):
    runner, reference = pair
    tokens = prompt(37, runner.vocab_size, 1)
    runner.reset(1)
    ours = runner.prefill([1], [tokens])[0]
    ref, ref_state = reference_run(reference, tokens)
    assert rel_err(ours, ref) <= TOLERANCE
    wkv_ref = torch.stack([ref_state[3 * i + 1] for i in range(runner.config.n_layer)])
    assert rel_err(runner.read_state(1).wkv[:, 0], wkv_ref) <= TOLERANCE


def test_continue_from_saved_state(pair):
    runner, reference = pair
    head, tail = prompt(20, runner.vocab_size, 2), prompt(9, runner.vocab_size, 3)
    runner.reset(0)
    runner.prefill([0], [head])
    saved = runner.read_state(0)
    runner.prefill([0], [prompt(5, runner.vocab_size, 4)])  # the slot moves on; the copy must not
    runner.write_state(2, saved)
    ours = runner.prefill([2], [tail])[0]
    _, ref_state = reference_run(reference, head)
    ref, _ = reference_run(reference, tail, ref_state)
    assert rel_err(ours, ref) <= TOLERANCE
    # and token by token through decode
    runner.write_state(3, saved)
    for token in tail:
        step = runner.decode([3], [token])[0]
    assert rel_err(step, ref) <= TOLERANCE


def test_a_state_tuned_file_starts_where_the_rwkv_package_starts_from_it(pair):
    """RWKV-PEFT's time_state [H, N, N] a layer, loaded as ChatRWKV's demos load it into the
    reference (transposed); ours reads it through init_states."""
    runner, reference = pair
    cfg = runner.config
    gen = torch.Generator().manual_seed(5)
    tuned = {f"blocks.{i}.att.time_state": torch.randn(cfg.n_head, cfg.head_size, cfg.head_size, generator=gen)
             for i in range(cfg.n_layer)}
    runner.write_state(1, state_from_tensors(tuned, cfg))
    tokens = prompt(11, runner.vocab_size, 6)
    ours = runner.prefill([1], [tokens])[0]
    ref_state = []
    for i in range(cfg.n_layer):
        wkv = tuned[f"blocks.{i}.att.time_state"].transpose(1, 2).contiguous()
        ref_state += [torch.zeros(cfg.n_embd), wkv, torch.zeros(cfg.n_embd)]
    ref, _ = reference_run(reference, tokens, ref_state)
    assert rel_err(ours, ref) <= TOLERANCE
    zero, _ = reference_run(reference, tokens)
    assert rel_err(zero, ref) > 10 * TOLERANCE  # (the state matters)


def test_rows_of_different_lengths_in_one_call(pair):
    runner, reference = pair
    chunks = [prompt(n, runner.vocab_size, 10 + n) for n in (13, 1, 30, 4)]
    for slot in range(4):
        runner.reset(slot)
    rows = [2, 0, 3, 1]  # rows in any order, not the slot order
    ours = runner.prefill(rows, chunks)
    for i, chunk in enumerate(chunks):
        ref, _ = reference_run(reference, chunk)
        assert rel_err(ours[i], ref) <= TOLERANCE, f"row {rows[i]} ({len(chunk)} tokens)"
    # then one batched decode step over all four continues each row correctly
    nxt = [5, 6, 7, 8]
    ours = runner.decode(rows, nxt)
    for i, chunk in enumerate(chunks):
        ref, _ = reference_run(reference, chunk + [nxt[i]])
        assert rel_err(ours[i], ref) <= TOLERANCE


def test_rows_not_touched_keep_their_state(pair):
    runner, _ = pair
    runner.prefill([0], [[1, 2, 3]])
    before = runner.read_state(0)
    runner.prefill([1, 2], [[4, 5], [6]])
    after = runner.read_state(0)
    assert all(torch.equal(a, b) for a, b in zip(before.tensors(), after.tensors(), strict=True))


def test_decode_of_a_token_tensor_feeds_only_the_rows_it_is_told(pair):
    """decode(rows, tokens, feed): tokens as a tensor (the sampler's); a row where feed is False
    keeps its state, the others advance as a decode of them alone does."""
    runner, reference = pair
    chunks = [prompt(n, runner.vocab_size, 20 + n) for n in (3, 5, 2)]
    rows = [1, 3, 0]
    for slot in range(4):
        runner.reset(slot)
    runner.prefill(rows, chunks)
    before = runner.read_state(3)
    ours = runner.decode(rows, torch.tensor([5, 6, 7]), torch.tensor([True, False, True]))
    assert all(torch.equal(a, b) for a, b in zip(before.tensors(), runner.read_state(3).tensors(), strict=True))
    for i in (0, 2):
        ref, _ = reference_run(reference, chunks[i] + [(5, 6, 7)[i]])
        assert rel_err(ours[i], ref) <= TOLERANCE


def test_bad_rows_are_refused(pair):
    runner, _ = pair
    with pytest.raises(ValueError):
        runner.prefill([0, 0], [[1], [2]])
    with pytest.raises(ValueError):
        runner.prefill([9], [[1]])


def test_large_cpu_products_take_onednn(monkeypatch):
    """Matrices of 1 MB and more go to oneDNN at inference (any number of rows), agreeing with
    torch's product; smaller ones and autograd take nn.Linear's path."""
    if rwkv7._onednn_linear is None:
        pytest.skip("this torch build has no oneDNN linear")
    calls = []
    real = rwkv7._onednn_linear
    monkeypatch.setattr(rwkv7, "_onednn_linear", lambda *args: calls.append(args[1].shape) or real(*args))
    large, small = rwkv7.Linear(512, 1024), rwkv7.Linear(256, 256)
    for rows in (1, 3, 40):
        x = torch.randn(rows, 512)
        with torch.no_grad():
            y = large(x)
            small(x[:, :256])
        assert rel_err(y, torch.nn.functional.linear(x, large.weight)) <= 1e-6
    assert calls == [(1024, 512)] * 3
    large(torch.randn(2, 512)).sum().backward()  # autograd: torch's own product
    assert large.weight.grad is not None and calls == [(1024, 512)] * 3


@pytest.mark.parametrize("lengths", [(100, 100), (100, 17, 40)])
@pytest.mark.parametrize("decay", ["random", "strongest", "weakest"])
def test_chunked_recurrence_matches_the_definition(decay, lengths, monkeypatch):
    """wkv_chunked (the CPU runner's prefill) against wkv_reference token by token: rows of 100
    tokens (three full chunks and a partial one), or of unequal lengths, from a nonzero state, at
    the strongest decay RWKV-7 allows, at none, and at random ones."""
    gen = torch.Generator().manual_seed(3)
    B, H, N = len(lengths), 3, 16

    def draw(*shape):
        return torch.randn(*shape, generator=gen)

    total = sum(lengths)
    r, k, v = draw(total, H, N), draw(total, H, N), draw(total, H, N)
    kk = torch.nn.functional.normalize(draw(total, H, N), dim=-1)
    a, b = -kk, kk * torch.rand(total, H, N, generator=gen)
    w_log = {"random": -rwkv7.DECAY_SCALE * torch.rand(total, H, N, generator=gen),
             "strongest": torch.full((total, H, N), -rwkv7.DECAY_SCALE),
             "weakest": torch.full((total, H, N), -1e-7)}[decay]
    state = draw(B, H, N, N) * 0.3
    rows = rwkv7.Rows(list(lengths))
    reference = rwkv7.wkv_reference
    ref_out, ref_state = reference(state, r, w_log, k, v, a, b, rows)

    def refuse(*args):
        raise AssertionError("wkv_chunked fell back to the reference")  # every row here is >= 16 tokens

    monkeypatch.setattr(rwkv7, "wkv_reference", refuse)
    out, new_state = rwkv7.wkv_chunked(state, r, w_log, k, v, a, b, rows)
    assert rel_err(out, ref_out) <= 1e-5
    assert rel_err(new_state, ref_state) <= 1e-5
