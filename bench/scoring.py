"""What scoring a prompt costs against prefilling it, side by side in one run, through the engine
(no Ray): completions with echo and logprobs, lm-evaluation-harness's loglikelihood requests.

Each case submits `--requests` prompts of `--tokens` random tokens at once, max_tokens 1, greedy:
"prefilled" (the last logits only, as any prompt) and "scored" (prompt_logprobs 1: the logits
after every token, each token's logprob and the best alternative). The prompts differ between
cases and rounds, so that no case finds another's states in the cache. A round of each to warm
up, then two rounds alternated; prints prompt tokens/s and the ratio.

`--choice` measures a multiple-choice evaluation instead, as lm-evaluation-harness sends one:
`--questions` questions of `--choices` choices, each choice a scored prompt (prompt_logprobs 1,
max_tokens 1) of the question's `--context` random tokens and an answer of 1 to 2 × `--answer`, sent in
lm-eval's order (longest prompt first) `--concurrency` at a time. The engine as it is (a scored
prompt starts from a cached state that keeps its tokens' scores, a prompt publishes its state
where it parts from a cached one) against the engine with both switched off in this process (as
before 2026-12-07: every scored prompt prefilled from its start), alternated, two rounds after
one to warm up; fresh questions each time.

    python bench/scoring.py                                  # the demo model on the CPU
    python bench/scoring.py --model 1.5b --device cuda       # a random model of the released shape
    python bench/scoring.py --choice --model 0.1b            # multiple choice, the 0.1B shape

Prints progress to stderr and a Markdown table to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from replicas.engine import Engine, EngineConfig, Request, _Row  # noqa: E402
from replicas.sampling import SamplingParams  # noqa: E402

SHAPES = ("0.1b", "1.5b", "7.2b")


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def open_runner(name: str, device: str, slots: int):
    """(runner, tokenizer): the demo model, or a random model of a released shape."""
    from replicas.model.loader import default_model_dir, open_model  # noqa: PLC0415

    if name == "demo":
        runner, tokenizer, _ = open_model(default_model_dir(), max_slots=slots, device=device)
        return runner, tokenizer
    from replicas.model.checkpoint import WORLD_VOCAB  # noqa: PLC0415
    from replicas.tokenizer import load_tokenizer  # noqa: PLC0415

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu import SHAPES as CONFIGS  # noqa: PLC0415 (bench/gpu.py, beside this file)
    from gpu import random_model  # noqa: PLC0415

    if device == "cuda":
        from replicas.model.cuda_runner import CudaRunner  # noqa: PLC0415

        runner = CudaRunner(random_model(CONFIGS[name], torch.float16), max_slots=slots)
    else:
        from replicas.model.runner import ModelRunner  # noqa: PLC0415

        runner = ModelRunner(random_model(CONFIGS[name], torch.float32, device="cpu"), max_slots=slots)
    return runner, load_tokenizer(WORLD_VOCAB)


async def prompt_rate(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> float:
    """Prompt tokens/s: every prompt submitted at once, until the last one's reply ends."""
    async def one(prompt: list[int]) -> None:
        async for _ in engine.generate(Request(prompt, params)):
            pass

    start = time.perf_counter()
    await asyncio.gather(*(one(p) for p in prompts))
    return sum(map(len, prompts)) / (time.perf_counter() - start)


@contextlib.contextmanager
def as_before(engine: Engine):
    """The engine with scored prompts' cached states and branch points switched off."""
    reused, reach = _Row.reused, engine.cache.reach
    _Row.reused = property(lambda row: () if row.scored is not None else row.request.prompt)
    engine.cache.reach = lambda namespace, tokens: 0
    try:
        yield
    finally:
        _Row.reused, engine.cache.reach = reused, reach


async def evaluate(engine: Engine, prompts: list[list[int]], concurrency: int) -> float:
    """Seconds to score every prompt, `concurrency` requests in flight (lm-eval's num_concurrent)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    gate = asyncio.Semaphore(concurrency)

    async def one(prompt: list[int]) -> None:
        async with gate:
            async for _ in engine.generate(Request(prompt, params)):
                pass

    start = time.perf_counter()
    await asyncio.gather(*(one(p) for p in prompts))
    return time.perf_counter() - start


def multiple_choice(args, runner, tokenizer) -> None:
    config = EngineConfig(max_slots=args.concurrency, max_waiting=args.concurrency, token_chunk_size=512,
                          max_prefill_tokens=4096 if args.device == "cuda" else 1024)
    engine = Engine(runner, tokenizer, config).start(say)
    gen = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(1, runner.vocab_size, (n,), generator=gen).tolist()

    cases = ("every choice prefilled (before)", "cached scores, branch points")
    seconds: dict[str, list[float]] = {case: [] for case in cases}
    prefilled: dict[str, int] = {}
    try:
        for round_ in range(3):
            for case in cases:
                lengths = torch.randint(1, 2 * args.answer, (args.questions * args.choices,), generator=gen).tolist()
                prompts = [context + tokens(lengths.pop()) for context in (tokens(args.context)
                           for _ in range(args.questions)) for _ in range(args.choices)]
                prompts.sort(key=lambda p: (-len(p), p))  # lm-eval's order
                before = engine.snapshot_stats()["counters"].get("prefilled_tokens", 0)
                with as_before(engine) if case.endswith("(before)") else contextlib.nullcontext():
                    took = asyncio.run(evaluate(engine, prompts, args.concurrency))
                done = engine.snapshot_stats()["counters"].get("prefilled_tokens", 0) - before
                say(f"[{args.model}] round {round_}, {case}: {took:.2f} s, {done:,} of "
                    f"{sum(map(len, prompts)):,} prompt tokens prefilled")
                if round_:
                    seconds[case].append(took)
                    prefilled[case] = done
        engine.check_integrity()
    finally:
        engine.stop()
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"\n{args.model}, {where}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}: {args.questions} "
          f"questions of {args.choices} choices, {args.context}-token contexts, {args.answer}-token answers, "
          f"{args.concurrency} at a time (two rounds)\n")
    print("| engine | seconds | prompt tokens prefilled (the last round) | speed-up |\n|---|---|---|---|")
    base = sum(seconds[cases[0]])
    for case, took in seconds.items():
        print(f"| {case} | {' / '.join(f'{t:.2f}' for t in took)} | {prefilled[case]:,} | {base / sum(took):.2f}× |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo", choices=["demo", *SHAPES])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1, help="torch's threads on the CPU (a served CPU replica's: "
                        "its num_cpus, 1 by default)")
    parser.add_argument("--choice", action="store_true", help="a multiple-choice evaluation (above)")
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--choices", type=int, default=4)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--answer", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    say(f"[{args.model}] opening on {args.device}")
    runner, tokenizer = open_runner(args.model, args.device, args.concurrency if args.choice else args.requests)
    if args.device == "cuda":
        runner.warm_up(say)
    if args.choice:
        multiple_choice(args, runner, tokenizer)
        return
    config = EngineConfig(max_slots=args.requests, max_waiting=args.requests, token_chunk_size=512,
                          max_prefill_tokens=4096 if args.device == "cuda" else 1024)
    engine = Engine(runner, tokenizer, config).start(say)
    gen = torch.Generator().manual_seed(0)
    cases = {"prefilled": SamplingParams(max_tokens=1, temperature=0.0),
             "scored": SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)}
    rates: dict[str, list[float]] = {case: [] for case in cases}
    try:
        for round_ in range(3):  # the first warms up (a GPU's prefill shapes take graphs on their second sight)
            for case, params in cases.items():
                prompts = [torch.randint(1, runner.vocab_size, (args.tokens,), generator=gen).tolist()
                           for _ in range(args.requests)]
                rate = asyncio.run(prompt_rate(engine, prompts, params))
                say(f"[{args.model}] round {round_}, {case}: {rate:,.0f} prompt tokens/s")
                if round_:
                    rates[case].append(rate)
        engine.check_integrity()
    finally:
        engine.stop()
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"\n{args.model}, {where}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}: "
          f"{args.requests} prompts of {args.tokens} tokens at once, prompt tokens/s (two rounds)\n")
    print("| prefilled | scored (every token's logprob) | scored / prefilled |\n|---|---|---|")
    pre, sco = rates["prefilled"], rates["scored"]
    print(f"| {' / '.join(f'{r:,.0f}' for r in pre)} | {' / '.join(f'{r:,.0f}' for r in sco)} "
          f"| {sum(sco) / sum(pre):.2f} |")


if __name__ == "__main__":
    main()
