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
    def of_call(chunks: Sequence[Sequence[int]], befores: Sequence[Tensor | None], logits: Tensor,
                ks: Sequence[int]) -> list[PromptScores]:
        """Each chunk's scores with ks[i] alternatives, from one call's logits after every token
        ([Σ len(chunk), V], row after row) and each row's logits before its chunk's first token
        (`befores`, [V] each; None at a prompt's start, whose first token nothing scores). The
        model's distribution as it is: no temperature, penalty or bias. One pass over the logits
        for all rows (a logsumexp, a gather and a top-k; no log-softmax written out), and one copy
        to the host."""
        before_each, scored = [], []
        for chunk, before, after in zip(chunks, befores, logits.split([len(c) for c in chunks]), strict=True):
            if before is not None:
                before_each.append(before[None].to(logits.dtype))
            before_each.append(after[:-1])
            scored += chunk if before is not None else chunk[1:]
        rows = torch.cat(before_each).float()
        lse = torch.logsumexp(rows, dim=-1, keepdim=True)
        chosen = rows.gather(1, torch.tensor(scored, dtype=torch.int64, device=rows.device)[:, None]) - lse
        k_max = max(ks)
        top, top_ids = rows.topk(k_max, dim=-1)
        # token ids are exact in fp32 (below 2**24): one tensor, one copy
        host = torch.cat([chosen, top - lse, top_ids.float()], dim=1).cpu()
        out, at = [], 0
        for chunk, before, k in zip(chunks, befores, ks, strict=True):
            n = len(chunk) - (before is None)
            part = host[at:at + n]
            at += n
            lp, top_lp, ids = part[:, 0], part[:, 1:1 + k], part[:, 1 + k_max:1 + k_max + k].to(torch.int64)
            if before is None:
                lp = torch.cat([lp.new_full((1,), math.nan), lp])
                top_lp = torch.cat([top_lp.new_full((1, k), math.nan), top_lp])
                ids = torch.cat([ids.new_full((1, k), -1), ids])
            out.append(PromptScores(lp.clone(), ids, top_lp.clone()))
        return out

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
