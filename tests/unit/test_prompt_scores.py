"""PromptScores.of_call against log_softmax, for a call whose rows start a prompt or go on from
logits before them, with different numbers of alternatives."""

import math

import torch

from replicas.prompt_scores import PromptScores


def test_one_calls_scores_are_each_rows_log_softmax():
    gen = torch.Generator().manual_seed(0)
    V = 50
    chunks = [[3, 7, 7, 1], [9], [4, 2, 8], [5]]
    befores = [None, torch.randn(V, generator=gen), torch.randn(V, generator=gen), None]
    ks = [2, 0, 5, 1]
    logits = torch.randn(sum(map(len, chunks)), V, generator=gen) * 4
    got = PromptScores.of_call(chunks, befores, logits, ks)

    for chunk, before, k, after, scores in zip(chunks, befores, ks, logits.split([len(c) for c in chunks]), got,
                                               strict=True):
        assert len(scores) == len(chunk) and scores.k == k
        rows = after[:-1] if before is None else torch.cat([before[None], after[:-1]])
        ref = torch.log_softmax(rows, dim=-1)
        tokens = chunk[1:] if before is None else chunk
        skip = int(before is None)
        if skip:  # a prompt's first token: nothing before it scores it
            assert math.isnan(scores.logprobs[0]) and scores.top_ids[0].tolist() == [-1] * k
        want = ref.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        assert torch.allclose(scores.logprobs[skip:], want, atol=1e-5)
        top_lp, top_ids = ref.topk(k, dim=-1)
        assert torch.equal(scores.top_ids[skip:], top_ids)
        assert torch.allclose(scores.top_logprobs[skip:], top_lp, atol=1e-5)
        assert scores.top_ids.dtype == torch.int64 and scores.logprobs.dtype == torch.float32
