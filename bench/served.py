"""What serving costs on top of the engine: the application over HTTP (Ray Serve, its ingress
replicas as the config derives them, one model replica) against the engine alone (no Ray, no
HTTP), on one device, side by side in one run.

Both sides get the same steady load: N requests always in flight, each replaced as it ends by a
new random prompt of prompt_tokens/2 to 3·prompt_tokens/2 tokens, max_tokens drawn from 32-224,
top-p 0.9, ignore_eos; the same engine config on both. Over HTTP the requests are streaming
/v1/completions with token-id prompts, sent by client processes of their own (--clients; one per
64 streams by default) so that parsing the streams does not slow the server's processes. Per side
and N: generated and prompt tokens/s over a window of --seconds after --warm seconds, the time to
first token (median, 90th percentile) of the requests sent in the window, and the time per output
token after the first (median over those requests).

Each request is recorded as (sent, first token, end, tokens); its tokens after the first are
taken as spread evenly between its first token and its end, on both sides alike (a stream's
chunks carry text, not token counts). The window closes at `begin + seconds`, but requests go on
being replaced until every request sent before then has ended, so the load stays N throughout.

    python bench/served.py [--model DIR | --random 1.5b] [--concurrency 8,32] [--seconds 10]
                           [--warm 5] [--prompt-tokens 64] [--clients N]

Without --model or --random: the demo model. --random SHAPE writes a random checkpoint of a
released shape (bench/gpu.py's SHAPES) into a temporary directory first (on a GPU: seconds).
Runs on a GPU when the machine has one (a replica takes it; the engine alone runs first and
gives it back), else on the CPU with torch on a served replica's threads.

Prints progress to stderr and a Markdown table to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import math
import multiprocessing
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_cpu import STEADY_MAX_TOKENS, draw_request, ms_at  # noqa: E402 (beside this file)
from routing import free_port, say  # noqa: E402

from replicas.engine import Delta, Engine, EngineConfig, Finished, Request  # noqa: E402
from replicas.model.loader import default_model_dir, open_model  # noqa: E402
from replicas.sampling import SamplingParams  # noqa: E402
from serve_app.config import AppConfig  # noqa: E402

STREAMS_PER_CLIENT = 64


async def steady_load(send, streams: int, begin: float, end: float, seed: int, prompt_tokens: int,
                      vocab: int) -> list[tuple[float, float, float, int]]:
    """`streams` workers, each sending a request as its last one ends, from now until every request
    sent before `end` has ended: (sent, first token, end, tokens) of each request sent before `end`.
    `send(prompt, max_tokens)` is an async generator of token counts as they arrive (time.monotonic
    is the clock: the same in every process)."""
    rng = random.Random(seed)
    records: list[tuple[float, float, float, int]] = []
    open_before_end = 0

    async def worker() -> None:
        nonlocal open_before_end
        while time.monotonic() < end or open_before_end:
            prompt, max_tokens = draw_request(rng, prompt_tokens, vocab)
            sent, first, tokens = time.monotonic(), math.nan, 0
            counted = sent < end
            open_before_end += counted
            try:
                async for n in send(prompt, max_tokens):
                    if tokens == 0 and n:
                        first = time.monotonic()
                    tokens += n
                    if not counted and not open_before_end:
                        break  # the window's requests have all ended: the load may stop
            finally:
                open_before_end -= counted
            if counted:
                records.append((sent, first, time.monotonic(), tokens))

    await asyncio.gather(*(worker() for _ in range(streams)))
    return records


def figures(records: list[tuple[float, float, float, int]], begin: float, end: float) -> dict[str, float]:
    """Tokens/s in [begin, end) (each request's tokens after its first spread evenly up to its end),
    time to first token and time per output token of the requests sent in the window."""
    generated, ttft, tpot = 0.0, [], []
    for sent, first, done, tokens in records:
        if tokens == 0:
            continue
        generated += begin <= first < end
        if tokens > 1 and done > first:
            overlap = max(0.0, min(done, end) - max(first, begin))
            generated += (tokens - 1) * overlap / (done - first)
        if begin <= sent:
            ttft.append(first - sent)
            if tokens > 1:
                tpot.append((done - first) / (tokens - 1))
    ttft.sort()
    return {"generated": generated / (end - begin), "requests": len(ttft), "ttft_p50": ms_at(ttft, 0.5),
            "ttft_p90": ms_at(ttft, 0.9), "tpot_p50": 1e3 * statistics.median(tpot) if tpot else math.nan}


# -- the engine alone --------------------------------------------------------------------------


def engine_side(engine: Engine, streams: int, args, vocab: int, params: SamplingParams) -> dict[str, float]:
    async def send(prompt, max_tokens):
        request = Request(prompt, dataclasses.replace(params, max_tokens=max_tokens))
        async for event in engine.generate(request):
            if isinstance(event, Delta):
                yield len(event.token_ids)
            elif isinstance(event, Finished) and event.error:
                raise RuntimeError(f"the engine failed a request: {event.error}")

    begin = time.monotonic() + args.warm
    end = begin + args.seconds
    records = asyncio.run(steady_load(send, streams, begin, end, args.seed, args.prompt_tokens, vocab))
    return figures(records, begin, end)


# -- over HTTP ---------------------------------------------------------------------------------


def http_client(url: str, streams: int, begin: float, end: float, seed: int, prompt_tokens: int,
                vocab: int) -> list[tuple[float, float, float, int]]:
    """One client process's share of the load over HTTP (top level: it runs in a child process)."""

    async def run() -> list[tuple[float, float, float, int]]:
        limits = httpx.Limits(max_connections=streams, max_keepalive_connections=streams)
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

            async def send(prompt, max_tokens):
                body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0, "top_p": 0.9,
                        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    if response.status_code != 200:
                        raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
                    seen = 0
                    async for line in response.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        if '"usage":{' in line:  # the last chunk: the true count
                            total = json.loads(line[6:])["usage"]["completion_tokens"]
                            yield total - seen
                            return
                        if '"text":""' not in line:
                            seen += 1  # a chunk with text: at least one token (its count comes at the end)
                            yield 1

            return await steady_load(send, streams, begin, end, seed, prompt_tokens, vocab)

    return asyncio.run(run())


def http_side(url: str, streams: int, args, vocab: int) -> dict[str, float]:
    clients = args.clients or max(1, math.ceil(streams / STREAMS_PER_CLIENT))
    shares = [streams // clients + (i < streams % clients) for i in range(clients)]
    with ProcessPoolExecutor(clients, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(time.sleep, [0.5] * clients))  # every client up (each imports this file) before the window
        begin = time.monotonic() + args.warm
        end = begin + args.seconds
        futures = [pool.submit(http_client, url, n, begin, end, args.seed + i, args.prompt_tokens, vocab)
                   for i, n in enumerate(shares)]
        records = [r for f in futures for r in f.result()]
    return figures(records, begin, end)


# -- the run -----------------------------------------------------------------------------------


def random_checkpoint(shape: str, where: Path) -> Path:
    """A random model of a released shape as a model directory (bench/gpu.py's distributions)."""
    from gpu import SHAPES, random_model  # noqa: PLC0415

    from replicas.model.checkpoint import WORLD_VOCAB, save_model  # noqa: PLC0415
    from replicas.model.config import ModelCard  # noqa: PLC0415

    device = "cuda" if torch.cuda.is_available() else "cpu"
    say(f"writing a random {shape} model to {where}")
    model = random_model(SHAPES[shape], torch.float16, device=device)
    save_model(model, where, ModelCard(name=f"random-{shape}", tokenizer=WORLD_VOCAB.name, eos_token_id=0,
                                       dtype="float16"), WORLD_VOCAB)
    del model
    return where


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="a model directory (default: the demo model)")
    parser.add_argument("--random", help="a random model of this shape instead (0.1b, 1.5b, 7.2b)")
    parser.add_argument("--concurrency", default=None, help="requests in flight, comma-separated "
                        "(default 8,32 on the CPU, 64,256 on a GPU)")
    parser.add_argument("--seconds", type=float, default=10.0, help="the measured window")
    parser.add_argument("--warm", type=float, default=5.0, help="seconds of load before the window")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="mean prompt length")
    parser.add_argument("--clients", type=int, default=0, help="HTTP client processes (default: one per 64 streams)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--http-only", action="store_true", help="skip the engine alone")
    args = parser.parse_args()

    gpu = torch.cuda.is_available()
    levels = [int(n) for n in (args.concurrency or ("64,256" if gpu else "8,32")).split(",")]
    engine_config = EngineConfig(max_slots=max(levels), max_waiting=max(levels), token_chunk_size=512,
                                 max_prefill_tokens=4096 if gpu else 1024)
    scratch = tempfile.TemporaryDirectory(prefix="rwkv-served-")
    model_dir = args.model or (random_checkpoint(args.random, Path(scratch.name) / args.random) if args.random
                               else default_model_dir())
    config = AppConfig(model=model_dir, engine=engine_config)
    threads = max(1, int(config.num_cpus))
    if not gpu:
        torch.set_num_threads(threads)  # a served CPU replica's: Ray sets OMP_NUM_THREADS to num_cpus
    where = torch.cuda.get_device_name() if gpu else f"CPU, {threads} thread(s)"
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=args.seed, ignore_eos=True)

    rows: dict[int, dict] = {n: {} for n in levels}
    say(f"the engine alone: loading {model_dir} on {where}")
    runner, tokenizer, card = open_model(model_dir, max_slots=engine_config.max_slots, progress=say)
    vocab = runner.vocab_size
    if not args.http_only:
        runner.warm_up(say)  # as a replica does before it is ready
    for n in levels if not args.http_only else ():
        for slot in range(runner.max_slots):
            runner.reset(slot)
        engine = Engine(runner, tokenizer, engine_config).start()
        say(f"the engine alone, {n} in flight")
        rows[n]["engine"] = engine_side(engine, n, args, vocab, params)
        engine.stop()
        del engine
    del runner
    gc.collect()
    if gpu:
        torch.cuda.empty_cache()  # the replica takes the GPU next

    import ray  # noqa: PLC0415
    from ray import serve  # noqa: PLC0415

    from serve_app.app import APP_NAME, build_app, start_serve  # noqa: PLC0415

    ray.init(include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    port = free_port()
    start_serve("127.0.0.1", port)
    try:
        say(f"over HTTP: deploying the application (one replica, which loads and warms up the model; "
            f"{config.ingress_options()['num_replicas']} ingress replica(s))")
        started = time.monotonic()
        serve.run(build_app(config), name=APP_NAME, route_prefix="/")
        say(f"  ready in {time.monotonic() - started:.0f} s")
        for n in levels:
            say(f"over HTTP, {n} in flight")
            rows[n]["http"] = http_side(f"http://127.0.0.1:{port}", n, args, vocab)
    finally:
        serve.shutdown()
        ray.shutdown()

    print(f"{card.name} on {where}, {time.strftime('%Y-%m-%d')}: requests always in flight, prompts of "
          f"{args.prompt_tokens // 2}-{args.prompt_tokens * 3 // 2} tokens, "
          f"{STEADY_MAX_TOKENS[0]}-{STEADY_MAX_TOKENS[1]} new tokens each (top-p 0.9); "
          f"{args.seconds:.0f} s window after {args.warm:.0f} s of load; "
          f"engine: max_slots {engine_config.max_slots}, max_prefill_tokens {engine_config.max_prefill_tokens}\n")
    print("| in flight | side | generated tokens/s | first token ms, p50 / p90 | ms per output token, p50 | "
          "requests sent in the window |")
    print("|---:|---|---:|---:|---:|---:|")
    for n in levels:
        for side, label in (("engine", "engine alone"), ("http", "over HTTP")):
            if side not in rows[n]:
                continue
            r = rows[n][side]
            print(f"| {n} | {label} | {r['generated']:,.0f} | {r['ttft_p50']:,.0f} / {r['ttft_p90']:,.0f} | "
                  f"{r['tpot_p50']:.1f} | {r['requests']} |")
    if not args.http_only:
        print("\nOver HTTP / engine alone, generated tokens/s: " + ", ".join(
            f"{rows[n]['http']['generated'] / rows[n]['engine']['generated']:.2f} at {n}" for n in levels))


if __name__ == "__main__":
    main()
