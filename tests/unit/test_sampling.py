"""The batched sampler: each rule alone, and a row's independence from its batch."""

import math

import pytest
import torch

from replicas.sampling import InvalidRequest, Sampler, SamplingParams

V = 50


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_takes_the_argmax_and_bias_moves_it():
    x = logits(3)
    s = Sampler(4, V)
    greedy = SamplingParams(temperature=0.0)
    out = s.sample(x, [0, 1, 2], [greedy] * 3, [0.5] * 3)
    assert out.tokens == x.argmax(-1).tolist()
    biased = SamplingParams(temperature=0.0, logit_bias={7: 100.0})
    assert s.sample(x, [0, 1, 2], [biased] * 3, [0.5] * 3).tokens == [7, 7, 7]


def test_top_k_one_and_tiny_top_p_are_greedy_whatever_the_number():
    x = logits(4, 1)
    s = Sampler(4, V)
    for params in (SamplingParams(top_k=1), SamplingParams(top_p=1e-6)):
        for u in (0.0, 0.3, 0.999):
            assert s.sample(x, [0, 1, 2, 3], [params] * 4, [u] * 4).tokens == x.argmax(-1).tolist()


def test_inverse_cdf_follows_the_distribution():
    x = logits(1, 2)
    probs = torch.softmax(x[0], -1)
    s = Sampler(1, V)
    picks = [s.sample(x, [0], [SamplingParams()], [(i + 0.5) / 2000]).tokens[0] for i in range(2000)]
    freq = torch.bincount(torch.tensor(picks), minlength=V).float() / 2000
    assert (freq - probs).abs().max() < 2e-3


def test_min_p_keeps_the_tokens_at_least_min_p_as_likely_as_the_best_then_top_p_over_them():
    """Min-p first (vLLM's order): the tokens under min_p times the best's probability are never
    drawn, those above are drawn in proportion; top-p then cuts within what min-p kept."""
    x = logits(1, 5)
    probs = torch.softmax(x[0], -1)
    kept = probs >= 0.05 * probs.max()
    s = Sampler(1, V)
    picks = [s.sample(x, [0], [SamplingParams(min_p=0.05)], [(i + 0.5) / 2000]).tokens[0] for i in range(2000)]
    freq = torch.bincount(torch.tensor(picks), minlength=V).float() / 2000
    assert set(picks) == set(kept.nonzero()[:, 0].tolist())
    assert (freq - torch.where(kept, probs, 0) / probs[kept].sum()).abs().max() < 2e-3
    for u in (0.0, 0.5, 0.999):  # min_p 1: the best alone
        assert s.sample(x, [0], [SamplingParams(min_p=1.0)], [u]).tokens == [int(x.argmax())]
    order = probs.argsort(descending=True)
    nucleus = torch.where(kept, probs, 0)[order].cumsum(0) / probs[kept].sum()  # top-p 0.5 within min-p's
    expected = {int(t) for t, before in zip(order, nucleus - torch.where(kept, probs, 0)[order] / probs[kept].sum(),
                                           strict=True) if kept[t] and before < 0.5}
    picks = {s.sample(x, [0], [SamplingParams(min_p=0.05, top_p=0.5)], [(i + 0.5) / 500]).tokens[0] for i in range(500)}
    assert picks == expected


def test_a_row_does_not_depend_on_its_batch():
    x = logits(6, 3)
    s = Sampler(6, V)
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=20), SamplingParams(temperature=0.0),
              SamplingParams(top_k=5), SamplingParams(temperature=1.5, min_p=0.1), SamplingParams(top_p=0.5),
              SamplingParams(logit_bias={3: 2.0})]
    uniforms = [0.11, 0.22, 0.33, 0.44, 0.55, 0.66]
    together = s.sample(x, range(6), params, uniforms).tokens
    alone = [s.sample(x[i : i + 1], [i], [params[i]], [uniforms[i]]).tokens[0] for i in range(6)]
    assert together == alone


def test_penalties_count_generated_tokens_with_decay():
    s = Sampler(2, V)
    p = SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25, penalty_decay=0.5,
                       logit_bias={4: 10.0})
    x = torch.zeros(1, V)
    assert s.sample(x, [1], [p], [0.0]).tokens == [4]
    s.sample(x, [1], [p], [0.0])
    assert s.counts[1, 4].item() == pytest.approx(1.5)  # 1 * 0.5 + 1
    assert s.counts[0].abs().sum() == 0  # other slots untouched
    # token 4 now costs 0.5 + 0.25 * 1.5 = 0.875 — with a bias of 0.8 it no longer wins
    assert s.sample(torch.zeros(1, V), [1], [SamplingParams(temperature=0.0, presence_penalty=0.5,
                    frequency_penalty=0.25, penalty_decay=0.5, logit_bias={4: 0.8})], [0.0]).tokens != [4]
    s.reset(1)
    assert s.counts[1].abs().sum() == 0


def test_logprobs_are_log_softmax_with_the_top_alternatives():
    x = logits(2, 4)
    s = Sampler(2, V)
    out = s.sample(x, [0, 1], [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.0)],
                   [0.0, 0.0])
    item = out.logprobs[0]
    ref = torch.log_softmax(x[0], -1)
    assert math.isclose(item.logprob, ref.max().item(), rel_tol=1e-5)
    assert [t for t, _ in item.top] == ref.topk(3).indices.tolist()
    assert out.logprobs[1] is None


def test_a_choice_gives_its_tokens_before_they_are_read():
    """choose(): the tokens as a tensor (what the engine feeds the model) are the ones result()
    reads, with the same logprobs; penalties count each chosen token once."""
    x = logits(4, 5)
    params = [SamplingParams(top_p=0.8, logprobs=2), SamplingParams(temperature=0.0, presence_penalty=1.0),
              SamplingParams(top_k=3, frequency_penalty=0.5, logprobs=0), SamplingParams()]
    sampler = Sampler(4, V)
    chosen = sampler.choose(x, [0, 1, 2, 3], params, [0.3, 0.5, 0.7, 0.9])
    out = chosen.result()
    assert chosen.tokens.tolist() == out.tokens
    assert sampler.counts.sum(1).tolist() == [0.0, 1.0, 1.0, 0.0]
    assert sampler.counts[1, out.tokens[1]] == 1.0 and sampler.counts[2, out.tokens[2]] == 1.0
    again = Sampler(4, V).sample(x, [0, 1, 2, 3], params, [0.3, 0.5, 0.7, 0.9])
    assert again == out and out.logprobs[0].top and out.logprobs[2].top == () and out.logprobs[3] is None


@pytest.mark.parametrize("bad", [
    {"temperature": 3.0}, {"top_p": 0.0}, {"top_k": -1}, {"max_tokens": 0}, {"presence_penalty": 5.0},
    {"stop": ("",)}, {"logprobs": 21}, {"logit_bias": {V: 1.0}}, {"logit_bias": {1: 500.0}},
    {"stop_token_ids": (V,)}, {"penalty_decay": 0.0}, {"min_p": -0.1}, {"min_p": 1.5},
])
def test_validation_names_the_bad_field(bad):
    with pytest.raises(InvalidRequest):
        SamplingParams(**bad).validate(V)


def sorted_cutoffs(x: torch.Tensor, k: list[int], top_p: list[float]) -> torch.Tensor:
    """The reference: sort each row, walk down the distinct values in float64 (k >= V, p = 1 are off)."""
    cuts = []
    for row, kk, p in zip(x.double(), k, top_p, strict=True):
        values = row.sort(descending=True).values
        probs = torch.softmax(values, 0)
        top_k_mass = probs[:kk].sum()
        distinct, counts = torch.unique_consecutive(values, return_counts=True)
        better = torch.cat([counts.new_zeros(1), counts.cumsum(0)[:-1]])  # tokens strictly better
        better_mass = (probs.cumsum(0) - probs)[better]
        kept = (better < kk) & ((p >= 1.0) | (better_mass < p * top_k_mass))
        cuts.append(distinct[kept][-1])
    return torch.stack(cuts)[:, None].float()


def radix_cutoffs(x: torch.Tensor, k: list[int], top_p: list[float]) -> torch.Tensor:
    """Every row through the radix selection, none decided in the window."""
    from replicas.sampling import _masses, _radix_cutoffs

    k_t, p_t = torch.tensor(k)[:, None], torch.tensor(top_p, dtype=torch.float64)[:, None]
    mass = _masses(x, x.amax(-1, keepdim=True))
    return _radix_cutoffs(x, mass, k_t, p_t, mass.sum(-1, keepdim=True), counted=True)


def window_cutoffs(x: torch.Tensor, k: list[int], top_p: list[float]) -> torch.Tensor:
    """The sampler's own way: rows decided in their best tokens, the rest by radix selection."""
    from replicas.sampling import _cutoffs, _masses

    return _cutoffs(x, _masses(x, x.amax(-1, keepdim=True)), k, top_p)


def assert_cutoffs_match(x: torch.Tensor, k: list[int], top_p: list[float], cutoffs=None) -> int:
    """The cut-offs keep exactly the reference's tokens, but where a row's nucleus boundary is
    within float rounding of top_p; returns how many rows were that close."""
    kept = (x >= (cutoffs or window_cutoffs)(x, k, top_p)).sum(-1)
    strict = (x >= sorted_cutoffs(x, k, [p * (1 - 1e-6) if p < 1.0 else p for p in top_p])).sum(-1)
    loose = (x >= sorted_cutoffs(x, k, [min(p * (1 + 1e-6), 1.0) for p in top_p])).sum(-1)
    assert ((strict <= kept) & (kept <= loose)).all(), (kept, strict, loose)  # kept sets are nested
    return int((strict != loose).sum())


@pytest.mark.parametrize("vocab", [7, 50, 2000, 65536])
@pytest.mark.parametrize("shape", ["flat", "peaked", "ties"])
def test_cutoffs_equal_a_full_sort(vocab, shape):
    """Flat rows go to the radix selection, peaked ones stay in the window; k and top_p mixed."""
    gen = torch.Generator().manual_seed(vocab)
    rows = 24 if vocab < 65536 else 8
    ks = [0, 1, 2, 5, 40, 300, 1500, vocab - 1, vocab, vocab + 3, 0, 0]
    ps = [1.0, 0.9, 0.5, 1e-6, 0.999, 0.2, 0.95, 0.7, 1.0, 0.9]
    ambiguous = 0
    for trial in range(3):
        x = torch.randn(rows, vocab, generator=gen)
        if shape == "peaked":
            x *= 20
        elif shape == "ties":
            x = (x * 2).round()
        k = [ks[(trial + i) % len(ks)] for i in range(rows)]
        k = [kk if 0 < kk < vocab else vocab for kk in k]
        if trial == 2:  # every k small: the window finds the k-th token, nothing is counted
            k = [min(kk, 300) for kk in k]
        p = [ps[(2 * trial + i) % len(ps)] for i in range(rows)]
        ambiguous += assert_cutoffs_match(x, k, p)
        ambiguous += assert_cutoffs_match(x, k, p, radix_cutoffs)
    assert ambiguous <= 4


def test_cutoffs_on_awkward_values():
    """Zeros of both signs, -inf logits, one-value rows, and logits far from zero, both ways."""
    x = torch.tensor([[0.0, -0.0, -0.0, 0.0, -1e-30, 1e-30],
                      [float("-inf"), 3.0, float("-inf"), 3.0, 3.0, 1.0],
                      [5.0] * 6,
                      [1e30, -1e30, 2e30, 7.0, -3e38, 3e38]])
    for k, p in (([6] * 4, [0.9] * 4), ([2] * 4, [1.0] * 4), ([1, 3, 5, 6], [0.3, 0.6, 0.99, 1e-3])):
        assert assert_cutoffs_match(x, k, p) == 0
        assert assert_cutoffs_match(x, k, p, radix_cutoffs) == 0


def test_the_window_and_the_radix_selection_agree():
    """A row is decided in its best tokens or by radix selection, by what its batch-mates ask
    for: both ways must keep the same tokens."""
    gen = torch.Generator().manual_seed(7)
    vocab = 3000
    x = torch.randn(32, vocab, generator=gen) * torch.tensor([0.5, 3, 10, 30] * 8)[:, None]
    x[::3] = x[::3].round()
    k = [[vocab, 1, 7, 200, 1000][i % 5] for i in range(32)]
    p = [[0.9, 0.5, 1.0, 0.05, 0.99, 0.3, 0.999][i % 7] for i in range(32)]
    assert torch.equal(x >= window_cutoffs(x, k, p), x >= radix_cutoffs(x, k, p))


def test_before_wait_runs_once_a_call_whatever_the_rows_ask():
    x, s, calls = logits(3), Sampler(4, V), []
    for params in (SamplingParams(temperature=0.0), SamplingParams(top_p=0.5, presence_penalty=0.5)):
        out = s.sample(x, [0, 1, 2], [params] * 3, [0.5] * 3, before_wait=lambda: calls.append(1))
        assert len(out.tokens) == 3
    assert calls == [1, 1]
