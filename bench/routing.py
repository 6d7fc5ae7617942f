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
                            [--step 100] [--concurrent]

With --ingress 2 the HTTP side has two replicas, each routing about half the requests (the
state-affinity routers share their records through the registry).

Prints progress to stderr and a Markdown table to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import socket
import statistics
import sys
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
    args = parser.parse_args()

    import ray  # noqa: PLC0415
    from ray import serve  # noqa: PLC0415

    say(f"starting a local Ray for {args.replicas} replicas of the demo model")
    ray.init(num_cpus=max(2, args.replicas), include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    port = free_port()
    start_serve("127.0.0.1", port)
    rows = {}
    try:
        for affinity in (True, False):
            name = "state affinity" if affinity else "Ray Serve's default"
            say(f"{name}: deploying")
            config = AppConfig(replicas=args.replicas, ingress_replicas=args.ingress, num_cpus=0,
                               state_affinity=affinity)
            serve.run(build_app(config), name=APP_NAME, route_prefix="/")
            rows[name] = asyncio.run(run_threads(f"http://127.0.0.1:{port}", args))
            serve.delete(APP_NAME)
    finally:
        serve.shutdown()
        ray.shutdown()

    print(f"{args.replicas} replicas (demo model, CPU), {args.ingress} ingress replica(s), "
          f"{args.threads} threads of {args.prefix} tokens, "
          f"{args.turns} later turns of +{args.step} tokens each, "
          f"{'a turn of every thread at once' if args.concurrent else 'one request at a time'}; the later turns:\n")
    print("| router | previous prompt found cached | prompt tokens from a cache | latency ms, mean / p50 / max |")
    print("|---|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['found']} of {r['turns']} | {r['cached']:.0%} | "
              f"{r['mean']:.0f} / {r['p50']:.0f} / {r['max']:.0f} |")
    base, ours = rows["Ray Serve's default"], rows["state affinity"]
    print(f"\nMean latency, default / affinity: {base['mean'] / ours['mean']:.1f}×")


if __name__ == "__main__":
    main()
