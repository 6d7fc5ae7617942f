"""GPU benchmark: the CUDA runner's decode and prefill tokens/s next to the `rwkv` package's and
next to the GPU's limits, all measured in one run; plus the engine's own throughput.

For random-init models of the released shapes (0.1B L12 C768, 1.5B L24 C2048, 7.2B L32 C4096;
vocabulary 65,536; FFN 4·C; LoRA ranks as the released models), built directly on the GPU in fp16 (the runner's dtype):
  * exactness first: prefill (short rows, and a new prompt of 4,096 tokens), decode graphs (gemv
    and cuBLAS paths) and a mixed step against the fp32 reference (rwkv7.py through ModelRunner)
    on the same weights: ‖Δ‖/‖ref‖ ≤ 1e-2;
  * decode tokens/s at batch 1, 8, 64, 256 (runner.decode: host copy + graph replay + logits copy);
  * prefill tokens/s at 1 × 4,096 and 16 × 1,024 (three calls timed; under "Other paths" also
    twelve back to back: the first call's host work weighs less there, but the GPU reaches its
    power limit and lowers its clock, so on an H200 twelve read 1-3% under three at 1 × 4,096);
  * the `rwkv` package (0.8.32, RWKV_CUDA_ON=1, "cuda fp16") on the same shapes, in a child
    process (it changes global torch flags): decode at batch 1 and prefill of one row;
  * limits: copy bandwidth and bf16 matrix rate measured here; a step's limit is
    max(bytes / bandwidth, flops / rate) with bytes = weights read once + states read and written
    + logits written, flops = 2 · rows · parameters used;
  * the engine (replicas.engine.Engine, no Ray), after the runner's warm-up: concurrent requests
    → generated tokens/s, next to the runner's raw decode rate at that batch, which shows what the
    scheduler costs. A burst (the requests sent at once) sampled with top-p 0.9 (a random model's
    flat rows are the sampler's worst case: the nucleus spans most of the vocabulary), greedy,
    and top-p through the sampler's torch lines; and the steady state a server lives in (as many
    requests always in flight, each replaced by a new prompt as it ends, their lengths spread so
    that they end at different steps), prompt tokens/s and the time to first token beside, with
    a prefill call every step, with prompts waiting up to 4 steps to share one, and in JSON mode;
    and the sampler alone,
    its one-launch kernel next to its torch lines;
  * a prefix's state moved between engines (export, pickle, import, first token) against
    prefilling it: what `state_move_min_tokens` weighs on a GPU.

    python bench/gpu.py [--models 0.1b,1.5b,7.2b] [--out DIR] [--no-rwkv] [--no-engine] [--explore] [--ws]

--ws also runs the large path's products on the warp-specialised matmul (replicas/model/ws_matmul.py,
Hopper only; not the runner's path yet): its error on the new prompt (outside the bar's verdict)
and its prefill rates under "Other paths", beside cuBLAS's in the same process.

Progress goes to stderr; the Markdown table to stdout and DIR/gpu_bench.md (DIR/gpu_bench.json
holds every number).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import math
import os
import subprocess
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from replicas.model.call_shapes import EXACT_PREFILL  # noqa: E402
from replicas.model.config import ModelConfig  # noqa: E402
from replicas.model.rwkv7 import RWKV7, wkv_chunked  # noqa: E402
from replicas.model.state import RNNState  # noqa: E402

SHAPES = {  # LoRA ranks of the released models (RWKV-LM's x070 formulas of C)
    "0.1b": ModelConfig(12, 768, 64, 65536, 3072, 64, 64, 32, 128),
    "1.5b": ModelConfig(24, 2048, 64, 65536, 8192, 96, 96, 64, 256),
    "7.2b": ModelConfig(32, 4096, 64, 65536, 16384, 128, 128, 96, 480),
}
DECODE_BATCHES = (1, 8, 64, 256)
PREFILLS = ((1, 4096), (16, 1024))
STEADY_CALLS = 12  # prefill calls timed back to back, beside the table's three
EXACTNESS_LENGTHS = (48, 17, 5, 64)  # the long prefill's rows (134 tokens: the cuBLAS path)
BARS = {  # from the issue: (model, case) -> tokens/s
    ("0.1b", "decode 1"): 3000, ("1.5b", "decode 1"): 1000, ("7.2b", "decode 1"): 230,
    ("1.5b", "decode 256"): 59000, ("7.2b", "decode 64"): 7500,
    ("1.5b", "prefill 1×4096"): 150000, ("7.2b", "prefill 1×4096"): 41000,
}
START = time.perf_counter()


def late(args) -> bool:
    """Past the run's deadline: the remaining cases are skipped so that the table still prints."""
    if time.perf_counter() - START > args.deadline:
        say("deadline passed: skipping")
        return True
    return False


def say(message: str) -> None:
    print(f"[{time.perf_counter() - START:6.1f}s] {message}", file=sys.stderr, flush=True)


# -- models -----------------------------------------------------------------------------------


@torch.no_grad()
def random_model(cfg: ModelConfig, dtype: torch.dtype, seed: int = 0, device: str = "cuda") -> RWKV7:
    """init_random's distributions, drawn on the device in the target dtype (on a GPU, a 7.2B model
    in seconds)."""
    with torch.device("meta"):
        model = RWKV7(cfg)
    model = model.to(dtype=dtype).to_empty(device=device).eval().requires_grad_(False)
    gen = torch.Generator(device=device).manual_seed(seed)
    C, F = cfg.n_embd, cfg.ffn_dim

    def normal(t, std):
        t.normal_(0.0, std, generator=gen)

    def uniform(t, low, high):
        t.uniform_(low, high, generator=gen)

    normal(model.emb.weight, 1.0)
    normal(model.head.weight, 1.0 / math.sqrt(C))
    for module in model.modules():
        if isinstance(module, torch.nn.LayerNorm | torch.nn.GroupNorm):
            uniform(module.weight, 0.8, 1.2)
            normal(module.bias, 0.05)
    for block in model.blocks:
        att, ffn = block.att, block.ffn
        for name in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"):
            uniform(getattr(att, name), 0.0, 1.0)
        uniform(ffn.x_k, 0.0, 1.0)
        uniform(att.w0, -4.0, 1.0)
        normal(att.a0, 0.5)
        normal(att.v0, 0.5)
        uniform(att.k_k, 0.6, 1.0)
        uniform(att.k_a, 0.6, 1.2)
        normal(att.r_k, 0.3)
        for name in "wavg":
            normal(getattr(att, f"{name}1"), 1.0 / math.sqrt(C))
            second = getattr(att, f"{name}2")
            normal(second, 1.0 / math.sqrt(second.shape[0]))
        for linear in (att.receptance, att.key, att.value, ffn.key):
            normal(linear.weight, 1.0 / math.sqrt(C))
        normal(att.output.weight, 0.5 / math.sqrt(C))
        normal(ffn.value.weight, 0.5 / math.sqrt(F))
    return model


def n_params(cfg: ModelConfig) -> dict[str, int]:
    C, F, V = cfg.n_embd, cfg.ffn_dim, cfg.vocab_size
    lora = 2 * C * (cfg.w_lora + cfg.a_lora + cfg.v_lora + cfg.g_lora)
    layer = 4 * C * C + 2 * C * F + lora + 20 * C
    return {"layers": cfg.n_layer * layer, "emb": V * C, "head": V * C + 2 * C}


# -- ceilings and limits ------------------------------------------------------------------------


def measure_ceilings(sustain_s: float = 2.0) -> dict[str, float]:
    """Copy bandwidth (bytes read + written per second) and bf16 matrix rate (FLOP/s), medians of
    short bursts; and the fp16 matrix rate sustained for sustain_s seconds on random operands of a
    7.2B prefill's FFN key product, which the GPU's power limit caps (an H200 at 700 W lowers its
    clock from 1,980 MHz to about 1,500 within a 7.2B prefill call; docs/gpu.md)."""
    src = torch.randn(1 << 30, device="cuda", dtype=torch.float32)  # 4 GiB
    dst = torch.empty_like(src)
    copy = median_ms(lambda: dst.copy_(src), reps=10)
    src = dst = None  # (4 GiB each)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm = median_ms(lambda: torch.mm(a, b), reps=10)
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    w = torch.randn(16384, 4096, device="cuda", dtype=torch.float16) / 64
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < sustain_s:
        for _ in range(10):
            torch.mm(x, w.t())
        torch.cuda.synchronize()
        calls += 10
    sustained = 2 * x.shape[0] * x.shape[1] * w.shape[0] * calls / (time.perf_counter() - start)
    return {"bandwidth": 2 * 4 * (1 << 30) / (copy / 1e3), "matmul": 2 * 8192**3 / (mm / 1e3),
            "matmul_sustained": sustained}


def median_ms(fn, reps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def decode_limit(cfg: ModelConfig, batch: int, ceil: dict, matmul: str = "matmul") -> float:
    p = n_params(cfg)
    weights = 2 * (p["layers"] + p["head"])
    bytes_ = weights + batch * (2 * cfg.state_bytes() + 4 * cfg.vocab_size + 2 * cfg.n_embd)
    flops = 2 * batch * (p["layers"] + p["head"])
    return batch / max(bytes_ / ceil["bandwidth"], flops / ceil[matmul])


def prefill_limit(cfg: ModelConfig, rows: int, length: int, ceil: dict, matmul: str = "matmul") -> float:
    """Tokens/s if the call took only its weights' bytes or its products' FLOPs at ceil[matmul]
    ("matmul": the burst rate; "matmul_sustained": under the power limit)."""
    p = n_params(cfg)
    tokens = rows * length
    bytes_ = 2 * (p["layers"] + p["head"]) + rows * 2 * cfg.state_bytes()
    flops = 2 * tokens * p["layers"] + 2 * rows * p["head"]
    return tokens / max(bytes_ / ceil["bandwidth"], flops / ceil[matmul])


# -- our runner ---------------------------------------------------------------------------------


@contextlib.contextmanager
def overridden(obj, **attrs):
    """obj's attributes set to these values inside the block, put back after it (errors too)."""
    saved = {name: getattr(obj, name) for name in attrs}
    for name, value in attrs.items():
        setattr(obj, name, value)
    try:
        yield obj
    finally:
        for name, value in saved.items():
            setattr(obj, name, value)


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).norm() / ref.float().norm()).item()


@torch.no_grad()
def exactness(model: RWKV7, runner, ws: bool = False) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Our paths against the fp32 reference on the same (fp16) weights: relative logit errors, and
    the long prefill's per row (which row a large error comes from)."""
    from replicas.model.runner import ModelRunner  # noqa: PLC0415

    with torch.device("meta"):
        ref_model = RWKV7(model.config)
    ref_model.load_state_dict({k: v.float() for k, v in model.state_dict().items()}, assign=True)
    reference = ModelRunner(ref_model.eval(), max_slots=8)
    gen = torch.Generator().manual_seed(1)
    V = model.config.vocab_size

    def toks(n):
        return torch.randint(0, V, (n,), generator=gen).tolist()

    errors = {}
    slots = [0, 1, 2, 3]
    for slot in slots:
        reference.reset(slot)
    chunks = [toks(n) for n in EXACTNESS_LENGTHS]
    expected = reference.prefill(slots, chunks)

    rows: dict[str, list[float]] = {}

    zeros = RNNState.zeros(model.config, 1, runner.device)

    def prefill_from_zero(fresh: bool = True, **settings) -> float:
        with overridden(runner, **settings):
            for slot in slots:
                if fresh:
                    runner.reset(slot)
                else:  # zeros written: the runner does not know the rows are new
                    runner.write_state(slot, zeros)
            ours = runner.prefill(slots, chunks)
            label = " ".join(f"{k}={v}" for k, v in settings.items()) if fresh else "not fresh"
            rows[label] = [round(rel_err(ours[i], expected[i]), 6) for i in range(len(slots))]
            return rel_err(ours, expected)

    for wkv in ("chunked", "recurrent") if runner.prefill_wkv == "chunked" else ("recurrent",):
        errors[f"prefill {wkv}"] = prefill_from_zero(prefill_wkv=wkv)
    for_scale = f"(products written in fp32, for scale) prefill {runner.prefill_wkv}"
    errors[for_scale] = prefill_from_zero(fp32_outputs_prefill=True)  # what writing them in fp32 would buy
    for_scale = f"(first tokens in fp16 too, for scale) prefill {runner.prefill_wkv}"
    errors[for_scale] = prefill_from_zero(fresh=False)  # what the fp32 first token spares
    short = [toks(EXACT_PREFILL - 5), toks(5)]  # a call of EXACT_PREFILL tokens: the gemv path, fp32 activations
    for slot in (6, 7):
        runner.reset(slot)
        reference.reset(slot)
    errors["prefill short (gemv)"] = rel_err(runner.prefill([6, 7], short), reference.prefill([6, 7], short))
    fp16_out = {"fp32_outputs_decode": False}
    eight = slots + [slot + 4 for slot in slots]  # slots 4-7 take 0-3's states (the cases below reset them)
    for slot in slots:
        reference.write_state(slot + 4, reference.read_state(slot))
    for name, small, settings, decode_rows in (
            ("decode gemv (graph)", 16, {}, slots), ("decode cuBLAS (graph)", 0, {}, slots),
            ("decode gemv, eight rows (graph)", 16, {}, eight),  # the tensor cores
            ("decode gemv, one row (graph)", 16, {}, slots[:1]),  # (the live-rows value product)
            ("(products written in fp16, for scale) decode cuBLAS", 0, fp16_out, slots)):
        worst = 0.0
        for slot in decode_rows:  # each path from the reference's states: its own error, not the prefill's
            runner.write_state(slot, reference.read_state(slot))
        with overridden(runner, small_batch=small, auto_path=False, **settings):
            for _ in range(3):
                t = toks(len(decode_rows))
                worst = max(worst, rel_err(runner.decode(decode_rows, t), reference.decode(decode_rows, t)))
        errors[name] = worst
    # for scale: the same math in plain torch fp16 (rwkv7.py on the fp16 weights) on the same inputs
    plain = ModelRunner(model, max_slots=8)
    for slot in slots:
        plain.reset(slot)
    errors["(torch fp16, for scale) prefill"] = rel_err(plain.prefill(slots, chunks), expected)
    for slot in slots:
        plain.write_state(slot, reference.read_state(slot))
    t = toks(len(slots))
    errors["(torch fp16, for scale) decode"] = rel_err(plain.decode(slots, t), reference.decode(slots, t))
    for slot in slots:  # back in step with our runner
        reference.write_state(slot, runner.read_state(slot))
    del plain
    fresh = [5, 6]
    for slot in fresh:
        runner.reset(slot)
        reference.reset(slot)
    chunks, t = [toks(31), toks(9)], toks(2)
    ours = torch.cat([runner.prefill(fresh, chunks), runner.decode(slots[:2], t)])
    theirs = torch.cat([reference.prefill(fresh, chunks), reference.decode(slots[:2], t)])
    errors["mixed step (short prefill + decode)"] = rel_err(ours, theirs)
    # the benchmark's prefill itself: a new prompt of 4,096 tokens (the reference's recurrence in
    # the chunked form, rwkv7.wkv_chunked: the token loop would take minutes)
    long_ref = ModelRunner(ref_model, max_slots=1, wkv=wkv_chunked)
    long = toks(4096)
    runner.reset(7)
    expected_long = long_ref.prefill([0], [long])
    errors["prefill 1 × 4,096, new prompt"] = rel_err(runner.prefill([7], [long]), expected_long)
    if ws:  # (not the runner's path yet: outside the bar's verdict)
        runner.reset(7)
        with overridden(runner, large_mm="ws"):
            errors[WS_NEW_PROMPT] = rel_err(runner.prefill([7], [long]), expected_long)
    del reference, long_ref
    torch.cuda.empty_cache()
    return errors, rows


WS_NEW_PROMPT = "(the warp-specialised matmul, not in the runner's path) prefill 1 × 4,096, new prompt"


def ws_checked() -> bool:
    """Whether --ws can run: a Hopper GPU, and ws_matmul's default launch agreeing with torch in a
    process of its own (a launch whose barriers never complete would hang this one)."""
    if torch.cuda.get_device_capability()[0] != 9:
        say("--ws: not a Hopper GPU; skipped")
        return False
    from replicas.model.ws_matmul import check_in_child  # noqa: PLC0415

    passed, out = check_in_child(["{}"])
    say(f"--ws: the warp-specialised matmul's check: {out}")
    return bool(passed)


def time_decode(runner, batch: int, seconds: float = 0.4) -> float:
    slots = list(range(batch))
    tokens = torch.randint(0, runner.vocab_size, (batch,)).tolist()
    runner.capture([batch])
    for _ in range(3):
        runner.decode(slots, tokens)
    torch.cuda.synchronize()
    steps, elapsed = 5, 0.0
    while True:
        start = time.perf_counter()
        for _ in range(steps):
            runner.decode(slots, tokens)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if elapsed > seconds / 4 or steps >= 2000:
            break
        steps = min(2000, int(steps * seconds / max(elapsed, 1e-4)))
    return batch * steps / elapsed


def live_share(runner, steps: int = 8) -> float:
    """The share of hidden units whose rows of the value matrix a one-row decode step reads (the
    live-rows kernel skips those whose relu² is 0): the mean over layers and steps, graphs off."""
    from replicas.model import kernels as K  # noqa: PLC0415

    shares, run = [], K.gemv_live_rows

    def counting(a, wt, y, m, **kwargs):
        shares.append((a[:m] != 0).any(0).float().mean().item())
        return run(a, wt, y, m, **kwargs)

    runner.reset(0)
    with overridden(K, gemv_live_rows=counting), overridden(runner, graphs=False):
        for token in torch.randint(0, runner.vocab_size, (steps,)).tolist():
            runner.decode([0], [token])
    return sum(shares) / len(shares)


def time_prefill(runner, rows: int, length: int, reps: int = 3, graph: bool = True, fresh: bool = True) -> float:
    """New prompts (rows from the zero state, whose first token takes the fp32 path: see
    cuda_runner.prefill), or with fresh=False rows that go on from their states (a cached prefix),
    in a prefill shape that recurs (its CUDA graph replayed), or with graph=False, every call's
    kernels launched one by one (what a shape seen for the first time costs)."""
    slots = list(range(rows))
    chunks = [torch.randint(0, runner.vocab_size, (length,)).tolist() for _ in range(rows)]

    def one_call():
        for slot in slots if fresh else ():
            runner.reset(slot)
        runner.prefill(slots, chunks)

    with overridden(runner, prefill_graphs=runner.prefill_graphs if graph else 0):
        for _ in range(2):  # compile, allocate; the second sight of a shape captures its graph
            one_call()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(reps):
            one_call()
        torch.cuda.synchronize()
        return rows * length * reps / (time.perf_counter() - start)


def bench_ours(name: str, args, results: dict) -> None:
    from replicas.model.cuda_runner import CudaRunner  # noqa: PLC0415

    cfg = SHAPES[name]
    say(f"{name}: building a random model on the GPU")
    model = random_model(cfg, torch.float16)  # the runner's dtype (cuda_runner.py says why fp16)
    runner = CudaRunner(model, max_slots=max(DECODE_BATCHES))
    say(f"{name}: prefill wkv = {runner.prefill_wkv}; exactness against the fp32 reference")
    try:
        errs, rows = exactness(model, runner, ws=args.ws)
        results["exactness"][name] = errs
        results["exactness_rows"][name] = rows
        say(f"{name}: relative logit errors {json.dumps({k: round(v, 5) for k, v in errs.items()})}")
        say(f"{name}: long prefill per row ({', '.join(map(str, EXACTNESS_LENGTHS))} tokens): {json.dumps(rows)}")
    except Exception:
        say(f"{name}: exactness FAILED\n{traceback.format_exc()}")
        results["exactness"][name] = {"error": traceback.format_exc(limit=3)}
    del model
    torch.cuda.empty_cache()
    for batch in DECODE_BATCHES:
        case = f"decode {batch}"
        if late(args):
            break
        try:
            t0 = time.perf_counter()
            rate = time_decode(runner, batch)
            results["ours"][f"{name}|{case}"] = rate
            say(f"{name}: {case}: {rate:,.0f} tokens/s ({time.perf_counter() - t0:.1f}s with capture)")
        except Exception:
            say(f"{name}: {case} FAILED\n{traceback.format_exc()}")
    say(f"{name}: decode path per bucket (True = gemv): {runner.path_choice}")
    if not runner.live_rows:
        say(f"{name}: the value product reads every hidden unit (W_v under LIVE_ROWS_MIN_BYTES)")
    elif not late(args):  # what the live-rows value product reads, and the step without it
        try:
            results["live_rows"][name] = share = live_share(runner)
            with overridden(runner, live_rows=False):
                rate = time_decode(runner, 1)
            results["explore"][f"{name}|decode 1, the value product reading every hidden unit"] = rate
            say(f"{name}: the value product reads {share:.1%} of the hidden units at one decode row; "
                f"reading all of them, decode 1: {rate:,.0f} tokens/s")
        except Exception:
            say(f"{name}: live rows FAILED\n{traceback.format_exc(limit=4)}")
    for batch in (64, 256):  # cuBLAS's products written in fp16 instead (what fp32_outputs_decode buys)
        if late(args):
            break
        with overridden(runner, fp32_outputs_decode=False):
            rate = time_decode(runner, batch)
        results["explore"][f"{name}|decode {batch} products written in fp16"] = rate
        say(f"{name}: decode {batch}, products written in fp16: {rate:,.0f} tokens/s")
    if args.explore and not late(args):  # both decode paths at the batch sizes where either could be chosen
        for batch, small in ((1, 0), (8, 8), (8, 0), (32, 32), (32, 0), (64, 64), (64, 0)):
            try:
                with overridden(runner, small_batch=small, auto_path=False):
                    rate = time_decode(runner, batch)
                results["explore"][f"{name}|decode {batch} {'gemv' if small else 'cublas'}"] = rate
                say(f"{name}: explore decode {batch} {'gemv' if small else 'cuBLAS'}: {rate:,.0f} tokens/s")
            except Exception:
                say(f"{name}: explore decode {batch} FAILED\n{traceback.format_exc(limit=4)}")
    for rows, length in PREFILLS:
        case = f"prefill {rows}×{length}"
        if late(args):
            break
        try:
            rate = time_prefill(runner, rows, length)
            results["ours"][f"{name}|{case}"] = rate
            eager = time_prefill(runner, rows, length, graph=False)
            results["explore"][f"{name}|{case} without graph"] = eager
            with overridden(runner, fp32_outputs_prefill=True):
                fp32_out = time_prefill(runner, rows, length)
            results["explore"][f"{name}|{case} products written in fp32"] = fp32_out
            going_on = time_prefill(runner, rows, length, fresh=False)
            results["explore"][f"{name}|{case} going on from a state"] = going_on
            if args.ws:  # the large path's products on the warp-specialised matmul, three calls and twelve
                with overridden(runner, large_mm="ws"):
                    for reps, label in ((3, ""), (STEADY_CALLS, f" {STEADY_CALLS} calls back to back")):
                        ws_rate = time_prefill(runner, rows, length, reps=reps)
                        results["explore"][f"{name}|{case} warp-specialised matmul{label}"] = ws_rate
                        say(f"{name}: {case} on the warp-specialised matmul{label}: {ws_rate:,.0f} tokens/s")
            # the table's timing (three calls) carries the first call's host work and graph launch;
            # over more calls the GPU's power limit lowers its clock instead: both are shown
            steady = time_prefill(runner, rows, length, reps=STEADY_CALLS)
            results["explore"][f"{name}|{case} {STEADY_CALLS} calls back to back"] = steady
            say(f"{name}: {case}: {rate:,.0f} tokens/s (graph); {eager:,.0f} without; {fp32_out:,.0f} fp32 outputs; "
                f"{going_on:,.0f} going on from a state; {steady:,.0f} over {STEADY_CALLS} calls back to back")
        except Exception:
            say(f"{name}: {case} FAILED\n{traceback.format_exc()}")
    if args.explore and runner.prefill_wkv == "chunked" and not late(args):
        try:
            with overridden(runner, prefill_wkv="recurrent"):
                rate = time_prefill(runner, 1, 4096, reps=1)
            results["explore"][f"{name}|prefill 1×4096 recurrent"] = rate
            say(f"{name}: explore prefill 1×4096 recurrent wkv: {rate:,.0f} tokens/s")
        except Exception:
            say(f"{name}: explore recurrent FAILED\n{traceback.format_exc(limit=4)}")
    if name == args.profile_model and not late(args):
        try:
            profile(runner)
        except Exception:
            say(f"profile FAILED\n{traceback.format_exc(limit=4)}")
    if name == args.engine_model and not args.no_engine:
        try:
            bench_engine(runner, results)
        except Exception:
            say(f"engine FAILED\n{traceback.format_exc()}")
    del runner
    torch.cuda.empty_cache()


def profile(runner) -> None:
    """Where the time goes: the CUDA kernels of one prefill (1 × 4096) and of decode steps."""
    from torch.profiler import ProfilerActivity  # noqa: PLC0415
    from torch.profiler import profile as torch_profile  # noqa: PLC0415

    chunk = torch.randint(0, runner.vocab_size, (4096,)).tolist()
    cases = [("prefill 1×4096", lambda: runner.prefill([0], [chunk])),  # kernel by kernel (no graph, below)
             ("prefill 1×4096 of a new prompt", lambda: (runner.reset(0), runner.prefill([0], [chunk])))]
    for batch in (1, 256):
        tokens = torch.randint(0, runner.vocab_size, (batch,)).tolist()
        cases.append((f"decode {batch} (5 steps)", lambda b=batch, t=tokens: [runner.decode(list(range(b)), t)
                                                                              for _ in range(5)]))
    with overridden(runner, prefill_graphs=0):
        for label, fn in cases:
            fn()
            torch.cuda.synchronize()
            with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
            events = [e for e in prof.key_averages() if e.device_time_total > 0]
            total = sum(e.device_time_total for e in events)
            say(f"profile {label}: {total / 1e3:.2f} ms of kernels")
            for e in sorted(events, key=lambda e: -e.device_time_total)[:14]:
                say(f"    {e.device_time_total / 1e3:8.3f} ms {e.count:5d}×  {e.key[:110]}")


def time_sampler(results: dict) -> None:
    """The sampler alone on the GPU (the engine's share that is not the model): its one-launch
    kernel next to its torch lines, on the same rows, ms a step (the tokens read back)."""
    from replicas.sampling import Sampler, SamplingParams  # noqa: PLC0415

    for batch in (64, 256):
        logits = torch.randn(batch, 65536, device="cuda")
        for label, p in (("greedy", SamplingParams(temperature=0.0)),
                         ("top-p 0.9", SamplingParams(temperature=1.0, top_p=0.9)),
                         ("top-k 50, penalties", SamplingParams(temperature=1.0, top_k=50, presence_penalty=0.5))):
            params, slots, uniforms = [p] * batch, list(range(batch)), [0.5] * batch
            ms = {}
            for way, kernel in (("torch", False), ("kernel", True)):
                sampler = Sampler(batch, 65536, "cuda", kernel=kernel)
                sampler.sample(logits, slots, params, uniforms)
                start = time.perf_counter()
                for _ in range(10):
                    sampler.sample(logits, slots, params, uniforms)
                ms[way] = (time.perf_counter() - start) * 100
            results["sampler"][f"{batch} {label}"] = ms
            say(f"sampler: batch {batch}, {label}: kernel {ms['kernel']:.3f} ms a step, torch lines "
                f"{ms['torch']:.2f} ({ms['torch'] / ms['kernel']:.1f}x)")


# -- the engine ---------------------------------------------------------------------------------


def bench_engine(runner, results: dict) -> None:
    """Concurrent requests through the batcher (no Ray): generated tokens/s."""
    from engine_cpu import generated_rate, steady_rate  # noqa: PLC0415 (bench/engine_cpu.py, beside this file)

    from replicas.engine import Engine, EngineConfig  # noqa: PLC0415
    from replicas.model.checkpoint import WORLD_VOCAB  # noqa: PLC0415
    from replicas.sampling import SamplingParams  # noqa: PLC0415
    from replicas.tokenizer import load_tokenizer  # noqa: PLC0415

    tokenizer = load_tokenizer(WORLD_VOCAB)

    def fresh_engine(config: EngineConfig) -> Engine:
        """An engine a case, its cache empty, every slot new: one engine for the three burst cases
        slowed the later ones (12-01o's run of record; .carry/gpu/ab60.py against ab61.py)."""
        for slot in range(runner.max_slots):
            runner.reset(slot)
        return Engine(runner, tokenizer, config).start(say)  # (the first pins the host tier: ~7 s)

    time_sampler(results)
    runner.warm_up(say)  # every bucket (the engine's batch size changes) and every prefill kernel variant
    for concurrency in (64, 256):
        # the cache's default device tier: half the GPU memory free when the engine is made
        config = EngineConfig(max_slots=concurrency, max_waiting=4 * concurrency, max_prefill_tokens=4096,
                              token_chunk_size=512, host_cache_bytes=16 << 30)
        rates, stats = {}, {}
        # JSON mode: every row writes one JSON object (json_object), so its tokens are banned by the
        # state it is in; a random model's objects end sooner than 128 tokens, and nest deeper than
        # a trained model's (more states, each a new mask on the host)
        cases = (("top-p 0.9", 1.0, True, False), ("greedy", 0.0, True, False),
                 ("top-p 0.9, torch sampler", 1.0, False, False), ("top-p 0.9, JSON mode", 1.0, True, True))
        for seed, (label, temperature, kernel, json_mode) in enumerate(cases):
            engine = fresh_engine(config)
            engine.sampler.kernel = kernel
            params = SamplingParams(max_tokens=128, temperature=temperature, top_p=0.9, seed=0, ignore_eos=True,
                                    json_object=json_mode)
            gen = torch.Generator().manual_seed(10 * concurrency + seed)  # (no prefix shared across)
            warm, prompts = ([torch.randint(1, 65536, (64,), generator=gen).tolist() for _ in range(concurrency)]
                             for _ in range(2))
            rates[label] = asyncio.run(generated_rate(engine, prompts, params, warm))
            stats[label] = engine.snapshot_stats()["counters"]
            engine.stop()
            del engine
        # serving's steady state: as many requests always in flight, each replaced as it ends; with
        # a prefill call every step (the default), with new prompts waiting up to 4 steps to share
        # one, and in JSON mode (a row that closes its object ends, and a new one takes its place).
        # Timed after 5 s of the same load: a prefill shape runs without a graph on its first two
        # sights (about 15 ms of launches a call at 1.5B)
        steady, params = {}, SamplingParams(temperature=1.0, top_p=0.9, seed=0, ignore_eos=True)
        for key, every, json_mode in (("steady", 1, False), ("steady_every_4", 4, False), ("steady_json", 1, True)):
            engine = fresh_engine(config.model_copy(update={"prefill_every": every}))
            steady[key] = asyncio.run(steady_rate(engine, concurrency, 64, replace(params, json_object=json_mode),
                                                  seconds=3.0, warm_seconds=5.0))
            stats[key] = engine.snapshot_stats()["counters"]
            engine.stop()
            del engine
        raw = time_decode(runner, concurrency, seconds=0.3)
        results["engine"][f"{concurrency}"] = {"engine": rates["top-p 0.9"], "engine_greedy": rates["greedy"],
                                               "engine_torch_sampler": rates["top-p 0.9, torch sampler"],
                                               "engine_json": rates["top-p 0.9, JSON mode"],
                                               **steady,
                                               "raw_decode": raw, "counters": stats}
        say(f"engine: {concurrency} concurrent requests × 128 tokens (64-token prompts): "
            f"{rates['top-p 0.9']:,.0f} generated tokens/s with top-p 0.9, {rates['greedy']:,.0f} greedy, "
            f"{rates['top-p 0.9, torch sampler']:,.0f} top-p through the torch sampler, "
            f"{rates['top-p 0.9, JSON mode']:,.0f} in JSON mode; steady, {concurrency} "
            f"always in flight: {_steady(steady['steady'])} (prompts waiting up to 4 steps: "
            f"{_steady(steady['steady_every_4'])}; JSON mode: {_steady(steady['steady_json'])}); "
            f"runner alone {raw:,.0f}")
    for prefix in (512, 4096):
        time_state_move(fresh_engine, EngineConfig(max_slots=8, max_prefill_tokens=4096, token_chunk_size=512),
                        results, prefix)


def time_state_move(fresh_engine, config, results: dict, prefix: int = 4096, suffix: int = 16) -> None:
    """What moving a prefix's state between replicas costs on this GPU, against prefilling it: one
    engine prefills a `prefix`-token prompt, exports its state (a host copy), the state goes
    through pickle three times (a served move pickles it from the holder's engine process to its
    replica, through Ray to the other replica, and on to that replica's engine process; a network
    between nodes adds its transfer), a fresh engine imports it and answers the prompt plus
    `suffix` tokens. Beside, a fresh engine prefills a new prompt of the same length. Medians of
    three."""
    import pickle  # noqa: PLC0415

    from engine_cpu import first_token_seconds  # noqa: PLC0415

    gen = torch.Generator().manual_seed(7)
    times: dict[str, list[float]] = {k: [] for k in ("export", "pickle", "import", "first_token_moved", "prefilled")}
    nbytes = 0
    for rep in range(4):  # the first is a warm-up of every shape
        prompt, cold = (torch.randint(1, 65536, (prefix + suffix,), generator=gen).tolist() for _ in range(2))
        engine = fresh_engine(config)
        asyncio.run(first_token_seconds(engine, prompt[:prefix]))
        namespace, _ = engine.held_prefix(None, prompt)
        t0 = time.perf_counter()
        snapshot, moved = engine.export_prefix(namespace, prompt)
        t1 = time.perf_counter()
        for _ in range(3):
            snapshot = pickle.loads(pickle.dumps(snapshot, protocol=pickle.HIGHEST_PROTOCOL))
        t2 = time.perf_counter()
        engine.stop()
        engine = fresh_engine(config)
        t3 = time.perf_counter()
        engine.import_prefix(namespace, prompt[:moved], snapshot)
        t4 = time.perf_counter()
        first, _, cached = asyncio.run(first_token_seconds(engine, prompt))
        assert cached == moved, f"the imported state was not used ({cached} of {moved} tokens cached)"
        prefilled, _, _ = asyncio.run(first_token_seconds(engine, cold))
        engine.stop()
        if rep:
            for key, value in zip(times, (t1 - t0, t2 - t1, t4 - t3, first, prefilled), strict=True):
                times[key].append(value)
        nbytes = snapshot.nbytes
    ms = {k: 1e3 * sorted(v)[len(v) // 2] for k, v in times.items()}
    ms["moved"] = ms["export"] + ms["pickle"] + ms["import"] + ms["first_token_moved"]
    results["state_move"].append({"prefix": prefix, "suffix": suffix, "MiB": nbytes / 2**20, **ms})
    say(f"state move, {prefix} + {suffix} tokens: {nbytes / 2**20:.1f} MiB; export {ms['export']:.1f} ms, "
        f"pickle {ms['pickle']:.1f}, import {ms['import']:.1f}, first token {ms['first_token_moved']:.1f} "
        f"= {ms['moved']:.1f} ms against {ms['prefilled']:.1f} ms prefilled")


def _steady(s: dict) -> str:
    """A steady state's figures for the table: generated + prompt tokens/s, time to first token."""
    return f"{s['generated']:,.0f} + {s['prompt']:,.0f}, first token {s['ttft_p50_ms']:.0f} / {s['ttft_p90_ms']:.0f} ms"


# -- the rwkv package (child process) -----------------------------------------------------------


def rwkv_child(name: str, out: Path, budget: float) -> None:
    os.environ["RWKV_V7_ON"] = "1"
    os.environ.setdefault("RWKV_CUDA_ON", "1")
    os.environ.setdefault("RWKV_JIT_ON", "1")
    cfg = SHAPES[name]
    model = random_model(cfg, torch.float16)
    sd = {}
    for key, tensor in model.state_dict().items():
        suffix = key.split(".", 2)[-1] if key.startswith("blocks.") else key
        vector = suffix in ("att.x_r", "att.x_w", "att.x_k", "att.x_v", "att.x_a", "att.x_g", "att.w0", "att.a0",
                            "att.v0", "att.k_k", "att.k_a", "ffn.x_k")
        sd[key] = tensor.view(1, 1, -1) if vector else tensor
    del model
    import rwkv.model as rwkv_model  # noqa: PLC0415 - compiles (or loads) its CUDA kernels

    load = torch.load
    torch.load = lambda *a, _sd=sd, **k: _sd  # its loader reads a .pth; hand it the tensors instead
    try:
        rw = rwkv_model.RWKV("random-" + name, "cuda fp16")
    finally:
        torch.load = load
    del sd
    result = {}
    started = time.perf_counter()
    _, state = rw.forward([1], None)
    for t in range(5):
        _, state = rw.forward([t + 2], state)
    torch.cuda.synchronize()
    steps = 40 if name != "7.2b" else 20
    start = time.perf_counter()
    for t in range(steps):
        _, state = rw.forward([100 + t], state)
    torch.cuda.synchronize()
    result["decode 1"] = steps / (time.perf_counter() - start)
    for length in (4096, 1024):
        if time.perf_counter() - started > budget:
            break
        try:
            tokens = torch.randint(0, cfg.vocab_size, (length,)).tolist()
            rw.forward(tokens, None)
            torch.cuda.synchronize()
            start = time.perf_counter()
            rw.forward(tokens, None)
            torch.cuda.synchronize()
            result[f"prefill 1×{length}"] = length / (time.perf_counter() - start)
        except Exception as err:
            result[f"prefill 1×{length} error"] = str(err)[:200]
    result["cuda_kernels"] = os.environ["RWKV_CUDA_ON"] == "1"
    out.write_text(json.dumps(result))


def bench_rwkv(name: str, args, results: dict) -> None:
    out = Path(args.scratch) / f"rwkv_{name}.json"
    left = args.deadline + args.rwkv_time - (time.perf_counter() - START)
    if left < 30:
        say(f"{name}: no time left for the rwkv package")
        return
    say(f"{name}: the rwkv package (child process)")
    cmd = [sys.executable, __file__, "--rwkv-child", name, "--scratch", args.scratch]
    try:
        for cuda_on in ("1", "0"):  # its CUDA kernels if they build here, else its torch path
            env = {**os.environ, "RWKV_CUDA_ON": cuda_on}
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=min(left, 150), env=env)
            if proc.returncode == 0 and out.exists():
                break
            say(f"{name}: rwkv child (RWKV_CUDA_ON={cuda_on}) failed ({proc.returncode}): {proc.stderr[-1500:]}")
        else:
            return
        numbers = json.loads(out.read_text())
        if not numbers.pop("cuda_kernels"):
            numbers = {f"{k} (CUDA kernels off)" if not k.endswith("error") else k: v for k, v in numbers.items()}
        for case, value in numbers.items():
            results["rwkv"][f"{name}|{case}"] = value
        say(f"{name}: rwkv {numbers}")
    except subprocess.TimeoutExpired:
        say(f"{name}: rwkv child timed out")


# -- the table ----------------------------------------------------------------------------------


def table(results: dict, models: list[str]) -> str:
    ceil = results["ceilings"]
    gpu = results["gpu"]
    sustained = "matmul_sustained" in ceil  # (results of runs before 12-03 lack it)
    lines = [
        f"GPU: {gpu}; measured copy bandwidth {ceil['bandwidth'] / 1e12:.2f} TB/s, "
        f"bf16 matmul {ceil['matmul'] / 1e12:.0f} TFLOP/s"
        + (f" (fp16 sustained under the power limit: {ceil['matmul_sustained'] / 1e12:.0f})" if sustained else "")
        + f"; {results['date']}",
        "",
        "| model | case | rwkv-fleet tokens/s | rwkv 0.8.32 tokens/s | limit tokens/s | of limit "
        + ("| limit at the sustained rate " if sustained else "") + "| bar | meets |",
        "|---|---|---:|---:|---:|---:|" + ("---:|" if sustained else "") + "---:|---|",
    ]
    for name in models:
        cfg = SHAPES[name]
        cases = [f"decode {b}" for b in DECODE_BATCHES] + [f"prefill {r}×{n}" for r, n in PREFILLS]
        for case in cases:
            ours = results["ours"].get(f"{name}|{case}")
            if case.startswith("decode"):
                limit_at = functools.partial(decode_limit, cfg, int(case.split()[1]), ceil)
            else:
                limit_at = functools.partial(prefill_limit, cfg, *(int(v) for v in case.split()[1].split("×")), ceil)
            limit = limit_at("matmul")
            held = f" {limit_at('matmul_sustained'):,.0f} |" if sustained else ""
            ref = results["rwkv"].get(f"{name}|{case}")
            if ref is None and case == "prefill 1×4096" and f"{name}|prefill 1×1024" in results["rwkv"]:
                ref_text = f"{results['rwkv'][f'{name}|prefill 1×1024']:,.0f} (1×1024)"
            else:
                ref_text = f"{ref:,.0f}" if ref is not None else "—"
            bar = BARS.get((name, case))
            bar_text = f"{bar:,}" if bar else ""
            if ours is None:
                lines.append(f"| {name} | {case} | not run (log) | {ref_text} | {limit:,.0f} | — |{held} "
                             f"{bar_text} | — |")
                continue
            meets = "" if bar is None else ("yes" if ours >= bar else "**no**")
            lines.append(f"| {name} | {case} | {ours:,.0f} | {ref_text} | {limit:,.0f} | {ours / limit:.0%} |{held} "
                         f"{bar_text} | {meets} |")
    if results["exactness"]:
        lines += ["", "Exactness (relative logit error against the fp32 reference, bar 1e-2):", ""]
        for name, errs in results["exactness"].items():
            if "error" in errs:
                lines.append(f"- {name}: FAILED")
                continue
            worst = max(v for k, v in errs.items() if not k.startswith("("))
            detail = ", ".join(f"{k} {v:.1e}" for k, v in errs.items())
            lines.append(f"- {name}: {'pass' if worst <= 1e-2 else '**FAIL**'} ({detail})")
    if results["live_rows"]:
        lines += ["", "Hidden units whose value rows a one-row decode step reads (relu² not 0; random "
                  "weights): " + ", ".join(f"{k} {v:.1%}" for k, v in results["live_rows"].items())]
    if results["engine"]:
        lines += ["", "Engine (continuous batcher, sampling on the GPU). A burst: the requests sent at once, "
                  "64-token prompts, 128 new tokens each. Steady: as many always in flight, each replaced as it "
                  "ends, prompts of 32-96 tokens, 32-224 new tokens (generated tokens/s + prompt tokens/s, the "
                  "time to first token's median / 90th percentile), with a prefill call every step (the engine's "
                  "default), with new prompts waiting up to 4 steps to share one (`prefill_every` 4), and in JSON "
                  "mode (`json_object`: a row ends where its object closes, and a new request takes its place):",
                  "", "| requests | burst, top-p 0.9 | burst, greedy | burst, top-p, the torch sampler | "
                  "burst, top-p, JSON mode | steady, top-p 0.9 | steady, prefill_every 4 | steady, JSON mode | "
                  "runner decode tokens/s | burst top-p / greedy / steady, of the runner |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for concurrency, e in results["engine"].items():
            raw = e["raw_decode"]
            json_cell = "—"
            if "engine_json" in e:  # (its rows end where their objects close: tokens a request beside it)
                made = e["counters"]["top-p 0.9, JSON mode"]["generated_tokens"] / (2 * int(concurrency))
                json_cell = f"{e['engine_json']:,.0f} ({made:.0f} tokens a request)"
            steady_json = _steady(e["steady_json"]) if "steady_json" in e else "—"
            lines.append(f"| {concurrency} | {e['engine']:,.0f} | {e['engine_greedy']:,.0f} | "
                         f"{e['engine_torch_sampler']:,.0f} | {json_cell} | {_steady(e['steady'])} | "
                         f"{_steady(e['steady_every_4'])} | {steady_json} | "
                         f"{raw:,.0f} | {e['engine'] / raw:.0%} / "
                         f"{e['engine_greedy'] / raw:.0%} / {e['steady']['generated'] / raw:.0%} |")
    if results.get("state_move"):
        lines += ["", f"A prefix's state moved to another engine against prefilled ({results['engine_model']}; ms, "
                  f"medians of three; the prompt is the prefix and 16 new tokens; the state "
                  f"{results['state_move'][0]['MiB']:.1f} MiB; pickled three times, as a served move on one node "
                  "carries it):", "",
                  "| prefix tokens | export | pickle | import | first token from the moved state | moved, in all | "
                  "prefilled | prefilled / moved |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {m['prefix']:,} | {m['export']:.1f} | {m['pickle']:.1f} | {m['import']:.1f} | "
                  f"{m['first_token_moved']:.1f} | {m['moved']:.1f} | {m['prefilled']:.1f} | "
                  f"{m['prefilled'] / m['moved']:.1f}x |" for m in results["state_move"]]
    if results["sampler"]:
        lines += ["", "Sampler alone (GPU, ms a step, the tokens read back):", "",
                  "| batch, sampling | one-launch kernel | torch lines | torch / kernel |", "|---|---:|---:|---:|"]
        lines += [f"| {k} | {v['kernel']:.3f} | {v['torch']:.2f} | {v['torch'] / v['kernel']:.1f}x |"
                  for k, v in results["sampler"].items()]
    if results["explore"]:
        lines += ["", "Other paths:", ""] + [f"- {k}: {v:,.0f} tokens/s" for k, v in results["explore"].items()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="0.1b,1.5b,7.2b")
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--no-rwkv", action="store_true")
    parser.add_argument("--no-engine", action="store_true")
    parser.add_argument("--engine-model", default="1.5b")
    parser.add_argument("--profile-model", default="1.5b")
    parser.add_argument("--explore", action="store_true", help="also time the other decode/prefill paths")
    parser.add_argument("--deadline", type=float, default=1e9, help="seconds after which our cases are skipped")
    parser.add_argument("--rwkv-time", type=float, default=150, help="seconds for the rwkv package after that")
    parser.add_argument("--scratch", default="/tmp/rwkv-fleet-bench", help="the rwkv child's result files")
    parser.add_argument("--ws", action="store_true",
                        help="also the large path on the warp-specialised matmul (ws_matmul.py, Hopper): "
                             "its exactness on the new prompt and its prefill rates, under Other paths")
    parser.add_argument("--rwkv-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    Path(args.scratch).mkdir(parents=True, exist_ok=True)
    if args.rwkv_child:
        rwkv_child(args.rwkv_child, Path(args.scratch) / f"rwkv_{args.rwkv_child}.json", budget=60)
        return
    Path(args.out).mkdir(parents=True, exist_ok=True)
    models = args.models.split(",")
    results = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
               "ours": {}, "rwkv": {}, "exactness": {}, "exactness_rows": {}, "engine": {}, "explore": {},
               "sampler": {}, "live_rows": {}, "state_move": [], "engine_model": args.engine_model}
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference stays fp32
    torch.backends.cudnn.allow_tf32 = False
    if args.ws:
        args.ws = ws_checked()
    results["ceilings"] = measure_ceilings()
    torch.cuda.empty_cache()
    say(f"ceilings: {results['ceilings']['bandwidth'] / 1e12:.2f} TB/s, "
        f"{results['ceilings']['matmul'] / 1e12:.0f} TFLOP/s "
        f"({results['ceilings']['matmul_sustained'] / 1e12:.0f} sustained, fp16)")
    for name in models:
        bench_ours(name, args, results)
        (Path(args.out) / "gpu_bench.json").write_text(json.dumps(results, indent=1, default=str))
    if not args.no_rwkv:
        for name in models:
            bench_rwkv(name, args, results)
    text = table(results, models)
    (Path(args.out) / "gpu_bench.json").write_text(json.dumps(results, indent=1, default=str))
    (Path(args.out) / "gpu_bench.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
