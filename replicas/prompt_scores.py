"""A prompt's scores: each token's logprob under the model and its likeliest alternatives (a
completion's `echo` with `logprobs`: lm-evaluation-harness's loglikelihoods).

Held as three small host tensors, so that the prefix cache keeps them beside a prefix's state
(state_cache.Snapshot.scores): a later prompt that scores the same prefix takes the state and its
tokens' scores together, and runs the model over its own tokens only. A token's score needs the
logits before it, which a state alone does not give back; without the scores beside it, a scored
prompt would have to prefill every token from its start.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .sampling import TokenLogprob


@dataclass(frozen=True)
class PromptScores:
    logprobs: Tensor  # [n] fp32: each token's, by the logits before it; NaN: a prompt's first token (none before it)
    top_ids: Tensor  # [n, k] int64: the k likeliest tokens at each position, best first
    top_logprobs: Tensor  # [n, k] fp32

    @staticmethod
    def of(chunk: Sequence[int], before: Tensor | None, logits: Tensor, k: int) -> PromptScores:
        """The chunk's scores, from the logits after each of its tokens ([len(chunk), V]) and the
        logits before its first token (`before`, [V]; None at a prompt's start). The model's
        distribution as it is: no temperature, penalty or bias."""
        rows = logits[:-1] if before is None else torch.cat([before[None].to(logits.dtype), logits[:-1]])
        logprobs = torch.log_softmax(rows.float(), dim=-1)
        scored = torch.tensor(chunk[len(chunk) - rows.shape[0]:], dtype=torch.int64, device=logprobs.device)
        chosen = logprobs.gather(1, scored[:, None])[:, 0]
        if k:
            top_lp, top_ids = logprobs.topk(k, dim=-1)
        else:
            top_lp, top_ids = logprobs[:, :0], scored[:, None][:, :0]
        if before is None:  # the first token: nothing scores it
            chosen = torch.cat([chosen.new_full((1,), math.nan), chosen])
            top_lp = torch.cat([top_lp.new_full((1, k), math.nan), top_lp])
            top_ids = torch.cat([top_ids.new_full((1, k), -1), top_ids])
        return PromptScores(chosen.cpu(), top_ids.cpu(), top_lp.cpu())

    @staticmethod
    def join(parts: Sequence[PromptScores]) -> PromptScores:
        if len(parts) == 1:
            return parts[0]
        return PromptScores(torch.cat([p.logprobs for p in parts]), torch.cat([p.top_ids for p in parts]),
                            torch.cat([p.top_logprobs for p in parts]))

    def __len__(self) -> int:
        return self.logprobs.shape[0]

    @property
    def k(self) -> int:
        return self.top_ids.shape[1]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.logprobs, self.top_ids, self.top_logprobs))

    def head(self, n: int, k: int) -> PromptScores:
        """A copy of the first n tokens' scores with k alternatives each (k at most self.k)."""
        return PromptScores(self.logprobs[:n].clone(), self.top_ids[:n, :k].clone(), self.top_logprobs[:n, :k].clone())

    def entries(self, tokens: Sequence[int]) -> tuple[TokenLogprob, ...]:
        """As the engine's events carry them: tokens are the prompt's, which these scores are of."""
        lps, ids, tops = self.logprobs.tolist(), self.top_ids.tolist(), self.top_logprobs.tolist()
        return tuple(
            TokenLogprob(token, None) if math.isnan(lp) else TokenLogprob(token, lp, tuple(zip(i, t, strict=True)))
            for token, lp, i, t in zip(tokens, lps, ids, tops, strict=True))
