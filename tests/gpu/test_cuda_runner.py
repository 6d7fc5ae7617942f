"""The CUDA runner against the fp32 definition (rwkv7.py through ModelRunner) on the same weights.

Every path — prefill (chunked and recurrent), decode graphs of each kind (FMA gemv, tensor-core gemv,
cuBLAS), mixed steps — must give logits and states within bf16 tolerance of the reference:
‖ours − ref‖ / ‖ref‖ ≤ 1e-2, in fp16 (the runner's default) and, on one shape, bf16. The reference
runs in fp32 on weights rounded to the runner's dtype (the weights the GPU runs), so the check
measures the kernels, not the rounding of the checkpoint.

Runs on a CUDA GPU (marked `gpu`, skipped elsewhere). With TRITON_INTERPRET=1 the kernels also run
on the CPU under Triton's interpreter (slowly; no graphs): a check before spending GPU time.
"""

from __future__ import annotations

import pytest
import torch

from replicas.model.config import ModelConfig
from replicas.model.runner import ModelRunner
from replicas.model.rwkv7 import RWKV7, init_random
from replicas.model.state import RNNState

from .conftest import CUDA, DEVICE, HOPPER, KERNEL_MARKS, rel_err

pytestmark = KERNEL_MARKS
TOLERANCE = 1e-2  # logits
STATE_TOLERANCE = 3e-2  # states: sums of many bf16-rounded terms, some cancelling

SHAPES = {
    "L3-C128-N32": ModelConfig(3, 128, 32, 1000, 384, 8, 12, 8, 16),
    "L2-C256-N64": ModelConfig(2, 256, 64, 1000, 1024, 32, 32, 32, 64),
}


def rounded(model: RWKV7, dtype: torch.dtype) -> RWKV7:
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(dtype).float())
    return model


# (shape, dtype); the interpreter's bf16 tl.dot is wrong (Triton 3.6), so bf16 runs on a GPU only
CASES = [("L3-C128-N32", torch.float16), ("L2-C256-N64", torch.float16), ("L2-C256-N64", torch.bfloat16)]


@pytest.fixture(scope="module", params=CASES if CUDA else CASES[:1], ids=lambda c: f"{c[0]}-{str(c[1])[6:]}")
def pair(request):
    """(CUDA runner, fp32 reference runner), 8 slots each, on one random model."""
    pytest.importorskip("triton")
    from replicas.model.cuda_runner import CudaRunner  # noqa: PLC0415

    shape, dtype = request.param
    model = rounded(init_random(RWKV7(SHAPES[shape]), seed=3), dtype).to(DEVICE).eval()
    runner = CudaRunner(model, max_slots=8, dtype=dtype, prefill_wkv="recurrent", auto_path=False, live_rows=True)
    return runner, ModelRunner(model, max_slots=8)


def tokens(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def start_from_random_states(runner, ref, slots, seed: int) -> None:
    """Writes the same non-trivial states (the reference's after a short prompt) into both."""
    for j, slot in enumerate(slots):
        ref.reset(slot)
        ref.prefill([slot], [tokens(5 + j, ref.vocab_size, seed + j)])
        runner.write_state(slot, ref.read_state(slot))


def assert_states_close(runner, ref, slots) -> None:
    for slot in slots:
        ours, theirs = runner.read_state(slot), ref.read_state(slot)
        for name, a, b in zip(("att_shift", "ffn_shift", "wkv"), ours.tensors(), theirs.tensors(), strict=True):
            assert rel_err(a, b) <= STATE_TOLERANCE, f"slot {slot} {name}"


@pytest.mark.parametrize("wkv", ["recurrent", "chunked", "short"])
def test_prefill_ragged_rows(pair, wkv):
    """recurrent and chunked: cuBLAS products over 208 tokens (padded to 256 on a fifth row); short:
    13 tokens (padded to 16), the gemv path."""
    runner, ref = pair
    runner.prefill_wkv = wkv if wkv != "short" else "recurrent"
    slots = [5, 0, 3, 6]
    start_from_random_states(runner, ref, slots, seed=10)
    lengths = (1, 7, 70, 130) if wkv != "short" else (1, 7, 5)
    slots = slots[:len(lengths)]
    chunks = [tokens(n, ref.vocab_size, 20 + n) for n in lengths]
    ours = runner.prefill(slots, chunks)
    theirs = ref.prefill(slots, chunks)
    assert ours.shape == theirs.shape and ours.dtype == torch.float32
    assert rel_err(ours, theirs) <= TOLERANCE
    assert_states_close(runner, ref, slots)
    runner.prefill_wkv = "recurrent"


def test_long_prefill_takes_the_gate_lora_apart(monkeypatch):
    """Over LORA_SPLIT_TOKENS tokens the large path multiplies the gate's LoRA (here 128 wide) apart
    from the other three (64 wide), each batch at its own width: logits and states as the reference."""
    pytest.importorskip("triton")
    from replicas.model import cuda_runner  # noqa: PLC0415

    cfg = ModelConfig(2, 256, 64, 1000, 1024, 64, 48, 32, 128)
    model = rounded(init_random(RWKV7(cfg), seed=4), torch.float16).to(DEVICE).eval()
    runner = cuda_runner.CudaRunner(model, max_slots=4, prefill_wkv="recurrent", auto_path=False, graphs=False)
    ref = ModelRunner(model, max_slots=4)
    monkeypatch.setattr(cuda_runner, "LORA_SPLIT_TOKENS", 0)
    slots = [1, 2]
    start_from_random_states(runner, ref, slots, seed=30)
    chunks = [tokens(150, cfg.vocab_size, 31), tokens(9, cfg.vocab_size, 32)]
    assert rel_err(runner.prefill(slots, chunks), ref.prefill(slots, chunks)) <= TOLERANCE
    assert_states_close(runner, ref, slots)


@pytest.mark.parametrize("large_mm", ["cublas", "ws"])
def test_long_prefill_on_our_matmuls(pair, large_mm, monkeypatch):
    """Calls of MM_RELU2_ROWS tokens or more run the channel mix's key product with relu² in its
    epilogue (kernels.mm_relu2); with large_mm="ws" all the large path's products on ws_matmul.mm_ws
    (r, k, v in one grouped launch), its launch checked in a process of its own first (a wrong
    barrier hangs). Here every large-path call does: logits and states as the reference."""
    from replicas.model import kernels  # noqa: PLC0415

    runner, ref = pair
    seed = 40
    if large_mm == "ws":
        if not HOPPER:
            pytest.skip("Gluon's Hopper matmul")
        if runner.C % 256:
            pytest.skip("r, k and v take whole tiles of 256 columns")
        from replicas.model.ws_matmul import check_in_child  # noqa: PLC0415

        passed, out = check_in_child(["{}"], timeout=300)
        assert passed, out
        seed = 45
    monkeypatch.setattr(kernels, "MM_RELU2_ROWS", 0)
    monkeypatch.setattr(runner, "prefill_graphs", 0)  # (a graph captured before would replay cuBLAS's)
    monkeypatch.setattr(runner, "prefill_wkv", "chunked")
    monkeypatch.setattr(runner, "large_mm", large_mm)
    slots = [1, 4]
    start_from_random_states(runner, ref, slots, seed=seed)
    chunks = [tokens(150, ref.vocab_size, seed + 1), tokens(30, ref.vocab_size, seed + 2)]
    assert rel_err(runner.prefill(slots, chunks), ref.prefill(slots, chunks)) <= TOLERANCE
    assert_states_close(runner, ref, slots)


def test_fresh_rows_start_on_the_fp32_path(pair):
    """A row from the zero state (reset) has its first token computed apart, with fp32 activations:
    there the time mix's output per head is GroupNorm((r·k) v), which turns sign where r·k is near
    0, and fp16 activations at that one token moved the random 7.2B model's logits by 1e-2
    (tools/fp16_rounding.py). In a call of over EXACT_PREFILL tokens (the fp16 cuBLAS path), a fresh
    one-token row comes out fp32-close, the same token from written zeros (not fresh) fp16-close;
    fresh, used and one-token rows come back in their order."""
    runner, ref = pair
    V = ref.vocab_size
    slots = [0, 2, 5, 3, 6]
    chunks = [[7], tokens(140, V, 91), tokens(20, V, 92), [7], [7]]
    for call in range(3 if CUDA else 1):  # the third replays the graph the second captured
        start_from_random_states(runner, ref, [2], seed=90)
        for slot in (0, 5, 3, 6):
            runner.reset(slot)
            ref.reset(slot)
        runner.write_state(6, RNNState.zeros(runner.config, 1, DEVICE))  # zeros, but not known to be fresh
        ours, theirs = runner.prefill(slots, chunks), ref.prefill(slots, chunks)
        assert rel_err(ours, theirs) <= TOLERANCE, f"call {call}"
        assert_states_close(runner, ref, slots)
        assert rel_err(ours[0], theirs[0]) <= 1e-4 and rel_err(ours[3], theirs[3]) <= 1e-4, f"call {call}"
        assert rel_err(ours[4], theirs[4]) > 1e-4  # the fp16 path: what the fresh rows were spared
    toks = tokens(5, V, 93)  # and every row goes on from where it is
    assert rel_err(runner.decode(slots, toks), ref.decode(slots, toks)) <= TOLERANCE


@pytest.mark.parametrize("wkv", ["chunked", "short"])
def test_prefill_all_gives_the_logits_after_every_token(pair, wkv):
    """prefill_all (a prompt's every token scored), its rows in one call: the logits after each
    token of each row, rows in turn, as the reference's; a fresh row's first token on the fp32
    path; the states as after prefill. chunked: the large path (its last layer and head over every
    token, not the tail); short: the gemv path's head over every token."""
    runner, ref = pair
    runner.prefill_wkv = "chunked" if wkv == "chunked" else "recurrent"
    V = ref.vocab_size
    slots = [1, 4, 2]  # fresh, going on, fresh with one token (its first token's step alone)
    start_from_random_states(runner, ref, [4], seed=50)
    for slot in (1, 2):
        runner.reset(slot)
        ref.reset(slot)
    lengths = (90, 40, 1) if wkv == "chunked" else (9, 5, 1)
    chunks = [tokens(n, V, 51 + n) for n in lengths]
    ours, theirs = runner.prefill_all(slots, chunks), ref.prefill_all(slots, chunks)
    assert ours.shape == theirs.shape == (sum(lengths), V) and ours.dtype == torch.float32
    for row, (a, b) in enumerate(zip(ours.split(lengths), theirs.split(lengths), strict=True)):
        assert rel_err(a, b) <= TOLERANCE, f"row {row}"
        assert rel_err(a[-1], b[-1]) <= TOLERANCE, f"row {row}'s last token"
    assert rel_err(ours[0], theirs[0]) <= 1e-4  # the fresh rows' first tokens: fp32 activations
    assert rel_err(ours[-1], theirs[-1]) <= 1e-4
    assert_states_close(runner, ref, slots)
    toks = tokens(len(slots), V, 59)  # and the rows go on from there
    assert rel_err(runner.decode(slots, toks), ref.decode(slots, toks)) <= TOLERANCE
    runner.prefill_wkv = "recurrent"


def test_a_small_prefill_all_replays_a_graph(pair):
    """Speculative decoding's calls: rows going on by a few tokens each, the logits after every
    token. The shape's first call launches its kernels, the second captures them, later ones
    replay the graph: each as the reference's, and the states after them."""
    runner, ref = pair
    runner.prefill_wkv = "recurrent"
    slots, lengths = [3, 0], (5, 3)
    start_from_random_states(runner, ref, slots, seed=70)
    before = set(runner._prefill_graphs)
    for call in range(4):
        chunks = [tokens(n, ref.vocab_size, 71 + 7 * call + n) for n in lengths]
        ours, theirs = runner.prefill_all(slots, chunks), ref.prefill_all(slots, chunks)
        assert ours.shape == theirs.shape == (sum(lengths), ref.vocab_size)
        assert rel_err(ours, theirs) <= TOLERANCE, f"call {call}"
    if runner.graphs:  # (Triton's interpreter runs no graph)
        assert len(set(runner._prefill_graphs) - before) == 1  # (one shape: one graph)
    assert_states_close(runner, ref, slots)


@pytest.mark.parametrize("batch, second_rows", [(1, None), (2, None), (4, None), (6, 4), (6, None), (8, None)])
def test_decode_steps(pair, batch, second_rows, monkeypatch):
    """batch 1, 2 and 4: gemv on the FMA units, the time-mix core multiplying the LoRAs' second
    stages; 6: gemv on the tensor cores, with the core taking the second stages up to 4 rows (the
    second stages' own gemv) and up to 16 (these shapes' rule: a head's rows of them are 16 and
    32 KiB); 8 with small_batch 4: cuBLAS."""
    runner, ref = pair
    assert runner.second_rows == 16
    if second_rows is not None:
        monkeypatch.setattr(runner, "second_rows", second_rows)
    runner.small_batch = 4 if batch == 8 else 16
    slots = list(range(8))[::-1][:batch]
    start_from_random_states(runner, ref, slots, seed=30 + batch)
    for step in range(3):
        toks = tokens(batch, ref.vocab_size, 40 + step)
        ours, theirs = runner.decode(slots, toks), ref.decode(slots, toks)
        assert ours.shape == (batch, ref.vocab_size)
        assert rel_err(ours, theirs) <= TOLERANCE, f"step {step}"
    assert_states_close(runner, ref, slots)
    runner.small_batch = 16


@pytest.mark.parametrize("batch", [1, 2])
def test_decode_steps_reading_every_hidden_unit(pair, batch, monkeypatch):
    """live_rows off (as models with a small W_v run): the value product on W_v through the FMA gemv."""
    monkeypatch.setattr(pair[0], "live_rows", False)
    test_decode_steps(pair, batch, None, monkeypatch)


def test_the_core_takes_the_second_stages_up_to_rows_by_their_bytes():
    """The released shapes' LoRAs padded to 64 (heads of 64, fp16): a head's rows of the second
    stages 40 KiB at 0.1B, 72 at 1.5B, 112 at 7.2B; the rows where the core gained (12-07g)."""
    pytest.importorskip("triton")
    from replicas.model.cuda_runner import _rows_in_core  # noqa: PLC0415

    assert _rows_in_core((64, 64, 64, 128), 64, 2) == 16  # 0.1B (ranks 64, 64, 32, 128)
    assert _rows_in_core((128, 128, 64, 256), 64, 2) == 8  # 1.5B (96, 96, 64, 256)
    assert _rows_in_core((128, 128, 128, 512), 64, 2) == 4  # 7.2B (128, 128, 96, 480)
    assert _rows_in_core((64, 64, 64, 192), 64, 2) == 0  # a width the core's tiles cannot take


@pytest.mark.parametrize("batch", [2, 6, 8])
def test_decode_of_device_tokens_feeds_only_the_rows_it_is_told(pair, batch):
    """The engine's decode: tokens on the device (the sampler's, not yet read), and a feed mask; a
    row where it is False writes the scratch slot and keeps its own state (every path: 2 and 6
    rows on the gemv paths, 8 with small_batch 4 on cuBLAS; a graph replayed from the second)."""
    runner, ref = pair
    runner.small_batch = 4 if batch == 8 else 16
    slots = list(range(batch))
    feed = [i % 3 != 1 for i in range(batch)]
    fed = [s for s, go in zip(slots, feed, strict=True) if go]
    for step in range(3 if CUDA else 1):
        start_from_random_states(runner, ref, slots, seed=70 + step)
        before = {s: runner.read_state(s) for s, go in zip(slots, feed, strict=True) if not go}
        toks = tokens(batch, ref.vocab_size, 80 + step)
        ours = runner.decode(slots, torch.tensor(toks, device=DEVICE), torch.tensor(feed, device=DEVICE))
        theirs = ref.decode(fed, [t for t, go in zip(toks, feed, strict=True) if go])
        assert rel_err(ours[torch.tensor(feed, device=DEVICE)], theirs) <= TOLERANCE, f"step {step}"
        assert_states_close(runner, ref, fed)
        for s, state in before.items():
            for a, b in zip(runner.read_state(s).tensors(), state.tensors(), strict=True):
                assert torch.equal(a, b)
    runner.small_batch = 16


def test_mixed_step_and_untouched_slots(pair):
    """Prefill rows and decode rows of one engine step; other slots keep their bits."""
    runner, ref = pair
    prefilling, decoding, idle = [1, 4], [2, 7, 0], [3, 5, 6]
    start_from_random_states(runner, ref, prefilling + decoding + idle, seed=50)
    before = {s: runner.read_state(s) for s in idle}
    chunks = [tokens(n, ref.vocab_size, 60 + n) for n in (9, 33)]
    toks = tokens(3, ref.vocab_size, 61)
    ours_p, ours_d = runner.prefill(prefilling, chunks), runner.decode(decoding, toks)
    theirs_p, theirs_d = ref.prefill(prefilling, chunks), ref.decode(decoding, toks)
    assert rel_err(ours_p, theirs_p) <= TOLERANCE
    assert rel_err(ours_d, theirs_d) <= TOLERANCE
    assert_states_close(runner, ref, prefilling + decoding)
    for s in idle:  # the decode ran in bucket 4: its padding row wrote the scratch slot only
        for a, b in zip(runner.read_state(s).tensors(), before[s].tensors(), strict=True):
            assert torch.equal(a, b)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs")
def test_calls_of_one_bucket_replay_a_graph(pair):
    """Calls padded to the same buckets share one graph, captured on the second and replayed on
    the third and fourth: other lengths, tokens and slots, both paths (gemv: 2 rows of 5 or 6
    tokens, padded to 4 rows and 8 tokens; cuBLAS: 43-60 tokens, padded to 4 rows and 64)."""
    runner, ref = pair
    runner.prefill_wkv = "chunked"
    for calls in (((3, 2), (4, 2), (1, 4), (5, 1)), ((3, 40), (10, 40), (42, 18), (20, 23))):
        graphs = len(runner._prefill_graphs)
        for call, (lengths, slots) in enumerate(zip(calls, ([0, 1], [2, 3], [4, 5], [1, 0]), strict=True)):
            start_from_random_states(runner, ref, slots, seed=70 + call)
            chunks = [tokens(n, ref.vocab_size, 80 + 10 * call + n) for n in lengths]
            ours, theirs = runner.prefill(slots, chunks), ref.prefill(slots, chunks)
            assert ours.shape == theirs.shape
            assert rel_err(ours, theirs) <= TOLERANCE, f"{lengths} call {call}"
            assert_states_close(runner, ref, slots)
        assert len(runner._prefill_graphs) == graphs + 1
    runner.prefill_wkv = "recurrent"


@pytest.mark.skipif(not CUDA, reason="CUDA graphs")
def test_recurring_new_prompts_replay_a_graph(pair):
    """New prompts (rows from the zero state): their first tokens' gemv step and the rest in one
    graph, replayed on the third call; the step computes logits only for a row that ends there."""
    runner, ref = pair
    runner.prefill_wkv = "chunked"
    for calls in (((150, 7), (140, 17), (100, 57)), ((150, 1), (149, 1), (130, 1))):
        graphs = len(runner._prefill_graphs)
        for call, (lengths, slots) in enumerate(zip(calls, ([0, 1], [2, 3], [4, 5]), strict=True)):
            for slot in slots:
                runner.reset(slot)
                ref.reset(slot)
            chunks = [tokens(n, ref.vocab_size, 90 + 10 * call + n) for n in lengths]
            ours, theirs = runner.prefill(slots, chunks), ref.prefill(slots, chunks)
            assert rel_err(ours, theirs) <= TOLERANCE, f"{lengths} call {call}"
            assert_states_close(runner, ref, slots)
        assert len(runner._prefill_graphs) == graphs + 1
    runner.prefill_wkv = "recurrent"


def test_decode_logits_survive_the_next_step(pair):
    runner, _ = pair
    first = runner.decode([0, 1], [1, 2])
    kept = first.clone()
    runner.decode([0, 1], [3, 4])
    assert torch.equal(first, kept)


@pytest.mark.skipif(not CUDA, reason="host synchronisation is a CUDA notion")
def test_steps_do_not_synchronise(pair):
    runner, _ = pair
    runner.prefill_wkv = "chunked"
    runner.capture([2])
    runner.decode([0, 1], [1, 2])
    runner.prefill([2, 3], [[5, 6, 7], [8]])  # warm: kernels compiled, caches filled

    def new_prompts():  # over EXACT_PREFILL tokens: first tokens apart
        for chunks in ([[9] * 100, [10] * 40], [[11] * 140, [12]]):
            runner.reset(4)
            runner.reset(5)
            runner.prefill([4, 5], chunks)

    for _ in range(2):  # (the second sight captures the graphs)
        new_prompts()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        runner.prefill([2, 3], [[5, 6, 7], [8]])
        runner.decode([0, 1], [1, 2])
        new_prompts()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        runner.prefill_wkv = "recurrent"


def test_prefill_tail_of_many_rows():
    """A call of 40 rows of 1-6 tokens (140 tokens: the cuBLAS path) going on from states: the last
    layer's tail has 128 entries (two a row, 64 rows), over the 64 that the gemv and the LayerNorm's program-a-token
    kernel take, so its channel mix runs through cuBLAS and the rows kernel. Logits and states as
    the reference."""
    pytest.importorskip("triton")
    from replicas.model.cuda_runner import CudaRunner  # noqa: PLC0415

    model = rounded(init_random(RWKV7(SHAPES["L3-C128-N32"]), seed=5), torch.float16).to(DEVICE).eval()
    runner = CudaRunner(model, max_slots=40, prefill_wkv="recurrent", auto_path=False, graphs=False)
    ref = ModelRunner(model, max_slots=40)
    slots = list(range(40))[::-1]
    start_from_random_states(runner, ref, slots, seed=70)  # (fresh rows would lose a token to their step)
    chunks = [tokens(1 + j % 6, ref.vocab_size, 80 + j) for j in range(40)]
    assert sum(min(len(c), 2) for c in chunks) > 64 and sum(len(c) for c in chunks) > 128
    assert rel_err(runner.prefill(slots, chunks), ref.prefill(slots, chunks)) <= TOLERANCE
    assert_states_close(runner, ref, slots)


@pytest.mark.parametrize("case", ["echo", "x", "newline"])
def test_the_chunked_kernels_match_the_reference_where_the_powers_of_L_grow(case):
    """The demo model's repetitive text, where the powers of L within a chunk grow past the inverse
    of I - L, so that the inverse's fp16 products cancel (docs/gpu-history.md, "12-07e", "12-07h"):
    - echo: its first test prompt, what it writes after it (greedy, fp32) and the prompt again
      (156 tokens). With the inverse one product of (I + L^(2^i)) over the chunk the kernels read
      2.98e-2 from the fp32 logits at 100 tokens (the recurrent kernel 3.9e-4) and NaN from 118
      tokens on, under Triton's interpreter and on an H100.
    - runs of one token, 130 "x" and 520 newlines. With the inverse in two levels (that product
      over blocks of 16 tokens, whose powers reached 47 where the inverse is at most 1) they read
      2.0e-2 and 9.2e-3 under the interpreter (the recurrent kernel 5.4e-4 and 1.3e-3).
    The prep kernel now takes it in three levels, of 4, 16 and 64 tokens."""
    from replicas.model.checkpoint import load_model  # noqa: PLC0415
    from replicas.model.cuda_runner import CudaRunner  # noqa: PLC0415
    from replicas.model.loader import default_model_dir, open_model  # noqa: PLC0415
    from tests.prompts import echo_prompt  # noqa: PLC0415

    cpu, tokenizer, _ = open_model(default_model_dir(), max_slots=1, device="cpu")
    if case == "echo":
        prompt = echo_prompt(cpu, tokenizer)
        lengths = (100, len(prompt))
    else:
        prompt = tokenizer.encode({"x": "x", "newline": "\n"}[case])[:1] * 520
        lengths = (130,) if case == "x" else (260, 520)
    model, _ = load_model(default_model_dir(), DEVICE, torch.float16)
    runner = CudaRunner(model, max_slots=2, prefill_wkv="chunked")
    for n in lengths:
        cpu.reset(0)
        runner.reset(0)
        ref = cpu.prefill([0], [prompt[:n]])
        assert rel_err(runner.prefill([0], [prompt[:n]]), ref) <= TOLERANCE, n
