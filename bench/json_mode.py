"""What JSON mode (and a pattern: structured outputs' choice and regex) costs on the host, and in the
engine on the CPU, side by side in one run.

1. The constraints alone, for the World vocabulary (65,536 tokens) and the demo model's (4,096):
   the grammar's build (the tokens' trie), then for each kind of constraint (any object; a schema
   pydantic writes for a model with a list of nested objects, a dict and an optional field; one
   with a pattern, a length, a date-time, bounded numbers and a uuid; tool_choice "auto" over two
   tools; up to 8 parallel calls of them; a choice of four texts; a regex of codes) random texts it
   allows (a pattern's end at end of text, where it is allowed), drawn a token at a time uniformly
   among the allowed ones (a random model's worst case: more states than a trained model's), up
   to 200 tokens each: masks made and their cost, and the cost of advancing a state by a token.
2. The engine on the CPU with the demo model (no Ray), in a steady state (bench/engine_cpu.py's:
   8 requests always in flight, each replaced as it ends), without JSON mode and in each kind:
   generated and prompt tokens/s. A burst would mislead here: its JSON rows end where their
   objects close, so its last steps run fewer rows.

    python bench/json_mode.py [--texts 20] [--seconds 4] [--threads N]

Prints progress to stderr and Markdown tables to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import random
import sys
import time
import uuid
from pathlib import Path

import torch
from pydantic import BaseModel, Field

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_cpu import steady_rate  # noqa: E402 (bench/engine_cpu.py, beside this file)

from replicas.engine import Engine, EngineConfig  # noqa: E402
from replicas.json_grammar import JsonGrammar, unpack  # noqa: E402
from replicas.json_regex import choice_pattern  # noqa: E402
from replicas.model.checkpoint import WORLD_VOCAB  # noqa: E402
from replicas.model.loader import default_model_dir, open_model  # noqa: E402
from replicas.sampling import SamplingParams  # noqa: E402
from replicas.tokenizer import load_tokenizer  # noqa: E402


class Line(BaseModel):
    sku: str
    quantity: int


class Order(BaseModel):
    id: int
    customer: str
    lines: list[Line]
    paid: bool
    note: str | None = None
    prices: dict[str, float] = {}


TOOLS = {"anyOf": [
    {"type": "object", "required": ["name", "arguments"], "additionalProperties": False, "properties": {
        "name": {"const": "set_light"}, "arguments": {"type": "object", "properties": {"on": {"type": "boolean"}}}}},
    {"type": "object", "required": ["name", "arguments"], "additionalProperties": False, "properties": {
        "name": {"const": "search"}, "arguments": {"type": "object", "properties": {"query": {"type": "string"}}}}},
]}
class Booking(BaseModel):
    code: str = Field(pattern=r"^[A-Z]{3}-\d{4}$")
    guest: str = Field(min_length=1, max_length=40)
    arrives: datetime.datetime
    nights: int = Field(ge=1, le=30)
    rating: float = Field(ge=0, le=5)
    id: uuid.UUID


KINDS = {  # label -> SamplingParams fields
    "any object": {"json_object": True},
    "a schema (pydantic)": {"json_schema": json.dumps(Order.model_json_schema())},
    "constrained values (pydantic)": {"json_schema": json.dumps(Booking.model_json_schema())},
    'tool_choice "auto"': {"json_schema": json.dumps(TOOLS), "json_or_text": True},
    "parallel tool calls": {"json_schema": json.dumps(TOOLS), "json_texts": 8},
    "a choice of 4 texts": {"text_pattern": choice_pattern(["positive", "negative", "neutral", "mixed feelings"])},
    "a regex": {"text_pattern": r"[A-Z]{2}-\d{3}(, [A-Z]{2}-\d{3})*"},
}


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def constraints(vocab: str, texts: int) -> list[dict]:
    tokenizer = load_tokenizer(WORLD_VOCAB if vocab == "world" else default_model_dir() / "tokenizer.json")
    started = time.perf_counter()
    grammar = JsonGrammar(tokenizer)
    build = time.perf_counter() - started
    rows = []
    for label, fields in KINDS.items():
        constraint = grammar.constraint(fields.get("json_schema"), fields.get("json_or_text", False),
                                        fields.get("json_texts", 1), fields.get("text_pattern"))
        rng, advance_s, tokens, ended = random.Random(0), 0.0, 0, 0
        grammar.stats.clear()
        for _ in range(texts):
            state = constraint.start
            for _ in range(200):
                allowed = (~unpack(constraint.banned(state), tokenizer.vocab_size)).nonzero()[:, 0]
                token = int(allowed[rng.randrange(len(allowed))])
                started = time.perf_counter()
                state = constraint.advance(state, token)
                advance_s += time.perf_counter() - started
                tokens += 1
                if state is None or constraint.free(state) or constraint.done(state):  # (None: end of text)
                    ended += 1
                    break
        made = grammar.stats["json_masks_made"]
        rows.append({"vocab": f"{vocab} ({tokenizer.vocab_size:,})", "build_ms": 1e3 * build, "kind": label,
                     "tokens": tokens, "ended": ended, "texts": texts, "masks": made,
                     "mask_ms": grammar.stats["json_mask_us"] / 1e3 / max(made, 1),
                     "advance_us": 1e6 * advance_s / tokens})
        say(f"{vocab} {label}: {made} masks, {rows[-1]['mask_ms']:.2f} ms each, {rows[-1]['advance_us']:.1f} µs "
            "a token's advance")
    return rows


def engine_rates(seconds: float) -> list[dict]:
    runner, tokenizer, _ = open_model(default_model_dir(), max_slots=8, device="cpu")
    rows = []
    for label, fields in {"without JSON mode": {}, **KINDS}.items():
        engine = Engine(runner, tokenizer, EngineConfig(max_slots=8)).start()
        try:
            params = SamplingParams(top_p=0.9, seed=0, **fields)
            rate = asyncio.run(steady_rate(engine, 8, 16, params, seconds=seconds, warm_seconds=1.0))
            counters = engine.snapshot_stats()["counters"]
        finally:
            engine.stop()
        rows.append({"kind": label, **rate, "requests": counters["submitted"],
                     "mask_ms": counters.get("json_mask_us", 0) / 1e3})
        say(f"engine {label}: {rate['generated']:,.0f} + {rate['prompt']:,.0f} tokens/s")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--texts", type=int, default=20, help="random texts a constraint")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a served CPU replica's: 1)")
    parser.add_argument("--seconds", type=float, default=4.0, help="the engine's steady window a kind")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [r for vocab in ("world", "demo") for r in constraints(vocab, args.texts)]
    print(f"JSON mode's constraints on the host ({args.texts} random texts a kind, drawn uniformly among the "
          "allowed tokens, up to 200 tokens each):\n")
    print("| vocabulary | trie built, ms | constraint | tokens | texts ended | masks made | ms a mask | "
          "µs a token's advance |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['vocab']} | {r['build_ms']:.0f} | {r['kind']} | {r['tokens']:,} | {r['ended']} of {r['texts']} | "
              f"{r['masks']:,} | {r['mask_ms']:.2f} | {r['advance_us']:.1f} |")
    engine = engine_rates(args.seconds)
    base = engine[0]["generated"]
    print(f"\nThe engine on the CPU (demo model, {torch.get_num_threads()} thread(s)): 8 requests always in flight, "
          f"each replaced as it ends (a JSON row ends where its object closes), prompts of 8-24 tokens, max_tokens "
          f"32-224, top-p 0.9; {args.seconds:g} s after 1 s:\n")
    print("| requests | generated tokens/s | of without JSON mode | prompt tokens/s | requests run | "
          "ms making masks |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in engine:
        print(f"| {r['kind']} | {r['generated']:,.0f} | {r['generated'] / base:.2f}× | {r['prompt']:,.0f} | "
              f"{r['requests']:,} | {r['mask_ms']:.0f} |")


if __name__ == "__main__":
    main()
