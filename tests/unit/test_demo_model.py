"""The embedded demo model (models/demo): small enough to ship, and a real language model.

Reads it as a user does (load_model: fp32 from the bfloat16 file) and checks what its issue
asks: the directory's size, a held-out loss under half the unigram baseline, and greedy
continuations that are deterministic, batch-invariant and clear-cut (a random model's nearly flat
logits flip greedy choices on rounding). Also checks the trainer's recurrence against the
reference one, since the shipped weights were trained through it.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from replicas.model.checkpoint import load_model
from replicas.model.config import ModelConfig
from replicas.model.runner import ModelRunner
from replicas.model.rwkv7 import RWKV7, init_random, wkv_reference

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "models" / "demo"
SIZE_LIMIT = 10_000_000  # bytes, everything in the directory
PROMPT = "import os\n"


@pytest.fixture(scope="module")
def demo() -> tuple[RWKV7, Tokenizer, dict]:
    model, card = load_model(DEMO)
    tok = Tokenizer.from_file(str(DEMO / card.tokenizer))
    return model, tok, json.loads((DEMO / "training.json").read_text())


def greedy(runner: ModelRunner, prompts: list[list[int]], n: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens of each row, and each step's logits [rows, V]."""
    rows = list(range(len(prompts)))
    logits = runner.prefill(rows, prompts)
    tokens: list[list[int]] = [[] for _ in rows]
    steps = []
    for _ in range(n):
        steps.append(logits)
        chosen = logits.argmax(-1).tolist()
        for row, token in zip(tokens, chosen, strict=True):
            row.append(token)
        logits = runner.decode(rows, chosen)
    return tokens, steps


def test_directory_fits_the_size_limit():
    files = [f for f in DEMO.iterdir() if f.is_file()]
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md", "loss.png"} <= {f.name for f in files}
    assert sum(f.stat().st_size for f in files) <= SIZE_LIMIT


def test_recorded_heldout_loss_is_under_half_the_unigram_baseline(demo):
    _, tok, record = demo
    assert record["heldout_nats"] <= 0.5 * record["unigram_heldout_nats"]
    assert tok.token_to_id("<|endoftext|>") == 0 and tok.get_vocab_size() == record["model"]["vocab_size"]


def test_heldout_excerpt_loss_is_under_half_the_unigram_baseline(demo):
    model, tok, record = demo
    ids = torch.tensor(tok.encode((DEMO / "heldout_excerpt.txt").read_text(), add_special_tokens=False).ids)
    assert ids.numel() == record["excerpt"]["tokens"]
    rows = record["excerpt"]["rows"]  # read as rows windows overlapping by one (tools/demo_card.py)
    L = (ids.numel() - 1) // rows
    windows = torch.stack([ids[i * L: i * L + L + 1] for i in range(rows)])
    with torch.no_grad():
        logits = model.forward_batch(windows[:, :-1], wkv=wkv_reference)
    nats = float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten()))
    assert nats == pytest.approx(record["excerpt"]["model_nats"], abs=1e-3)
    assert nats <= 0.5 * record["excerpt"]["unigram_nats"]


def test_greedy_continuation_is_deterministic_batch_invariant_and_peaked(demo):
    model, tok, _ = demo
    prompt = tok.encode(PROMPT, add_special_tokens=False).ids
    other = tok.encode("    for i in range(", add_special_tokens=False).ids
    alone, steps = greedy(ModelRunner(model, max_slots=1), [prompt], 16)
    again, _ = greedy(ModelRunner(model, max_slots=1), [prompt], 16)
    batched, _ = greedy(ModelRunner(model, max_slots=2), [other, prompt], 16)
    assert alone == again
    assert batched[1] == alone[0]
    assert tok.decode(alone[0]).startswith("import ")  # reads as Python
    top = torch.stack([logits[0] for logits in steps]).topk(2, dim=-1)  # [steps, 2]
    gap = top.values[:, 0] - top.values[:, 1]
    margin = top.values.softmax(-1)[:, 0]  # top-1 share of the top two: a random model's is ~0.5
    assert float(gap.min()) > 1e-3  # far above fp32 rounding between batch shapes (~1e-5)
    assert float(margin.median()) > 0.75


def _trainer():
    """tools/train_demo_model.py, a script rather than a package module."""
    name = "train_demo_model"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / "train_demo_model.py")
        sys.modules[name] = importlib.util.module_from_spec(spec)  # its dataclasses look it up there
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def test_training_recurrence_matches_the_reference():
    trainer = _trainer()
    config = ModelConfig(n_layer=2, n_embd=32, head_size=16, vocab_size=97, ffn_dim=64,
                         w_lora=8, a_lora=8, v_lora=8, g_lora=8)
    model = init_random(RWKV7(config), seed=3)
    tokens = torch.randint(0, 97, (3, 24), generator=torch.Generator().manual_seed(0))
    grads = []
    for wkv in (wkv_reference, trainer.wkv_transition):
        model.zero_grad()
        logits = model.forward_batch(tokens, wkv=wkv)
        logits.square().mean().backward()
        grads.append((logits.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    (ref, ref_grads), (fast, fast_grads) = grads
    torch.testing.assert_close(fast, ref, atol=1e-4, rtol=1e-4)
    for got, want in zip(fast_grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-3)
