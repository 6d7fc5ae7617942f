"""The sampler's one-launch kernel against its torch lines (sampling.py), on one device.

Both compute integer masses with the same exp and sum them exactly, so they must choose the same
tokens, leave the same penalised logits and counts, for greedy rows, top-k in and past the torch
lines' window, top-p, penalties over several steps, biases, ties and flat or peaked rows.

Marked `gpu`; on the CPU it runs under Triton's interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from replicas.sampling import Sampler, SamplingParams

from .conftest import CUDA, DEVICE, INTERPRET, KERNEL_MARKS

pytestmark = KERNEL_MARKS
if CUDA or INTERPRET:
    pytest.importorskip("replicas.sampling_kernel")

PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, top_p=0.9),
    SamplingParams(temperature=1.2, top_k=40),
    SamplingParams(temperature=1.0, top_p=0.5, top_k=100, presence_penalty=0.5, frequency_penalty=0.3),
    SamplingParams(temperature=0.7, logit_bias={5: 20.0, 6: -100.0}),
    SamplingParams(temperature=1.0, frequency_penalty=1.5, penalty_decay=0.9, logprobs=3),
    SamplingParams(temperature=1.0, top_k=1500, top_p=0.95),  # k past the window: counted
    SamplingParams(temperature=1.0, top_k=300),  # k just past the window's 256
    SamplingParams(temperature=2.0, top_p=0.999),
    SamplingParams(temperature=0.5, top_p=1e-6),  # the best token alone
    SamplingParams(temperature=0.0, presence_penalty=2.0, penalty_decay=0.5),
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=0.9, min_p=0.02, top_p=0.9, top_k=300),  # min-p, then the others over its
    SamplingParams(temperature=1.0, min_p=1.0),  # the best (and its ties) alone
]


def rows(vocab: int, shape: str, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(len(PARAMS), vocab, generator=gen)
    if shape == "peaked":
        x *= 8
    elif shape == "ties":
        x = (x * 2).round()
    return x


@pytest.mark.parametrize("vocab", [50, 3000] + ([65536] if CUDA else []))
@pytest.mark.parametrize("shape", ["flat", "peaked", "ties"])
def test_kernel_chooses_as_the_torch_lines(vocab, shape):
    gen = torch.Generator().manual_seed(vocab + len(shape))
    params = [SamplingParams(**{**p.__dict__, "top_k": min(p.top_k, vocab - 1)}) for p in PARAMS]
    slots = list(range(len(params)))[::-1]
    torch_lines = Sampler(len(params), vocab, DEVICE, kernel=False)
    kernel = Sampler(len(params), vocab, DEVICE, kernel=True)
    for _ in range(4):  # the penalty counts build up over the steps
        params = params[1:] + params[:1]  # and each slot's parameters change: its table row follows
        logits = rows(vocab, shape, gen).to(DEVICE)
        uniforms = torch.rand(len(params), generator=gen).tolist()
        ours = kernel.sample(logits, slots, params, uniforms)
        ref = torch_lines.sample(logits, slots, params, uniforms)
        assert ours.tokens == ref.tokens
        assert ours.logprobs == ref.logprobs  # from the penalised logits: those agree too
        assert torch.equal(kernel.counts, torch_lines.counts)
    assert kernel.counts.abs().sum() > 0  # the penalised rows counted something


@pytest.mark.skipif(not CUDA, reason="the CPU against a GPU")
@pytest.mark.parametrize("seed", [0, 1])
def test_the_gpu_chooses_as_the_cpu(seed):
    """The kernel on the GPU against the torch lines on the CPU: another exp, the same tokens."""
    V = 65536
    gen = torch.Generator().manual_seed(seed)
    slots = list(range(len(PARAMS)))[::-1]
    cpu, gpu = Sampler(len(PARAMS), V, "cpu"), Sampler(len(PARAMS), V, "cuda")
    for _ in range(6):
        logits = torch.randn(len(PARAMS), V, generator=gen) * 3
        uniforms = torch.rand(len(PARAMS), generator=gen).tolist()
        a = cpu.sample(logits, slots, PARAMS, uniforms)
        b = gpu.sample(logits.cuda(), slots, PARAMS, uniforms)
        assert a.tokens == b.tokens
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert (x is None) == (y is None)
            if x is not None:
                assert abs(x.logprob - y.logprob) < 1e-3
    assert torch.allclose(cpu.counts, gpu.counts.cpu())


def test_kernel_follows_the_distribution():
    """Uniform numbers spread over [0, 1) pick each token as often as its probability."""
    vocab, draws = 40, 2000
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(1)).to(DEVICE) * 2
    probs = torch.softmax(logits[0].cpu(), -1)
    sampler = Sampler(draws, vocab, DEVICE, kernel=True)
    picks = sampler.sample(logits.expand(draws, vocab).contiguous(), list(range(draws)),
                           [SamplingParams()] * draws, [(i + 0.5) / draws for i in range(draws)]).tokens
    freq = torch.bincount(torch.tensor(picks), minlength=vocab).float() / draws
    assert (freq - probs).abs().max() < 2e-3


def test_kernel_on_awkward_rows():
    """Ties at the k-th token (the best k's mass counts one copy), zeros of both signs, -inf
    logits, a one-value row; uniform numbers at both ends."""
    x = torch.tensor([[3.0, 2.0, 2.0, 2.0, 2.0, 1.0],
                      [0.0, -0.0, -0.0, 0.0, -1e-30, 1e-30],
                      [float("-inf"), 3.0, float("-inf"), 3.0, 3.0, 1.0],
                      [5.0] * 6])
    torch_lines = Sampler(4, 6, DEVICE, kernel=False)
    kernel = Sampler(4, 6, DEVICE, kernel=True)
    for k, p in ((2, 0.6), (2, 1.0), (3, 0.9), (0, 0.5), (0, 1.0), (5, 1e-6)):
        params = [SamplingParams(temperature=1.0, top_k=k, top_p=p)] * 4
        for u in (0.0, 0.5, 0.999):
            ours = kernel.sample(x.to(DEVICE), range(4), params, [u] * 4).tokens
            assert ours == torch_lines.sample(x.to(DEVICE), range(4), params, [u] * 4).tokens, (k, p, u)
    # the best k's mass counts one copy of the tied 2.0: the nucleus of 0.6 is the 3.0 alone
    assert kernel.sample(x[:1].to(DEVICE), [0], [SamplingParams(top_k=2, top_p=0.6)], [0.999]).tokens == [0]
    # a uniform number of 0 draws the first kept token, not the vocabulary's first
    assert kernel.sample(x[2:3].to(DEVICE), [0], [SamplingParams(top_k=3)], [0.0]).tokens == [1]


def test_banned_tokens_json_mode_are_never_chosen_nor_listed():
    """A row's banned tokens (JSON mode's mask) at -inf: the kernel and the torch lines choose the
    same allowed tokens, greedy or sampled, past top-k and top-p, biased or penalised, and the
    top logprobs list only allowed tokens, fewer than asked where fewer are allowed."""
    vocab, gen = 3000, torch.Generator().manual_seed(7)
    params = [SamplingParams(temperature=0.0, logprobs=5), SamplingParams(top_k=50, top_p=0.9, logprobs=5),
              SamplingParams(temperature=1.5, logit_bias={3: 100.0}), SamplingParams(presence_penalty=2.0),
              SamplingParams(temperature=1.0)]
    allowed = [torch.randperm(vocab, generator=gen)[:n] for n in (3, 2, 40, 1, 700)]
    masks = [torch.ones(vocab, dtype=torch.bool).index_fill_(0, a, False) for a in allowed]
    banned = [torch.from_numpy(np.packbits(m.numpy(), bitorder="little")).to(DEVICE) for m in masks]
    banned[4] = None  # a row not in JSON mode beside them
    slots = list(range(len(params)))
    torch_lines = Sampler(len(params), vocab, DEVICE, kernel=False)
    kernel = Sampler(len(params), vocab, DEVICE, kernel=True)
    for _ in range(4):
        logits = (torch.randn(len(params), vocab, generator=gen) * 4).to(DEVICE)
        uniforms = torch.rand(len(params), generator=gen).tolist()
        ours = kernel.choose(logits, slots, params, uniforms, banned).result()
        ref = torch_lines.choose(logits, slots, params, uniforms, banned).result()
        assert ours.tokens == ref.tokens and ours.logprobs == ref.logprobs
        for i in range(4):
            assert ours.tokens[i] in allowed[i].tolist()
        assert [len(ours.logprobs[i].top) for i in (0, 1)] == [3, 2]
        assert all(t in allowed[i].tolist() for i in (0, 1) for t, _ in ours.logprobs[i].top)
