"""Which replica a conversation's next turn reaches, and what it costs: the state-affinity router
(serve_app/router.py) against Ray Serve's default, side by side in one run.

A local Ray and the rwkv-fleet application with N replicas of the demo model on the CPU, deployed
twice, once with each router. Threads of token ids: each opens with a prompt of --prefix tokens,
then each of --turns later turns extends the thread's previous prompt by --step tokens (a chat
turn or an agent's tool output appended). The threads take turns one request at a time (with
--concurrent, a turn of every thread at once), and a request asks for one token, so its latency
is its time to first token. Per router: how many of the
later turns found the previous prompt's state cached, the share of their prompt tokens that came
from a cache, and their latency.

    python bench/routing.py [--replicas 2] [--ingress 1] [--threads 8] [--turns 3] [--prefix 1000]
                            [--step 100] [--concurrent] [--full-holder [--slots 2]] [--random 1.5b]

With --random SHAPE, a random model of a released shape (bench/gpu.py's SHAPES) instead of the
demo model; on a machine with GPUs each replica takes one, or a share of one where there are
fewer GPUs than replicas.

With --ingress 2 the HTTP side has two replicas, each routing about half the requests (the
state-affinity routers share their records through the registry).

With --full-holder, the state-affinity router twice, with and without moving states: each thread's
first prompt runs, then long requests extending it fill the slots of the replica that took it
(--slots per replica), and the thread's next turn goes to another replica, which takes the prefix's
state from the holder (`state_move_min_tokens` 1) or prefills it all (null).

With --redeploy, the state-affinity router twice, with and without handing states off: each
thread's first prompt runs on the N replicas, then the application is deployed again with N - 1
(Serve replaces the replicas; the stopping ones hand their newest states to the one that starts,
`state_handoff_bytes`, or none: 0), and each thread's next turn goes to the new replica. Also how
long the redeploy took, from `serve.run` to the old replicas gone.

Prints progress to stderr and a Markdown table to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serve_app.app import APP_NAME, build_app, start_serve  # noqa: E402
from serve_app.config import AppConfig  # noqa: E402


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def run_threads(url: str, args) -> dict:
    """The threads' turns against the running application: figures of the later turns. A turn
    sends every thread's request one after another, or with --concurrent all at once."""
    rng = random.Random(args.seed)
    threads = [[rng.randrange(300, 4000) for _ in range(args.prefix)] for _ in range(args.threads)]
    found, cached, total, latency = 0, 0, 0, []

    async def one(client: httpx.AsyncClient, prompt: list[int]) -> tuple[int, float]:
        start = time.perf_counter()
        response = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        elapsed = time.perf_counter() - start
        response.raise_for_status()
        return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"], elapsed

    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        for turn in range(args.turns + 1):
            if args.concurrent:
                results = await asyncio.gather(*(one(client, prompt) for prompt in threads))
            else:
                results = [await one(client, prompt) for prompt in threads]
            for prompt, (hit, elapsed) in zip(threads, results, strict=True):
                if turn:
                    found += hit >= len(prompt) - args.step
                    cached, total = cached + hit, total + len(prompt)
                    latency.append(elapsed * 1e3)
                prompt += [rng.randrange(300, 4000) for _ in range(args.step)]
            say(f"  turn {turn} done")
    return {"found": found, "turns": len(latency), "cached": cached / total,
            "mean": statistics.mean(latency), "p50": statistics.median(latency), "max": max(latency)}


async def run_redeploy(url: str, args, redeploy) -> dict:
    """Each thread's first prompt, then `redeploy()` (the application with one replica fewer),
    then each thread's next turn: figures of those turns, and the redeploy's seconds."""
    rng = random.Random(args.seed)
    threads = [[rng.randrange(300, 4000) for _ in range(args.prefix)] for _ in range(args.threads)]
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        for prompt in threads:
            (await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})).raise_for_status()
        before = set((await client.get("/v1/stats")).json()["replicas"])
        say(f"  first turns done on {len(before)} replicas; redeploying")
        start = time.perf_counter()
        await asyncio.to_thread(redeploy)
        while before & set((await client.get("/v1/stats")).json()["replicas"]):
            await asyncio.sleep(0.1)
        redeploy_s = time.perf_counter() - start
        found, cached, total, latency = 0, 0, 0, []
        for prompt in threads:
            turn = prompt + [rng.randrange(300, 4000) for _ in range(args.step)]
            start = time.perf_counter()
            response = await client.post("/v1/completions", json={"prompt": turn, "max_tokens": 1})
            latency.append((time.perf_counter() - start) * 1e3)
            response.raise_for_status()
            hit = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            found += hit >= len(prompt)
            cached, total = cached + hit, total + len(turn)
        say("  next turns done")
    return {"found": found, "turns": len(latency), "cached": cached / total, "redeploy_s": redeploy_s,
            "mean": statistics.mean(latency), "p50": statistics.median(latency), "max": max(latency)}


async def long_request(client: httpx.AsyncClient, prompt: list[int], streaming: asyncio.Event) -> None:
    """A request that streams until cancelled; `streaming` is set at its first line."""
    body = {"prompt": prompt, "max_tokens": 100000, "ignore_eos": True, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        async for _ in response.aiter_lines():
            streaming.set()


async def run_full_holder(url: str, args) -> dict:
    """Each thread's later turn while the replica holding its first prompt has every slot taken by
    long requests extending that prompt: figures of those turns."""
    rng = random.Random(args.seed)
    found, cached, total, latency = 0, 0, 0, []
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        for thread in range(args.threads):
            prompt = [rng.randrange(300, 4000) for _ in range(args.prefix)]
            (await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})).raise_for_status()
            streaming = [asyncio.Event() for _ in range(args.slots)]
            fillers = [asyncio.create_task(long_request(client, prompt + [5 + i], streaming[i]))
                       for i in range(args.slots)]
            await asyncio.gather(*(event.wait() for event in streaming))
            await asyncio.sleep(10.5)  # past Ray Serve's memory of queue lengths: the holder is known full
            turn = prompt + [rng.randrange(300, 4000) for _ in range(args.step)]
            start = time.perf_counter()
            response = await client.post("/v1/completions", json={"prompt": turn, "max_tokens": 1})
            latency.append((time.perf_counter() - start) * 1e3)
            hit = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            found += hit >= len(prompt)
            cached, total = cached + hit, total + len(turn)
            for task in fillers:
                task.cancel()
            await asyncio.gather(*fillers, return_exceptions=True)
            say(f"  thread {thread} done")
    return {"found": found, "turns": len(latency), "cached": cached / total,
            "mean": statistics.mean(latency), "p50": statistics.median(latency), "max": max(latency)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--ingress", type=int, default=1, help="ingress replicas (the HTTP side)")
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3, help="turns after each thread's first")
    parser.add_argument("--prefix", type=int, default=1000, help="tokens of a thread's first prompt")
    parser.add_argument("--step", type=int, default=100, help="tokens each later turn adds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrent", action="store_true", help="a turn's requests all at once")
    parser.add_argument("--full-holder", action="store_true",
                        help="the holder's slots full at each later turn: states moved against prefilled")
    parser.add_argument("--slots", type=int, default=2, help="slots per replica with --full-holder")
    parser.add_argument("--redeploy", action="store_true",
                        help="a redeploy with one replica fewer between a thread's turns: states handed off or not")
    parser.add_argument("--random", help="a random model of this shape (0.1b, 1.5b, 7.2b) instead of the demo model")
    args = parser.parse_args()

    import ray  # noqa: PLC0415
    import torch  # noqa: PLC0415
    from ray import serve  # noqa: PLC0415
    from served import random_checkpoint  # noqa: PLC0415 (beside this file)

    scratch = tempfile.TemporaryDirectory() if args.random else None
    model_dir = random_checkpoint(args.random, Path(scratch.name) / args.random) if scratch else None
    gpus = torch.cuda.device_count()
    share = min(1.0, gpus / args.replicas)
    what = (f"{'random ' + args.random if args.random else 'demo'} model, "
            f"{f'{share:g} of a GPU each ({torch.cuda.get_device_name()})' if gpus else 'CPU'}")
    say(f"starting a local Ray for {args.replicas} replicas ({what})")
    ray.init(num_cpus=max(2, args.replicas), include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    port = free_port()
    start_serve("127.0.0.1", port)
    rows = {}
    try:
        if args.full_holder:
            cases = {"state moved": {"state_move_min_tokens": 1}, "prefilled": {"state_move_min_tokens": None}}
        elif args.redeploy:
            cases = {"states handed off": {}, "none handed off": {"state_handoff_bytes": 0}}
        else:
            cases = {"state affinity": {"state_affinity": True}, "Ray Serve's default": {"state_affinity": False}}
        for name, settings in cases.items():
            say(f"{name}: deploying")
            engine = {"max_slots": args.slots} if args.full_holder else {}

            def deploy(replicas: int, settings=settings, engine=engine) -> None:
                config = AppConfig(model=model_dir, replicas=replicas, ingress_replicas=args.ingress, num_cpus=0,
                                   num_gpus=share, engine=engine, **settings)
                serve.run(build_app(config), name=APP_NAME, route_prefix="/")

            deploy(args.replicas)
            url = f"http://127.0.0.1:{port}"
            if args.redeploy:
                rows[name] = asyncio.run(run_redeploy(url, args, lambda: deploy(args.replicas - 1)))
            else:
                rows[name] = asyncio.run((run_full_holder if args.full_holder else run_threads)(url, args))
            serve.delete(APP_NAME)
    finally:
        serve.shutdown()
        ray.shutdown()

    if args.redeploy:
        print(f"{args.replicas} replicas ({what}), {args.threads} threads of {args.prefix} tokens; then the "
              f"application deployed again with {args.replicas - 1}, and each thread's next turn of +{args.step} "
              "tokens:\n")
        print("| case | redeploy s | previous prompt found cached | prompt tokens from a cache | "
              "latency ms, mean / p50 / max |")
        print("|---|---:|---:|---:|---:|")
        for name, r in rows.items():
            print(f"| {name} | {r['redeploy_s']:.1f} | {r['found']} of {r['turns']} | {r['cached']:.0%} | "
                  f"{r['mean']:.0f} / {r['p50']:.0f} / {r['max']:.0f} |")
        ours, base = rows
        print(f"\nMean latency, {base} / {ours}: {rows[base]['mean'] / rows[ours]['mean']:.1f}×")
        return
    if args.full_holder:
        print(f"{args.replicas} replicas ({what}, {args.slots} slots each), {args.threads} threads of "
              f"{args.prefix} tokens, each's next turn of +{args.step} tokens sent while the replica holding its "
              "first prompt has every slot taken:\n")
    else:
        print(f"{args.replicas} replicas ({what}), {args.ingress} ingress replica(s), "
              f"{args.threads} threads of {args.prefix} tokens, "
              f"{args.turns} later turns of +{args.step} tokens each, "
              f"{'a turn of every thread at once' if args.concurrent else 'one request at a time'}; "
              "the later turns:\n")
    print("| case | previous prompt found cached | prompt tokens from a cache | latency ms, mean / p50 / max |")
    print("|---|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['found']} of {r['turns']} | {r['cached']:.0%} | "
              f"{r['mean']:.0f} / {r['p50']:.0f} / {r['max']:.0f} |")
    ours, base = rows
    ratio = rows[base]["mean"] / rows[ours]["mean"]
    print(f"\nMean latency, {base} / {ours}: {ratio:.1f}×")


if __name__ == "__main__":
    main()
