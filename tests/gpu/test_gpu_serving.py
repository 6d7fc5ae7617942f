"""Serving on the GPU: greedy text equal to the CPU path, and the engine on the CUDA runner (the
sampler on the GPU against the CPU: test_sampling_kernel.py).

The demo model (models/demo) when present, else the random model with peaked logits.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from replicas.engine import Delta, Engine, EngineConfig, Request
from replicas.engine_process import EngineProcess
from replicas.model.call_shapes import EXACT_PREFILL
from replicas.model.loader import default_model_dir, open_model
from replicas.sampling import SamplingParams
from tests.prompts import PYTHON_PROMPTS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = [*PYTHON_PROMPTS, "User: What is the capital of France?\n\nAssistant:"]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def model_dir(random_model_dir):
    """The demo model when it is there (it ships in the repository), else the random one."""
    demo = default_model_dir()
    return demo if (demo / "config.json").is_file() and (demo / "model.safetensors").is_file() else random_model_dir


@pytest.fixture(scope="module")
def cpu_greedy(model_dir):
    """Each prompt's first 32 greedy tokens on the CPU path (fp32), one prompt at a time."""
    runner, tokenizer, _ = open_model(model_dir, max_slots=1, device="cpu")
    out = []
    for prompt in PROMPTS:
        runner.reset(0)
        logits = runner.prefill([0], [tokenizer.encode(prompt)])
        tokens = []
        for _ in range(NEW_TOKENS):
            tokens.append(int(logits[0].argmax()))
            logits = runner.decode([0], [tokens[-1]])
        out.append(tokens)
    return tokenizer, out


def test_greedy_text_matches_the_cpu_path_batched(model_dir, cpu_greedy):
    """All prompts in one prefill call (ragged rows) and one decode batch per step."""
    tokenizer, expected = cpu_greedy
    runner, _, _ = open_model(model_dir, max_slots=len(PROMPTS), device="cuda")
    slots = list(range(len(PROMPTS)))[::-1]
    logits = runner.prefill(slots, [tokenizer.encode(p) for p in PROMPTS])
    got = [[] for _ in PROMPTS]
    for _ in range(NEW_TOKENS):
        step = logits.argmax(-1).tolist()
        for row, token in zip(got, step, strict=True):
            row.append(token)
        logits = runner.decode(slots, step)
    for prompt, ours, theirs in zip(PROMPTS, got, expected, strict=True):
        assert ours == theirs, f"{prompt!r}: {tokenizer.decode(ours)!r} != {tokenizer.decode(theirs)!r}"


@pytest.mark.parametrize(("where", "speculative"), [("this process", 0), ("a process of its own", 0),
                                                    ("this process", 2)])
def test_engine_on_the_gpu_gives_the_cpu_greedy_text(model_dir, cpu_greedy, where, speculative):
    """The engine as a replica runs it (replicas/engine_process.py), and in this process; with
    speculative decoding, whose drafts' calls (prefill_all of a few tokens) replay graphs."""
    tokenizer, expected = cpu_greedy
    config = EngineConfig(max_slots=4, token_chunk_size=16, max_prefill_tokens=40, speculative_tokens=speculative,
                          speculative_max_rows=4)
    if where == "this process":
        runner, _, _ = open_model(model_dir, max_slots=4, device="cuda")
        engine = Engine(runner, tokenizer, config).start()
    else:
        engine, _, _ = EngineProcess.open(model_dir, "cuda", config)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)

    async def one(prompt, delay):
        await asyncio.sleep(delay)
        tokens = []
        stream = engine.submit(Request(tokenizer.encode(prompt), params))
        async for event in stream:
            if isinstance(event, Delta):
                tokens += event.token_ids
        return tokens

    async def all_prompts():  # more prompts than slots: rows arrive, wait, leave mid-batch
        return await asyncio.gather(*(one(p, 0.005 * i) for i, p in enumerate(PROMPTS)))

    try:
        results = asyncio.run(all_prompts())
        engine.check_integrity()
        stats = engine.snapshot_stats()["counters"]
    finally:
        engine.stop()
    assert results == expected
    assert (stats.get("accepted_drafts", 0) > 0) == bool(speculative)


def test_json_mode_on_the_gpu_writes_the_cpus_json(model_dir):
    """JSON mode through the engine on the GPU (the masks on the device, the sampler's kernel):
    greedy rows write the CPU engine's text, and every row that ends is an object, or an instance
    of its schema (a pattern and a date included); rows of parallel calls' form end as up to three
    objects."""
    import datetime
    import json
    import re

    schema = json.dumps({"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"},
                                                          "ok": {"type": "boolean"}}, "required": ["name", "n"]})
    strings = json.dumps({"type": "object", "required": ["code", "day"], "properties": {
        "code": {"type": "string", "pattern": "^[a-z]{2,5}$"}, "day": {"type": "string", "format": "date"}}})
    kinds = [{"json_object": True}, {"json_schema": schema}, {"json_schema": strings},
             {"json_object": True, "json_texts": 3}]  # (parallel tool calls' form: up to 3 objects, a line each)
    greedy = [SamplingParams(max_tokens=64, temperature=0.0, **kind) for kind in kinds]
    exact = 2  # greedy rows of the first kinds write the CPU's text; the others meet their schemas (the
    # patterned one's third prompt meets a near tie on the CPU, ' "' over '"' by 0.0007 after "code":)
    sampled = [SamplingParams(max_tokens=96, top_p=0.9, seed=seed, **kind) for seed, kind in enumerate(kinds * 3)]

    def run(device: str, params: list[SamplingParams]) -> list[tuple[str, str]]:
        runner, tokenizer, _ = open_model(model_dir, max_slots=4, device=device)
        engine = Engine(runner, tokenizer, EngineConfig(max_slots=4)).start()

        async def one(prompt: str, p: SamplingParams) -> tuple[str, str]:
            text, reason = "", None
            async for event in engine.generate(Request(tokenizer.encode(prompt), p)):
                if isinstance(event, Delta):
                    text += event.text
                else:
                    reason = getattr(event, "reason", reason)
            return text, reason

        async def everything():
            return await asyncio.gather(*(one(prompt, p) for prompt in PROMPTS[:3] for p in params))

        try:
            results = asyncio.run(everything())
            engine.check_integrity()
        finally:
            engine.stop()
        return results

    params = greedy + sampled
    on_gpu = run("cuda", params)
    assert [r for i, r in enumerate(on_gpu) if i % len(params) < exact] == run("cpu", greedy[:exact])
    for i, (text, reason) in enumerate(on_gpu):
        if reason != "stop":
            continue
        p = params[i % len(params)]
        values, at, decoder = [], len(text) - len(text.lstrip()), json.JSONDecoder()
        while at < len(text):
            value, at = decoder.raw_decode(text, at)
            values.append(value)
            at = len(text) - len(text[at:].lstrip())
        assert 1 <= len(values) <= p.json_texts and all(isinstance(v, dict) for v in values), text
        if p.json_schema == schema:
            assert isinstance(values[0]["name"], str) and type(values[0]["n"]) is int, text
        elif p.json_schema == strings:
            assert re.fullmatch("[a-z]{2,5}", values[0]["code"]) and datetime.date.fromisoformat(values[0]["day"])
    assert sum(reason == "stop" for _, reason in on_gpu) >= len(on_gpu) // 2


def test_scored_prompts_on_the_gpu_give_the_cpus_logprobs(model_dir):
    """Prompts scored token by token (echo with logprobs) through the engine in its own process on
    the GPU, beside rows that generate: the prompt tokens' logprobs within the exactness bar of the
    CPU model's fp32 math (‖Δ‖/‖ref‖ ≤ 1e-2), the first token's none, the top alternative the
    CPU's where it is not near a tie. The long prompt takes two calls of the large path. Then two
    more choices after one context, one after the other: the second parts from the first and
    publishes its state there, and the third starts from it, with the context's cached scores."""
    from replicas.model.rwkv7 import Rows
    from replicas.model.state import RNNState

    runner, tokenizer, _ = open_model(model_dir, max_slots=1, device="cpu")
    context = "".join(PYTHON_PROMPTS[:3])
    choices = [context + answer for answer in (" return 0", " print(x)", " pass")]
    prompts = ["".join(PYTHON_PROMPTS) * 4, PROMPTS[-1], choices[0]]  # a long one (two chunks of 256), short ones
    config = EngineConfig(max_slots=4, token_chunk_size=256, max_prefill_tokens=512)
    engine, _, _ = EngineProcess.open(model_dir, "cuda", config)

    scored, plain = (SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=1),
                     SamplingParams(max_tokens=16, temperature=0.0))

    async def one(prompt: str, params: SamplingParams):
        """The prompt's scored entries (None when it is not scored), its request run to its end."""
        entries = None
        async for event in engine.submit(Request(tokenizer.encode(prompt), params)):
            if isinstance(event, Delta) and event.prompt_logprobs:
                entries = event.prompt_logprobs
        return entries

    async def everything():  # the scored prompts, and rows that generate beside them
        return await asyncio.gather(*(one(p, scored) for p in prompts), *(one(p, plain) for p in PROMPTS[:3]))

    try:
        entries = asyncio.run(everything())[:len(prompts)]
        entries += [asyncio.run(one(choice, scored)) for choice in choices[1:]]
        stats = engine.snapshot_stats()
        engine.check_integrity()
    finally:
        engine.stop()
    assert stats["cache"]["hit_tokens"] >= len(tokenizer.encode(context)) - 1
    for prompt, got in zip(prompts + choices[1:], entries, strict=True):
        ids = tokenizer.encode(prompt)
        with torch.no_grad():
            logits, _ = runner.model(torch.tensor(ids), Rows([len(ids)]), RNNState.zeros(runner.config, 1),
                                     last_only=False)
        ref = torch.log_softmax(logits, dim=-1)
        assert [e.token_id for e in got] == ids and got[0].logprob is None
        want = ref[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        diff = torch.tensor([e.logprob for e in got[1:]]) - want
        assert diff.norm() / want.norm() <= 1e-2 and diff.abs().max() <= 0.1, (len(ids), diff.abs().max())
        top2 = ref[:-1].topk(2).values
        clear = (top2[:, 0] - top2[:, 1] > 0.05).tolist()
        assert all(e.top[0][0] == int(ref[i].argmax()) for i, e in enumerate(got[1:]) if clear[i])


def test_a_parked_row_goes_on_as_it_would_have_on_the_gpu(model_dir, cpu_greedy):
    """Priority on the CUDA runner and the sampler's kernel: a greedy row and a sampled row with
    penalties hold the two slots; an urgent request parks one, then the other comes back. Each
    parked row's tokens are those it gets alone (greedy: the CPU's; sampled: the same request alone
    in a fresh engine on the GPU), so its state and penalty counts came back whole. Every prefill
    call stays within EXACT_PREFILL tokens, so both engines feed the sampled row on the exact paths:
    two rows' chunks in one call of more take the fp16 large path, whose logits differ by about
    1e-3, enough to move a sampled token by a few places in the vocabulary (docs/gpu-history.md,
    "12-07f": it failed in 4 runs of 6 that way)."""
    tokenizer, expected = cpu_greedy
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, seed=5, presence_penalty=0.5,
                             frequency_penalty=0.5, ignore_eos=True)
    config = EngineConfig(max_slots=2, token_chunk_size=EXACT_PREFILL, max_prefill_tokens=EXACT_PREFILL)

    def engine() -> Engine:
        runner, _, _ = open_model(model_dir, max_slots=2, device="cuda")
        return Engine(runner, tokenizer, config).start()

    async def run(eng: Engine, requests: list[tuple[str, SamplingParams, int, int]]) -> list[list[int]]:
        """Each (prompt, params, priority, tokens of the first request to wait for) to its end."""
        out: list[list[int]] = [[] for _ in requests]

        async def one(i: int) -> None:
            prompt, params, priority, after = requests[i]
            while len(out[0]) < after:
                await asyncio.sleep(0.001)
            async for event in eng.submit(Request(tokenizer.encode(prompt), params, priority=priority)):
                if isinstance(event, Delta):
                    out[i] += event.token_ids

        await asyncio.gather(*(one(i) for i in range(len(requests))))
        return out

    busy = engine()
    try:
        got = asyncio.run(run(busy, [(PROMPTS[0], greedy, 1, 0), (PROMPTS[1], sampled, 1, 0),
                                     (PROMPTS[2], greedy, 0, 8), (PROMPTS[3], greedy, 0, 8)]))
        preempted = busy.snapshot_stats()["counters"]["preempted"]
        busy.check_integrity()
    finally:
        busy.stop()
    alone = engine()
    try:
        (sampled_alone,) = asyncio.run(run(alone, [(PROMPTS[1], sampled, 0, 0)]))
    finally:
        alone.stop()
    assert preempted == 2
    assert got[0] == expected[0] and got[2] == expected[2] and got[3] == expected[3]
    assert got[1] == sampled_alone
