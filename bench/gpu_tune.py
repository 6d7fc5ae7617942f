"""Tuning runs for the CUDA runner's launch choices, on an H200 (a tool, not the benchmark of record:
bench/gpu.py is that). Each part prints what it measured and writes DIR/gpu_tune.json:

  gemv     every FMA and tensor-core configuration on the decode products of the released shapes
           (one row and eight), cold weights (copies cycled past the L2), GB/s of weight bytes
  decode   runner.decode at batch 1 to 256 and prefill (graph and no graph), with programmatic
           dependent launch on and off; a kernel profile
  second   runner.decode at 4, 8 and 16 rows with the time-mix core taking the LoRA second stages
           up to 4, 8 and 16 rows (runner.second_rows; its rule by their bytes is marked), two
           rounds alternated
  rows     7.2B's large-path products (r,k,v; output; FFN key; FFN value) at 4,095-4,352 token
           rows, cuBLAS next to our persistent matmul (kernels.mm_relu2), a layer's four back to
           back under the power cap: what a new prompt's first token folded in as two more rows
           would cost each (does a 33rd row of 128-row tiles cost a wave?)
  mm       our persistent matmul (kernels.mm_relu2 without relu², kernels.MmConfig) at other tiles,
           depths and groups, and on Hopper the warp-specialised one in Gluon (ws_matmul.mm_ws,
           ws_matmul.WsConfig; checked against torch in a process of its own first), against
           cuBLAS, on 7.2B's four large-path products at 4,096 tokens; each launch 20 times back
           to back (under the power cap), the launches in turn, three rounds: can ours reach
           cuBLAS's rate where it trails (r,k,v, the output, the FFN value)? A launch that does not
           compile is skipped.

    python bench/gpu_tune.py [--parts gemv,decode,second,rows,mm] [--models 0.1b,1.5b,7.2b] [--out DIR]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu import SHAPES, measure_ceilings, median_ms, random_model, say, time_decode, time_prefill  # noqa: E402

from replicas.model import kernels as K  # noqa: E402

FMA_CONFIGS = [K.GemvConfig(True, bn, bk, w, s, 4) for bn, bk, w, s in itertools.product(
    (8, 16, 32), (128, 256), (4, 8), (2, 3, 4, 6)) if bn * bk <= 8192]  # bk: TMA boxes stop at 256
DOT_CONFIGS = [K.GemvConfig(False, bn, bk, w, s, 2) for bn, bk, w, s in itertools.product(
    (16, 32, 64), (64, 128, 256), (4, 8), (3, 4, 5)) if bn * bk <= 8192]


def products(name: str) -> list[tuple[str, int, int, int]]:
    """(label, N, K, epilogue) of one layer's decode products and the head."""
    cfg = SHAPES[name]
    C, F = cfg.n_embd, cfg.ffn_dim
    lora = sum(-(-r // 64) * 64 for r in (cfg.w_lora, cfg.a_lora, cfg.v_lora, cfg.g_lora))
    return [("w_in", 3 * C + lora, C, K.EPI_STORE), ("wo", C, C, K.EPI_ATOMIC_ADD), ("wfk", F, C, K.EPI_STORE),
            ("wfv", C, F, K.EPI_ATOMIC_ADD), ("head", cfg.vocab_size, C, K.EPI_STORE)]


def graph_us(fns) -> float:
    """Mean µs per call of fns run back to back in one CUDA graph (as a decode step runs them)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns[:2]:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (5 * len(fns))


def tune_gemv(models: list[str], bandwidth: float, results: dict) -> None:
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    for name in models:
        for label, N, Kd, epi in products(name):
            size = N * Kd * 2
            copies = max(8, min(64, -(-(512 << 20) // size)))
            ws = [torch.randn(N, Kd, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
            a = torch.randn(8, Kd, device="cuda")
            y = torch.zeros(8, N, device="cuda")
            for m in (1, 8):
                rows = []
                for cfg in FMA_CONFIGS + DOT_CONFIGS:
                    if cfg.fma and m > 4:
                        continue
                    for per_sm in ((1, 2, 4, 8) if epi == K.EPI_ATOMIC_ADD else (cfg.per_sm,)):
                        c = K.GemvConfig(cfg.fma, cfg.block_n, cfg.block_k, cfg.warps, cfg.stages, per_sm)
                        try:
                            us = graph_us([functools.partial(K.gemv, a, w, y, m, epi=epi, n_sm=n_sm, config=c)
                                           for w in ws])
                        except Exception as e:  # noqa: BLE001 (a configuration that does not compile)
                            say(f"gemv {name} {label} {c}: {type(e).__name__}: {str(e)[:120]}")
                            continue
                        rows.append((us, c))
                rows.sort(key=lambda r: r[0])
                best = {"fma": next((r for r in rows if r[1].fma), None),
                        "dot": next((r for r in rows if not r[1].fma), None)}
                key = f"{name}|{label}|m{m}"
                results["gemv"][key] = {
                    "bytes": size, "limit_us": size / bandwidth * 1e6,
                    "top": [(round(us, 2), c.__dict__) for us, c in rows[:6]],
                    "best_fma": best["fma"] and (round(best["fma"][0], 2), best["fma"][1].__dict__),
                    "best_dot": best["dot"] and (round(best["dot"][0], 2), best["dot"][1].__dict__),
                    "default": next((round(us, 2) for us, c in rows
                                     if (c.fma, c.block_n, c.block_k, c.warps, c.stages)
                                     == tuple(getattr(K.gemv_config(m, size), f)
                                              for f in ("fma", "block_n", "block_k", "warps", "stages"))), None),
                }
                us, c = rows[0]
                say(f"gemv {key}: {size / 1e6:.1f} MB, limit {size / bandwidth * 1e6:.1f} µs; best {us:.1f} µs "
                    f"({size / us / 1e3:.0f} GB/s) {c}; fma best {best['fma'] and round(best['fma'][0], 1)}, "
                    f"dot best {best['dot'] and round(best['dot'][0], 1)}")
            del ws
            torch.cuda.empty_cache()


def tune_decode(models: list[str], results: dict) -> None:
    """Decode at each batch and prefill (graph replayed, and launched kernel by kernel), with
    programmatic dependent launch on and off; then a kernel profile, per model."""
    from gpu import profile  # noqa: PLC0415

    from replicas.model.cuda_runner import CudaRunner  # noqa: PLC0415

    for name in models:
        model = random_model(SHAPES[name], torch.float16)
        runner = CudaRunner(model, max_slots=256)
        del model
        for pdl in (True, False) if runner.pdl else (False,):
            runner.pdl = pdl  # the runner sets kernels.PDL for the launches of each call
            runner.drop_graphs()
            for batch in (1, 2, 8, 64, 256):
                rate = time_decode(runner, batch)
                results["decode"][f"{name}|pdl {pdl}|b{batch}"] = rate
                say(f"decode {name} PDL {pdl} batch {batch}: {rate:,.0f} tokens/s "
                    f"(gemv path: {runner.path_choice.get(batch)})")
            for graph in (True, False):
                for rows, length in ((1, 4096), (16, 1024)):
                    rate = time_prefill(runner, rows, length, graph=graph)
                    results["prefill"][f"{name}|pdl {pdl}|graph {graph}|{rows}x{length}"] = rate
                    say(f"prefill {name} PDL {pdl} graph {graph} {rows}×{length}: {rate:,.0f} tokens/s")
        runner.pdl = K.pdl_supported(runner.device)
        if name != "0.1b":
            profile(runner)
        del runner
        torch.cuda.empty_cache()


def tune_second(models: list[str], results: dict) -> None:
    """Decode at 4-16 rows with the core taking the LoRA second stages up to 4, 8 and 16 rows."""
    from replicas.model.cuda_runner import CudaRunner  # noqa: PLC0415

    for name in models:
        model = random_model(SHAPES[name], torch.float16)
        runner = CudaRunner(model, max_slots=32)
        del model
        rule = runner.second_rows
        for rnd in range(2):
            for rows in (4, 8, 16):
                runner.second_rows = rows
                runner.drop_graphs()
                runner.path_choice.clear()
                rates = {batch: time_decode(runner, batch) for batch in (4, 8, 16)}
                results["second"][f"{name}|up to {rows}|round {rnd}"] = rates
                say(f"second stages {name} up to {rows} rows{' (the rule)' if rows == rule else ''}, round {rnd}: "
                    + ", ".join(f"{b} rows {r:,.0f} tokens/s{'' if runner.path_choice.get(b, True) else ' (cuBLAS)'}"
                                for b, r in rates.items()))
        del runner
        torch.cuda.empty_cache()


def large_path_products(name: str) -> tuple[dict[str, tuple[int, int]], dict[str, torch.Tensor]]:
    """The model's four large-path products of a layer, (N, K) by name, and random fp16 weights
    [N, K] for each."""
    C, F = SHAPES[name].n_embd, SHAPES[name].ffn_dim
    shapes = {"rkv": (3 * C, C), "out": (C, C), "key": (F, C), "value": (C, F)}
    ws = {p: torch.randn(n, k, device="cuda", dtype=torch.float16) * k ** -0.5 for p, (n, k) in shapes.items()}
    return shapes, ws


def tune_rows(results: dict, name: str = "7.2b") -> None:
    """ms of a layer's large-path products at token rows around a new 4,096-token prompt's call
    (its 4,095 tokens after the first, padded to 4,096; 4,097 with the first as two more rows),
    cuBLAS and our matmul, each round the row counts in turn."""
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    shapes, ws = large_path_products(name)
    a_max = torch.randn(4352, SHAPES[name].ffn_dim, device="cuda", dtype=torch.float16)
    impls = {"cuBLAS": lambda a, w: torch.mm(a, w.t()), "ours": lambda a, w: K.mm_relu2(a, w, n_sm)}
    for rnd in range(3):
        for rows in (4096, 4095, 4097, 4128, 4224, 4352):
            for impl, mm in impls.items():
                calls = [functools.partial(mm, a_max[:rows, :k].contiguous(), ws[p]) for p, (_, k) in shapes.items()]
                each = {p: median_ms(fn, reps=9) for p, fn in zip(shapes, calls, strict=True)}
                layer = median_ms(lambda calls=calls: [fn() for fn in calls], reps=9)
                results["rows"][f"{name}|{impl}|{rows}|round {rnd}"] = {"layer": layer, **each}
                say(f"rows {name} {impl} {rows} round {rnd}: layer {layer:.3f} ms ("
                    + ", ".join(f"{p} {ms:.3f}" for p, ms in each.items()) + ")")


MM_CONFIGS = [K.MM, K.MmConfig(split_store=True), K.MmConfig(stages=4, split_store=True),
              K.MmConfig(256, 128, stages=4, split_store=True), K.MmConfig(group=4), K.MmConfig(group=16),
              K.MmConfig(bk=32, stages=6), K.MmConfig(256, 128), K.MmConfig(128, 128, stages=4),
              K.MmConfig(128, 128, stages=6), K.MmConfig(128, 128, stages=5, warps=4), K.MmConfig(128, 128, 128, 3),
              K.MmConfig(64, 256, stages=4, warps=4)]  # each within the 227 KiB of shared memory


WS_CONFIGS = ["{}", '{"epi_bufs": 1}', '{"stages": 3, "epi_n": 256, "epi_bufs": 1}', '{"stages": 3, "epi_n": 128}',
              '{"epi_n": 32}', '{"group": 4}', '{"group": 16}', '{"bm": 256, "bn": 128, "epi_bufs": 1}',
              '{"bm": 256, "bn": 128, "stages": 3}', '{"bk": 128, "stages": 2}',
              '{"pingpong": true, "bn": 128, "stages": 6, "epi_bufs": 1}', '{"pingpong": true, "bn": 128, "stages": 5}',
              '{"pingpong": true, "bn": 128, "stages": 5, "epi_n": 128, "epi_bufs": 1}',
              '{"pingpong": true, "bm": 64, "stages": 5, "epi_bufs": 1}']  # ws_matmul.WsConfig's fields, as JSON


def checked_ws_configs() -> list:
    """The WS_CONFIGS that agree with torch (ws_matmul.check_in_child: a launch whose barriers never
    complete would hang this process)."""
    from replicas.model.ws_matmul import check_in_child  # noqa: PLC0415

    passed, out = check_in_child(WS_CONFIGS)
    say(f"mm: the warp-specialised matmul's check: {out}")
    return passed or []


def tune_mm(results: dict, name: str = "7.2b") -> None:
    """ms a product, cuBLAS and each MmConfig and WsConfig, at 4,096 token rows (see the module's
    docstring)."""
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    shapes, ws = large_path_products(name)
    acts = {k: torch.randn(4096, k, device="cuda", dtype=torch.float16) for k in {k for _, k in shapes.values()}}
    impls = {"cuBLAS": lambda a, w: torch.mm(a, w.t())}
    a_out = acts[shapes["out"][1]]
    ref = torch.mm(a_out, ws["out"].t()).float()  # each launch checked on the output product first
    candidates = [(c, lambda a, w, c=c: K.mm_relu2(a, w, n_sm, relu2=False, cfg=c)) for c in MM_CONFIGS]
    if torch.cuda.get_device_capability()[0] == 9:
        from replicas.model.ws_matmul import mm_ws  # noqa: PLC0415

        candidates += [(c, lambda a, w, c=c: mm_ws(a, w, n_sm, relu2=False, cfg=c)) for c in checked_ws_configs()]
    for c, mm in candidates:
        try:
            y = mm(a_out, ws["out"])
        except Exception as e:  # noqa: BLE001 (out of shared memory, registers: Triton's own errors)
            say(f"mm {c}: skipped ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
            continue
        say(f"mm {c}: the output product {((y.float() - ref).norm() / ref.norm()).item():.1e} from cuBLAS's")
        impls[str(c)] = mm
    for rnd in range(3):
        for impl, mm in impls.items():
            each = {}
            for p, (n, k) in shapes.items():
                a, w = acts[k], ws[p]
                ms = median_ms(lambda a=a, w=w, mm=mm: [mm(a, w) for _ in range(20)], reps=3, warmup=1) / 20
                each[p] = results["mm"][f"{name}|{impl}|{p}|round {rnd}"] = {
                    "ms": ms, "tflops": 2 * 4096 * n * k / ms / 1e9}
            say(f"mm {name} round {rnd} {impl}: "
                + ", ".join(f"{p} {r['ms']:.3f} ms ({r['tflops']:.0f} TFLOP/s)" for p, r in each.items()))
    say(f"mm {name}, means of the three rounds: cuBLAS's ms over each launch's (≥ 1: as fast or faster)")
    mean = {(impl, p): sum(results["mm"][f"{name}|{impl}|{p}|round {rnd}"]["ms"] for rnd in range(3)) / 3
            for impl in impls for p in shapes}
    say("  " + " | ".join(["launch", *shapes, "a layer"]))
    for impl in impls:
        ratios = [mean["cuBLAS", p] / mean[impl, p] for p in shapes]
        layer = sum(mean["cuBLAS", p] for p in shapes) / sum(mean[impl, p] for p in shapes)
        say("  " + " | ".join([impl, *(f"{r:.3f}" for r in ratios), f"{layer:.3f}"]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parts", default="gemv,decode")
    parser.add_argument("--models", default="0.1b,1.5b,7.2b")
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    models = args.models.split(",")
    results: dict = {"gemv": {}, "decode": {}, "prefill": {}, "second": {}, "rows": {}, "mm": {}}
    ceil = measure_ceilings()
    results["ceilings"] = ceil
    say(f"bandwidth {ceil['bandwidth'] / 1e12:.2f} TB/s, bf16 {ceil['matmul'] / 1e12:.0f} TFLOP/s")
    parts = args.parts.split(",")
    try:
        if "gemv" in parts:
            tune_gemv(models, ceil["bandwidth"], results)
        if "decode" in parts:
            tune_decode(models, results)
        if "second" in parts:
            tune_second(models, results)
        if "rows" in parts:
            tune_rows(results)
        if "mm" in parts:
            tune_mm(results)
    finally:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_tune.json").write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
