"""Logits -> tokens, for a whole batch at once, on the logits' device.

Owns the sampling parameters of a request, their validation, and the per-slot penalty counts
(RWKV style: every step all counts decay, then the chosen token's count grows by one). Never
touches the model or the text.

Randomness comes from the caller as one uniform number per row (drawn from the request's own
seeded generator), and a token is chosen by inverting the filtered distribution's CDF at it: a
row's choice depends on its logits and its number alone, so a seeded request gives the same
tokens whatever else shares the batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

MAX_LOGPROBS = 20
MAX_STOPS = 16


class InvalidRequest(ValueError):
    """A request the engine refuses before it runs; the message is for the client (HTTP 400)."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0  # 0 is greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 is off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_decay: float = 0.996  # counts are multiplied by this every step
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; n: the chosen token's logprob and the top n others

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def validate(self, vocab_size: int) -> None:
        """Raises InvalidRequest naming the first bad field."""
        checks = [
            (self.max_tokens >= 1, "max_tokens must be at least 1"),
            (0.0 <= self.temperature <= 2.0, "temperature must be between 0 and 2"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (self.top_k >= 0, "top_k must be 0 (off) or positive"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be between -2 and 2"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be between -2 and 2"),
            (0.0 < self.penalty_decay <= 1.0, "penalty_decay must be in (0, 1]"),
            (len(self.stop) <= MAX_STOPS, f"at most {MAX_STOPS} stop strings"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty"),
            (all(0 <= t < vocab_size for t in self.stop_token_ids), "stop_token_ids out of vocabulary"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             f"top_logprobs must be between 0 and {MAX_LOGPROBS}"),
            (all(0 <= int(t) < vocab_size for t in self.logit_bias), "logit_bias names a token out of vocabulary"),
            (all(-100.0 <= float(b) <= 100.0 for b in self.logit_bias.values()),
             "logit_bias values must be between -100 and 100"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequest(message)


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # the most likely tokens, best first


@dataclass
class SampleOutput:
    tokens: list[int]
    logprobs: list[TokenLogprob | None]


class Sampler:
    """Batched sampling with per-slot penalty counts ([max_slots, V] on the logits' device)."""

    def __init__(self, max_slots: int, vocab_size: int, device: torch.device | str = "cpu"):
        self.vocab_size = vocab_size
        self.counts = torch.zeros(max_slots, vocab_size, device=device)  # decayed token counts

    def reset(self, slot: int) -> None:
        self.counts[slot].zero_()

    @torch.no_grad()
    def sample(
        self, logits: Tensor, slots: Sequence[int], params: Sequence[SamplingParams], uniforms: Sequence[float]
    ) -> SampleOutput:
        """logits [B, V] -> one token per row; updates the penalty counts of the rows' slots."""
        x = logits.float().clone()
        self._apply_bias(x, params)
        self._apply_penalties(x, slots, params)
        tokens = x.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            index = torch.tensor(random_rows, device=x.device)
            chosen = _sample_rows(x[index], [params[i] for i in random_rows], [uniforms[i] for i in random_rows])
            tokens = tokens.index_put((index,), chosen)
        token_list = tokens.tolist()  # the one host synchronisation of a step
        self._record(slots, token_list, params)
        return SampleOutput(token_list, _logprobs(x, token_list, params))

    def _apply_bias(self, x: Tensor, params: Sequence[SamplingParams]) -> None:
        for i, p in enumerate(params):
            if p.logit_bias:
                ids = torch.tensor([int(t) for t in p.logit_bias], device=x.device)
                x[i].index_add_(0, ids, torch.tensor([float(b) for b in p.logit_bias.values()], device=x.device))

    def _apply_penalties(self, x: Tensor, slots: Sequence[int], params: Sequence[SamplingParams]) -> None:
        rows = [i for i, p in enumerate(params) if p.penalized]
        if not rows:
            return
        index = torch.tensor(rows, device=x.device)
        counts = self.counts[torch.tensor([slots[i] for i in rows], device=x.device)]
        presence = torch.tensor([params[i].presence_penalty for i in rows], device=x.device)[:, None]
        frequency = torch.tensor([params[i].frequency_penalty for i in rows], device=x.device)[:, None]
        x[index] -= presence * (counts > 0) + frequency * counts

    def _record(self, slots: Sequence[int], tokens: Sequence[int], params: Sequence[SamplingParams]) -> None:
        for slot, token, p in zip(slots, tokens, params, strict=True):
            if p.penalized:
                self.counts[slot] *= p.penalty_decay
                self.counts[slot, token] += 1.0


def _sample_rows(x: Tensor, params: Sequence[SamplingParams], uniforms: Sequence[float]) -> Tensor:
    """Temperature, top-k, top-p, then the inverse CDF at each row's uniform number.

    Truncation only finds each row's smallest kept logit; the CDF is always taken in vocabulary
    order, so a row's token never depends on what its batch-mates asked for.
    """
    B, V = x.shape
    device = x.device
    x = x / torch.tensor([p.temperature for p in params], device=device)[:, None]
    k = [p.top_k if 0 < p.top_k < V else V for p in params]
    if any(kk < V for kk in k) or any(p.top_p < 1.0 for p in params):
        x = x.masked_fill(x < _cutoffs(x, k, [p.top_p for p in params]), float("-inf"))
    cdf = torch.softmax(x, dim=-1).cumsum_(-1)
    total = cdf[:, -1:]
    # strictly below the total, so the first index whose CDF exceeds it exists and has mass
    target = torch.minimum(torch.tensor(uniforms, device=device, dtype=cdf.dtype)[:, None] * total,
                           torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True)[:, 0]


def _cutoffs(x: Tensor, k: list[int], top_p: list[float], window: int = 256) -> Tensor:
    """Each row's smallest kept logit under top-k, then top-p (the best token always stays).

    Looks at the best `window` tokens first (a full sort of a 65k vocabulary per row costs more
    than the model step on a CPU); a row whose nucleus is not decided inside the window is
    decided again over the whole vocabulary.
    """
    B, V = x.shape
    cut = torch.empty(B, 1, device=x.device, dtype=x.dtype)
    k_t = torch.tensor(k, device=x.device)[:, None]
    p_t = torch.tensor(top_p, device=x.device, dtype=x.dtype)[:, None]
    log_z = torch.logsumexp(x, -1, keepdim=True)
    todo = torch.arange(B, device=x.device)
    for width in (min(window, V), V):
        values = torch.topk(x[todo], width, dim=-1).values  # best first
        rank = torch.arange(width, device=x.device)[None, :]
        values = values.masked_fill(rank >= k_t[todo], float("-inf"))
        # mass of the best k tokens, renormalised: exact once the window covers them (k <= width)
        top_k_mass = torch.exp(torch.logsumexp(values, -1, keepdim=True) - log_z[todo])
        probs = torch.exp(values - log_z[todo]) / torch.where(k_t[todo] <= width, top_k_mass, 1.0)
        mass = probs.cumsum(-1)
        kept = ((mass - probs) < p_t[todo]) & (values > float("-inf"))
        cut[todo] = values.gather(1, (kept.sum(-1, keepdim=True) - 1).clamp_(min=0))
        whole_vocab = k_t[todo, 0] == V  # without top-k the window's mass is already final
        decided = (k_t[todo, 0] <= width) | (whole_vocab & (mass[:, -1] >= p_t[todo, 0])) | (width == V)
        todo = todo[~decided]
        if todo.numel() == 0:
            break
    return cut


def _logprobs(x: Tensor, tokens: Sequence[int], params: Sequence[SamplingParams]) -> list[TokenLogprob | None]:
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    out: list[TokenLogprob | None] = [None] * len(params)
    if not rows:
        return out
    logp = torch.log_softmax(x[torch.tensor(rows, device=x.device)], dim=-1)
    width = max(params[i].logprobs or 0 for i in rows)
    top_v, top_i = torch.topk(logp, width, dim=-1) if width else (None, None)
    chosen = logp.gather(1, torch.tensor([tokens[i] for i in rows], device=x.device)[:, None])[:, 0].tolist()
    for j, i in enumerate(rows):
        n = params[i].logprobs or 0
        top = tuple(zip(top_i[j, :n].tolist(), top_v[j, :n].tolist(), strict=True)) if n else ()
        out[i] = TokenLogprob(tokens[i], chosen[j], top)
    return out
