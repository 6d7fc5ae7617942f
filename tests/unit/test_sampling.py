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


def test_a_row_does_not_depend_on_its_batch():
    x = logits(6, 3)
    s = Sampler(6, V)
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=20), SamplingParams(temperature=0.0),
              SamplingParams(top_k=5), SamplingParams(temperature=1.5), SamplingParams(top_p=0.5),
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


@pytest.mark.parametrize("bad", [
    {"temperature": 3.0}, {"top_p": 0.0}, {"top_k": -1}, {"max_tokens": 0}, {"presence_penalty": 5.0},
    {"stop": ("",)}, {"logprobs": 21}, {"logit_bias": {V: 1.0}}, {"logit_bias": {1: 500.0}},
    {"stop_token_ids": (V,)}, {"penalty_decay": 0.0},
])
def test_validation_names_the_bad_field(bad):
    with pytest.raises(InvalidRequest):
        SamplingParams(**bad).validate(V)


def test_the_windowed_nucleus_equals_a_full_sort():
    """Top-k/top-p cut-offs found in a window of the best tokens match a full sort's."""
    from replicas.sampling import _cutoffs

    V_big = 2000
    x = torch.randn(8, V_big, generator=torch.Generator().manual_seed(5)) * torch.tensor(
        [0.1, 0.5, 1, 2, 4, 8, 0.05, 3.0])[:, None]
    ks = [0, 10, 0, 300, 0, 1, 1500, 0]
    ps = [0.9, 0.5, 0.99, 0.95, 1.0, 0.3, 0.97, 0.2]
    k_eff = [k if 0 < k < V_big else V_big for k in ks]
    windowed = _cutoffs(x, k_eff, ps, window=16)
    full = _cutoffs(x, k_eff, ps, window=V_big)
    assert torch.equal(windowed, full)
