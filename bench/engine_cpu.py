"""CPU benchmark of the engine (no Ray): time to first token and decode throughput.

For each model (the demo model, and a random model of the released 0.1B shape written as a
BlinkDL checkpoint in this run):
  * time to first token of a ~2,000-token prompt: cold, on an exact cache hit, on a continued
    chat turn (the slot still holds the previous turn), and on a prefix hit from the cache (the
    slot was reused by others in between);
  * aggregate decode tokens/s at 1, 8, 16 and 32 concurrent requests;
  * for the 0.1B checkpoint, the `rwkv` package's single-stream decode tokens/s on the same file,
    measured in the same run (needs `pip install rwkv==0.8.32`, part of the test extra).

    python bench/engine_cpu.py [--models demo,0.1b] [--new-tokens 64] [--prompt-tokens 2000] [--threads N]

torch's threads are a served CPU replica's by default: Ray sets OMP_NUM_THREADS to a replica's
`num_cpus` (serve_app.config, 1 unless configured), and torch takes that many.

With --overhead, only the engine's cost per decode step outside the model (sampling, text,
events, asyncio), at 128 and 256 concurrent 1-token prompts on the demo model.

Prints progress to stderr and a Markdown table to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import os
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from replicas.engine import Delta, Engine, EngineConfig, Finished, Request, Started
from replicas.model.checkpoint import convert, save_pth
from replicas.model.config import ModelConfig
from replicas.model.loader import default_model_dir, open_model
from replicas.model.rwkv7 import RWKV7, init_random
from replicas.sampling import SamplingParams

SHAPE_0_1B = ModelConfig(n_layer=12, n_embd=768, head_size=64, vocab_size=65536, ffn_dim=3072,
                         w_lora=64, a_lora=64, v_lora=32, g_lora=128)
CONCURRENCY = (1, 8, 16, 32)


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


async def first_token_seconds(engine: Engine, prompt: list[int], new_tokens: int = 1) -> tuple[float, list[int], int]:
    """Seconds to the first generated token; the generated tokens; cached prompt tokens."""
    start = time.perf_counter()
    first, tokens, cached = None, [], 0
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    async for event in engine.generate(Request(prompt, params)):
        if isinstance(event, Delta) and first is None:
            first = time.perf_counter() - start
        if isinstance(event, Delta):
            tokens += event.token_ids
        if isinstance(event, Finished):
            cached = event.usage.cached_tokens
    return first, tokens, cached


async def decode_rate(engine: Engine, prompts: list[list[int]], new_tokens: int) -> float:
    """Aggregate generated tokens per second over concurrent requests (short prompts)."""
    # plain temperature sampling: a random model has no nucleus worth truncating to
    params = SamplingParams(max_tokens=new_tokens, temperature=1.0, seed=0, ignore_eos=True)
    return await generated_rate(engine, prompts, params)


async def generated_rate(engine: Engine, prompts: list[list[int]], params: SamplingParams,
                         warm: Sequence[list[int]] = ()) -> float:
    """Generated tokens/s of `prompts` sent at once, after an untimed run of `warm` (bench/gpu.py
    warms Triton's compiles and the graphs' first replays with prompts of the same shapes)."""

    async def one(prompt):
        n = 0
        async for event in engine.generate(Request(prompt, params)):
            if isinstance(event, Delta):
                n += len(event.token_ids)
        return n

    await asyncio.gather(*(one(p) for p in warm))
    start = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in prompts))
    return sum(counts) / (time.perf_counter() - start)


STEADY_MAX_TOKENS = (32, 224)  # a steady load's max_tokens, drawn uniformly (mean 128)


def draw_request(rng: random.Random, prompt_tokens: int, vocab: int) -> tuple[list[int], int]:
    """A request of a steady load: a random prompt of prompt_tokens/2 to 3·prompt_tokens/2 tokens,
    and its max_tokens."""
    length = rng.randint(prompt_tokens // 2, prompt_tokens * 3 // 2)
    return [rng.randrange(1, vocab) for _ in range(length)], rng.randint(*STEADY_MAX_TOKENS)


def ms_at(values: list[float], q: float) -> float:
    """The q-quantile of sorted seconds, in ms (nan, not 0, when there are none)."""
    return 1e3 * values[min(len(values) - 1, int(q * len(values)))] if values else math.nan


async def steady_rate(engine: Engine, concurrency: int, prompt_tokens: int, params: SamplingParams,
                      seconds: float, warm_seconds: float = 1.0, seed: int = 0) -> dict[str, float]:
    """Serving in a steady state: `concurrency` requests always in flight, each one that ends
    replaced at once by a new random prompt of prompt_tokens/2 to 3·prompt_tokens/2 tokens, with
    max_tokens drawn from 32-224 (mean 128) so that requests end at different steps and prompts
    differ in length, as a server's do. Returns the generated and prompt tokens/s over `seconds`
    after `warm_seconds`, and the time to first token (median and 90th percentile, ms) of the
    requests sent in that window: the batcher's cost with prefill and decode mixed, without the
    ramp and the common end of a burst of requests started together (generated_rate)."""
    rng = random.Random(seed)
    start = time.perf_counter()
    begin, end = start + warm_seconds, start + warm_seconds + seconds
    counted = {"generated": 0, "prompt": 0}
    first_token: list[float] = []

    async def worker() -> None:
        while time.perf_counter() < end:
            prompt, max_tokens = draw_request(rng, prompt_tokens, engine.runner.vocab_size)
            request = Request(prompt, dataclasses.replace(params, max_tokens=max_tokens))
            sent, waiting = time.perf_counter(), True
            async for event in engine.generate(request):
                now = time.perf_counter()
                if isinstance(event, Delta) and waiting:
                    waiting = False
                    if begin <= sent and now < end:
                        first_token.append(now - sent)
                if isinstance(event, Delta) and begin <= now < end:
                    counted["generated"] += len(event.token_ids)
                elif isinstance(event, Started) and begin <= now < end:
                    counted["prompt"] += event.prompt_tokens - event.cached_tokens
                if now >= end:
                    break

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    first_token.sort()

    return {"generated": counted["generated"] / seconds, "prompt": counted["prompt"] / seconds,
            "ttft_p50_ms": ms_at(first_token, 0.5), "ttft_p90_ms": ms_at(first_token, 0.9)}


def long_prompt(tokenizer, n: int) -> list[int]:
    source = Path(__file__).resolve().parents[1] / "replicas" / "engine.py"
    text = source.read_text()
    tokens: list[int] = []
    while len(tokens) < n:
        tokens += tokenizer.encode(text)
    return tokens[:n]


def bench_model(name: str, model_dir: Path, args) -> dict:
    say(f"[{name}] loading {model_dir}")
    runner, tokenizer, _ = open_model(model_dir, max_slots=max(CONCURRENCY), device="cpu")
    config = EngineConfig(max_slots=max(CONCURRENCY), token_chunk_size=512, max_prefill_tokens=1024,
                          checkpoint_interval=512, max_waiting=256)
    engine = Engine(runner, tokenizer, config).start()
    out: dict = {"model": name}
    try:
        prompt = long_prompt(tokenizer, args.prompt_tokens)
        say(f"[{name}] time to first token, {len(prompt)}-token prompt: cold")
        out["cold"], reply, _ = asyncio.run(first_token_seconds(engine, prompt, new_tokens=16))
        say(f"[{name}] … exact cache hit")
        out["hit"], _, cached = asyncio.run(first_token_seconds(engine, prompt))
        assert cached == len(prompt), f"expected an exact hit, cached {cached}"
        turn = prompt + reply + tokenizer.encode("\n\n# next turn: explain the code above\n")
        say(f"[{name}] … continued chat turn (+{len(turn) - len(prompt)} tokens)")
        # the exact-hit request above left its slot at `prompt`; the 16-token reply's slot holds prompt+reply
        out["continued"], _, cached = asyncio.run(first_token_seconds(engine, turn))
        out["continued_cached"] = cached
        say(f"[{name}] … prefix hit from the cache after the slots were reused")
        asyncio.run(decode_rate(engine, [tokenizer.encode(f"filler {i}") for i in range(max(CONCURRENCY))], 2))
        turn2 = prompt + reply + tokenizer.encode("\n\n# another turn\n")
        out["prefix_hit"], _, out["prefix_hit_cached"] = asyncio.run(first_token_seconds(engine, turn2))
        for c in CONCURRENCY:
            say(f"[{name}] decode, {c} concurrent × {args.new_tokens} tokens")
            prompts = [tokenizer.encode(f"def function_{i}(x):\n    ") for i in range(c)]
            out[f"decode_{c}"] = asyncio.run(decode_rate(engine, prompts, args.new_tokens))
        engine.check_integrity()
    finally:
        engine.stop()
    return out


def engine_overhead(rows: int, new_tokens: int) -> tuple[float, float]:
    """Wall ms per decode step and the model's share, `rows` requests of one prompt token each."""
    runner, tokenizer, _ = open_model(default_model_dir(), max_slots=rows, device="cpu")
    engine = Engine(runner, tokenizer, EngineConfig(max_slots=rows, max_waiting=rows)).start()
    params = SamplingParams(max_tokens=new_tokens, temperature=1.0, seed=0, ignore_eos=True)
    prompts = [[1 + i % 100] for i in range(rows)]
    try:
        asyncio.run(generated_rate(engine, prompts, params))  # warm-up
        before = engine.snapshot_stats()["counters"]
        start = time.perf_counter()
        asyncio.run(generated_rate(engine, prompts, params))
        wall = time.perf_counter() - start
        after = engine.snapshot_stats()["counters"]
    finally:
        engine.stop()
    steps = after["decode_calls"] - before["decode_calls"]
    return wall * 1e3 / steps, (after["decode_us"] - before["decode_us"]) / 1e3 / steps


def reference_single_stream(pth: Path, new_tokens: int) -> float:
    """The rwkv package (cpu fp32) decoding one stream, token by token, on the same checkpoint."""
    os.environ["RWKV_V7_ON"] = "1"
    from rwkv.model import RWKV  # noqa: PLC0415

    model = RWKV(str(pth.with_suffix("")), "cpu fp32")
    logits, state = model.forward([1, 2, 3, 4], None)
    token = int(logits.argmax())
    # TorchScript profiles its graphs for a dozen calls or so before it optimises them: warm up
    # until three calls in a row take about the same time.
    times: list[float] = []
    while len(times) < 64 and not (len(times) >= 16 and max(times[-3:]) < 1.2 * min(times[-3:])):
        begin = time.perf_counter()
        logits, state = model.forward([token], state)
        token = int(logits.argmax())
        times.append(time.perf_counter() - begin)
    start = time.perf_counter()
    for _ in range(new_tokens):
        logits, state = model.forward([token], state)
        token = int(logits.argmax())
    return new_tokens / (time.perf_counter() - start)


def main() -> None:
    # (imported here: bench/gpu.py imports this module on the GPU machine, which need not have
    # serve_app's dependencies)
    from serve_app.config import AppConfig  # noqa: PLC0415

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="demo,0.1b")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--overhead", action="store_true", help="only the engine's per-step cost outside the model")
    parser.add_argument("--threads", type=int, default=max(1, int(AppConfig().num_cpus)),
                        help="torch's threads (default: a served CPU replica's, its num_cpus)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.overhead:
        print("| rows | ms a step | model | outside the model |\n|---|---|---|---|")
        for rows in (128, 256):
            say(f"[demo] {rows} rows × {args.new_tokens} tokens")
            step, model = engine_overhead(rows, args.new_tokens)
            rest = step - model
            print(f"| {rows} | {step:.2f} | {model:.2f} | {rest:.2f} ({rest / rows * 1e3:.1f} µs a row) |")
        return
    rows, reference = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            if name == "demo":
                rows.append(bench_model("demo", default_model_dir(), args))
            elif name == "0.1b":
                say("[0.1b] writing a random checkpoint of the released 0.1B shape (L12, C768, V65536)")
                pth = Path(tmp) / "rwkv7-0.1b-random.pth"
                save_pth(init_random(RWKV7(SHAPE_0_1B), seed=0), pth)
                convert(pth, Path(tmp) / "0.1b", progress=say)
                rows.append(bench_model("0.1b (random)", Path(tmp) / "0.1b", args))
                say("[0.1b] rwkv package, single-stream decode")
                reference = reference_single_stream(pth, args.new_tokens)
            else:
                raise SystemExit(f"unknown model {name!r} (demo, 0.1b)")
    print(f"\nCPU: {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"{time.strftime('%Y-%m-%d')}\n")
    print("| model | TTFT cold | TTFT exact hit | ×cold | TTFT continued turn | ×cold "
          "| TTFT prefix hit (cache) | ×cold |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['cold']*1e3:.0f} ms | {r['hit']*1e3:.1f} ms | {r['cold']/r['hit']:.0f}× "
              f"| {r['continued']*1e3:.0f} ms ({r['continued_cached']} cached) | {r['cold']/r['continued']:.0f}× "
              f"| {r['prefix_hit']*1e3:.0f} ms ({r['prefix_hit_cached']} cached) | {r['cold']/r['prefix_hit']:.0f}× |")
    print("\n| model | " + " | ".join(f"decode, {c} concurrent" for c in CONCURRENCY) + " | rwkv 0.8.32, 1 stream |")
    print("|---|" + "---|" * (len(CONCURRENCY) + 1))
    for r in rows:
        ref = f"{reference:.1f} tok/s" if reference and r["model"].startswith("0.1b") else "—"
        cells = []
        for c in CONCURRENCY:
            ratio = f" ({r[f'decode_{c}'] / reference:.1f}× rwkv)" if ref != "—" else ""
            cells.append(f"{r[f'decode_{c}']:.1f} tok/s{ratio}")
        print(f"| {r['model']} | " + " | ".join(cells) + f" | {ref} |")


if __name__ == "__main__":
    main()
