"""Logits -> tokens, for a whole batch at once, on the logits' device.

Owns the sampling parameters of a request, their validation, and the per-slot penalty counts
(RWKV style: every step all counts decay, then the chosen token's count grows by one). Never
touches the model or the text.

Randomness comes from the caller as one uniform number per row (drawn from the request's own
seeded generator), and a token is chosen by inverting the filtered distribution's CDF at it: a
row's choice depends on its logits and its number alone, so a seeded request gives the same
tokens whatever else shares the batch.

Probabilities are integers: a token weighs exp(its logit - the row's best) · 2**30, rounded. Every
sum over a row is then exact in any order, so the truncations and the CDF come out the same on
the CPU, in torch on a GPU, and in the one-launch kernel (`sampling_kernel.py`) that a CUDA
device runs instead of the torch lines here (they stay as its reference, and as the CPU path).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .json_grammar import unpack
from .json_regex import RegexError, anchored, compile_pattern
from .json_schema import schema_error

MAX_LOGPROBS = 20
MAX_STOPS = 16
MAX_JSON_TEXTS = 8  # JSON texts one reply may hold (parallel tool calls)


class InvalidRequest(ValueError):
    """A request the engine refuses before it runs; the message is for the client (HTTP 400), and
    `param` the request's field it names, where one does."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0  # 0 is greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 is off
    min_p: float = 0.0  # keep tokens at least this likely relative to the best (after temperature); 0 is off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_decay: float = 0.996  # counts are multiplied by this every step
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; n: the chosen token's logprob and the top n others
    prompt_logprobs: int | None = None  # None: off; n: each prompt token's logprob and the top n
    json_object: bool = False  # JSON mode: the output is one JSON object (json_grammar.py)
    json_schema: str | None = None  # JSON mode with a schema (its JSON text): an object it describes
    json_or_text: bool = False  # JSON mode only if the output opens with "{", else text (a tool call, "auto")
    json_texts: int = 1  # JSON mode: up to this many texts, a line each, a blank line ending fewer (parallel calls)
    text_pattern: str | None = None  # the output is a text this pattern matches whole (json_regex.py's dialect)

    @property
    def json_mode(self) -> bool:
        return self.json_object or self.json_schema is not None

    @property
    def constrained(self) -> bool:
        """JSON mode, or a pattern: a constraint bans the tokens that cannot go on (json_grammar.py)."""
        return self.json_mode or self.text_pattern is not None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def validate(self, vocab_size: int) -> None:
        """Raises InvalidRequest naming the first bad field (its `param`: the field as a request names it)."""
        checks = [
            (self.max_tokens >= (0 if self.prompt_logprobs is not None else 1), "max_tokens",
             "max_tokens must be at least 1 (0 only with the prompt's logprobs)"),
            (0.0 <= self.temperature <= 2.0, "temperature", "temperature must be between 0 and 2"),
            (0.0 < self.top_p <= 1.0, "top_p", "top_p must be in (0, 1]"),
            (self.top_k >= 0, "top_k", "top_k must be 0 (off) or positive"),
            (0.0 <= self.min_p <= 1.0, "min_p", "min_p must be between 0 and 1"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "presence_penalty must be between -2 and 2"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "frequency_penalty must be between -2 and 2"),
            (0.0 < self.penalty_decay <= 1.0, "penalty_decay", "penalty_decay must be in (0, 1]"),
            (len(self.stop) <= MAX_STOPS, "stop", f"at most {MAX_STOPS} stop strings"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "stop strings must be non-empty"),
            (all(0 <= t < vocab_size for t in self.stop_token_ids), "stop_token_ids",
             "stop_token_ids out of vocabulary"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "top_logprobs",
             f"top_logprobs must be between 0 and {MAX_LOGPROBS}"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS, "prompt_logprobs",
             f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}"),
            (all(0 <= int(t) < vocab_size for t in self.logit_bias), "logit_bias",
             "logit_bias names a token out of vocabulary"),
            (all(-100.0 <= float(b) <= 100.0 for b in self.logit_bias.values()), "logit_bias",
             "logit_bias values must be between -100 and 100"),
            (1 <= self.json_texts <= MAX_JSON_TEXTS, "json_texts",
             f"json_texts must be between 1 and {MAX_JSON_TEXTS}"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidRequest(message, param)
        if self.json_schema is not None and (error := schema_error(self.json_schema)):
            raise InvalidRequest(f"json_schema: {error}", "response_format")
        if self.text_pattern is not None:
            if self.json_mode:
                raise InvalidRequest("a pattern and JSON mode cannot be asked together", "structured_outputs")
            try:
                compile_pattern(anchored(self.text_pattern))
            except RegexError as err:
                raise InvalidRequest(f"structured_outputs: {err}", "structured_outputs") from None


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float | None  # None: a prompt's first token (nothing before it to score it by)
    top: tuple[tuple[int, float], ...] = ()  # the most likely tokens, best first


@dataclass
class SampleOutput:
    tokens: list[int]
    logprobs: list[TokenLogprob | None]


class Chosen:
    """A batch's tokens as the device chooses them: `tokens` (int64 [B], on the logits' device)
    can feed the model at once; result() gives them, with the logprobs asked for, on the host.
    Everything result() reads is copied out as it is queued (to pinned memory on a GPU), so it
    waits for the choice and not for what the device runs after it."""

    def __init__(self, tokens: Tensor, params: Sequence[SamplingParams], x: Tensor):
        self.tokens = tokens
        self._params = params
        self._rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        parts = [tokens]
        if self._rows:  # x: the rows' logits with the biases and penalties applied
            index = upload(self._rows, x.device)
            logp = torch.log_softmax(x[index], dim=-1)
            parts.append(logp.gather(1, tokens[index][:, None])[:, 0])
            width = max(params[i].logprobs or 0 for i in self._rows)
            if width:
                parts.extend(torch.topk(logp, width, dim=-1))
        self._ready = None
        if tokens.is_cuda:
            parts = [part.to("cpu", non_blocking=True) for part in parts]  # (pinned by torch for the copy)
            self._ready = torch.cuda.Event()
            self._ready.record()
        self._host = parts

    def result(self) -> SampleOutput:
        if self._ready is not None:
            self._ready.synchronize()
        tokens = self._host[0].tolist()
        logprobs: list[TokenLogprob | None] = [None] * len(tokens)
        if self._rows:
            chosen = self._host[1].tolist()
            top_v, top_i = (self._host[2].tolist(), self._host[3].tolist()) if len(self._host) > 2 else ([], [])
            for j, i in enumerate(self._rows):
                n = self._params[i].logprobs or 0
                # (a JSON row may allow fewer than n tokens: its banned ones, at -inf, are left out)
                top = tuple((t, v) for t, v in zip(top_i[j][:n], top_v[j][:n], strict=True)
                            if v != -math.inf) if n else ()
                logprobs[i] = TokenLogprob(tokens[i], chosen[j], top)
        return SampleOutput(tokens, logprobs)


class Sampler:
    """Batched sampling with per-slot penalty counts ([max_slots, V] on the logits' device).

    kernel: choose through sampling_kernel's one launch (None: wherever the device is CUDA), or
    through the torch lines below (its reference; the CPU's path).
    """

    def __init__(self, max_slots: int, vocab_size: int, device: torch.device | str = "cpu",
                 kernel: bool | None = None):
        self.vocab_size = vocab_size
        self.counts = torch.zeros(max_slots, vocab_size, device=device)  # decayed token counts
        self.kernel = torch.device(device).type == "cuda" if kernel is None else kernel
        self._slot_params = None  # sampling_kernel.SlotParams, made at the kernel's first call

    def reset(self, slot: int) -> None:
        self.counts[slot].zero_()

    def warm_up(self) -> None:
        """Compiles the sampling kernel's variants before any request (about a second each on the
        H200 machine): Triton specialises it on a batch of one row, of a multiple of 16 rows, or
        of others. The slots it borrows are reset."""
        if not self.kernel:
            return
        slots = self.counts.shape[0]
        for rows in (n for n in (1, 3, 16) if n <= slots):
            logits = torch.zeros(rows, self.vocab_size, device=self.counts.device)
            for params in (SamplingParams(temperature=0.0), SamplingParams(top_p=0.9)):
                self.sample(logits, list(range(rows)), [params] * rows, [0.5] * rows)
        for slot in range(min(16, slots)):
            self.reset(slot)

    def sample(
        self, logits: Tensor, slots: Sequence[int], params: Sequence[SamplingParams], uniforms: Sequence[float],
        before_wait: Callable[[], None] = lambda: None,
    ) -> SampleOutput:
        """logits [B, V] -> one token per row; updates the penalty counts of the rows' slots.
        before_wait runs once the choice is queued, before the host waits for the device to make it."""
        chosen = self.choose(logits, slots, params, uniforms)
        before_wait()
        return chosen.result()

    @torch.no_grad()
    def choose(self, logits: Tensor, slots: Sequence[int], params: Sequence[SamplingParams],
               uniforms: Sequence[float], banned: Sequence[Tensor | None] | None = None) -> Chosen:
        """sample's choice, queued on the logits' device: its tokens can feed the model before the
        host has read them (Chosen.result waits for them, and for nothing queued after them).
        banned: per row, None or the tokens the row may not take (JSON mode), as
        json_grammar.Constraint.banned's bits on the device; a row must be allowed one token."""
        x = logits.to(torch.float32, copy=True)  # changed in place below; one copy, whatever the dtype
        self._apply_bias(x, params)
        self._apply_banned(x, banned)
        if self.kernel:  # penalties, choice and counts in one launch; x gets the penalties too
            from .sampling_kernel import SlotParams, sample  # noqa: PLC0415 (Triton: only where a GPU is)

            if self._slot_params is None:
                self._slot_params = SlotParams(self.counts.shape[0], self.vocab_size, self.counts.device)
            self._slot_params.update(slots, params)
            tokens = sample(x, self.counts, self._slot_params.table, slots, params, uniforms)
            return Chosen(tokens, params, x)
        self._apply_penalties(x, slots, params)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if len(random_rows) == len(params):  # no greedy row: no argmax, no copy of the random rows
            tokens = _sample_rows(x, params, uniforms)
        else:
            tokens = x.argmax(dim=-1)
            if random_rows:
                index = upload(random_rows, x.device)
                chosen = _sample_rows(x[index], [params[i] for i in random_rows], [uniforms[i] for i in random_rows])
                tokens = tokens.index_put((index,), chosen)
        self._record(slots, tokens, params)
        return Chosen(tokens, params, x)

    def _apply_bias(self, x: Tensor, params: Sequence[SamplingParams]) -> None:
        for i, p in enumerate(params):
            if p.logit_bias:
                ids = upload([int(t) for t in p.logit_bias], x.device)
                x[i].index_add_(0, ids, upload([float(b) for b in p.logit_bias.values()], x.device))

    @staticmethod
    def _apply_banned(x: Tensor, banned: Sequence[Tensor | None] | None) -> None:
        rows = [i for i, bits in enumerate(banned or ()) if bits is not None]
        if rows:  # (a few launches however many rows: 256 JSON rows are not 256 fills)
            index = upload(rows, x.device)
            masks = unpack(torch.stack([banned[i] for i in rows]), x.shape[1])
            x[index] = x[index].masked_fill(masks, float("-inf"))

    def _apply_penalties(self, x: Tensor, slots: Sequence[int], params: Sequence[SamplingParams]) -> None:
        rows = [i for i, p in enumerate(params) if p.penalized]
        if not rows:
            return
        index = upload(rows, x.device)
        counts = self.counts[upload([slots[i] for i in rows], x.device)]
        presence = upload([params[i].presence_penalty for i in rows], x.device)[:, None]
        frequency = upload([params[i].frequency_penalty for i in rows], x.device)[:, None]
        x[index] -= presence * (counts > 0) + frequency * counts

    def _record(self, slots: Sequence[int], tokens: Tensor, params: Sequence[SamplingParams]) -> None:
        rows = [i for i, p in enumerate(params) if p.penalized]
        if not rows:
            return
        device = self.counts.device
        index = upload([slots[i] for i in rows], device)  # a slot holds one row: no index repeats
        self.counts[index] *= upload([params[i].penalty_decay for i in rows], device)[:, None]
        self.counts[index, tokens[upload(rows, tokens.device)]] += 1.0


def upload(values, device: torch.device, dtype: torch.dtype | None = None) -> Tensor:
    """A list as a tensor on device, queued behind the device's work instead of waiting for it: a
    copy from pageable host memory waits until everything queued before it has run (the decode
    step, the sampler's earlier kernels), one from pinned memory does not."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _sample_rows(x: Tensor, params: Sequence[SamplingParams], uniforms: Sequence[float]) -> Tensor:
    """Temperature, min-p, top-k, top-p (over what min-p kept, as vLLM orders them), then the
    inverse CDF at each row's uniform number. Min-p drops the tokens whose integer mass is under
    min_mass(min_p), so it needs no cut-off of its own.

    Truncation only finds each row's smallest kept logit; the CDF is always taken in vocabulary
    order, over the kept tokens' integer masses, so a row's token never depends on what its
    batch-mates asked for, nor on the order in which a device adds.
    """
    B, V = x.shape
    device = x.device
    x = x / upload([p.temperature for p in params], device)[:, None]
    mass = _masses(x, x.amax(-1, keepdim=True))
    if any(p.min_p > 0.0 for p in params):
        mass.masked_fill_(mass < upload([min_mass(p.min_p) for p in params], device)[:, None], 0)
    k = [p.top_k if 0 < p.top_k < V else V for p in params]
    if any(kk < V for kk in k) or any(p.top_p < 1.0 for p in params):
        mass.masked_fill_(x < _cutoffs(x, mass, k, [p.top_p for p in params]), 0)
    cdf = mass.cumsum_(-1)  # int64: exact
    # u · total < total, so the first index whose CDF exceeds the target exists and has mass
    target = (upload(uniforms, device, torch.float64)[:, None] * cdf[:, -1:]).floor_().long()
    return torch.searchsorted(cdf, target, right=True)[:, 0]


# Top-k / top-p cut-offs never sort the vocabulary: a peaked row's nucleus is decided among its
# best few hundred tokens, and the rows whose nucleus reaches past them (a flat distribution: a
# random model, a high temperature) are decided by radix selection over the logits' bit patterns,
# a fixed number of passes over [B, V]. A full sort of a 65k vocabulary cost more than the model
# step. Both ways use the same integer masses, so a row's cut never depends on its batch-mates.
# Few, large tensor operations: on a GPU each one costs a launch, and small batches are bound by them.
_WINDOW = 256  # the best tokens looked at first
_TOPK_MAX = 1024  # a top-k up to this is read from the window, widened to it; a larger one is counted
MASS_SCALE = 2.0**30  # probability -> integer mass, relative to the row's best token (which weighs
# 2**30, so a mass fits in int32): sums (int64) are exact and order-free; 2**16 tokens sum below
# 2**53, exact in float64 too. A token lighter than 2**-31 of the best weighs 0 (never drawn).
_DIGITS = ((21, 11), (10, 11), (0, 10))  # (shift, bits): three small histograms settle 32 bits
_LOWEST = -2139095040  # _order_keys(-inf): a cut that keeps every token


def _cutoffs(x: Tensor, mass: Tensor, k: list[int], top_p: list[float]) -> Tensor:
    """Each row's cut: the row keeps its tokens >= the cut (top-k, then top-p). float32 x [B, V],
    its int64 masses (_masses).

    A token is kept when fewer than k tokens are strictly better, and when the mass of the tokens
    strictly better, renormalised over the best k, is below top_p (top_p = 1: no limit): tied
    tokens stay or go together, and the best token always stays. Masses are integers (the best
    token weighs 2**30), so a cut can differ from exact arithmetic only for a row whose nucleus
    boundary lies within ~1e-6 of top_p.
    Synchronises with the device once, to see whether any row needs the radix selection.
    """
    B, V = x.shape
    width = min(V, max([_WINDOW] + [kk for kk in k if kk <= _TOPK_MAX]))
    window = _WindowRows(k, top_p, width, V, x.device)
    total = mass.sum(-1, keepdim=True)
    values, index = torch.topk(x, width, dim=-1)  # best first; the order of a tie does not matter
    cut, decided = window.cutoffs(values, mass.gather(1, index), total)
    undecided = int((~decided).sum())  # the one host synchronisation
    if undecided:
        rows = slice(None) if undecided == B else (~decided[:, 0]).nonzero()[:, 0]
        counted = any(width < kk < V for kk in k)  # those rows are never decided in the window
        cut[rows] = _radix_cutoffs(x[rows], mass[rows], window.k[rows], window.p[rows], total[rows], counted)
    return cut


def min_mass(min_p: float) -> int:
    """The least integer mass min-p keeps (the best token weighs MASS_SCALE, so it always stays)."""
    return math.ceil(min_p * MASS_SCALE)


def _masses(x: Tensor, top: Tensor) -> Tensor:
    """Logits -> int64 masses, exp(x - top) · 2**30 rounded (top: the row's best logit).
    Elementwise, so the window, the radix selection and the CDF agree on a token's."""
    # below e**-80 a mass rounds to 0 anyway, and a CPU's exp is slow there
    return (x - top).clamp_(min=-80.0).exp_().mul_(MASS_SCALE).add_(0.5).floor_().long()


class _WindowRows:
    """What the window needs to know of each row, on the device (uploaded as upload says)."""

    def __init__(self, k: list[int], top_p: list[float], W: int, V: int, device: torch.device):
        everything = [kk >= V and p >= 1.0 for kk, p in zip(k, top_p, strict=True)]
        # a row is decided when fewer than `limit` of its window's tokens are kept
        limit = [W + 1 if kk <= W or every else W if kk >= V else 0 for kk, every in zip(k, everything, strict=True)]
        ints = upload([[kk, min(kk, W), lim] for kk, lim in zip(k, limit, strict=True)], device)
        self.k, self.k_w, self.limit = ints[:, :1], ints[:, 1:2], ints[:, 2:]
        p_w = [p if p < 1.0 else 2.0 for p in top_p]  # 2: the whole top k
        floats = upload(list(zip(top_p, p_w, strict=True)), device, torch.float64)
        self.p, self.p_w = floats[:, :1], floats[:, 1:]
        flags = upload([[kk <= W, every] for kk, every in zip(k, everything, strict=True)], device)
        self.in_window, self.everything = flags[:, :1], flags[:, 1:]

    def cutoffs(self, values: Tensor, mass: Tensor, total: Tensor) -> tuple[Tensor, Tensor]:
        """Cuts from each row's best tokens (values [B, W] best first, their masses [B, W]; the rows'
        whole masses [B, 1]), and which rows they decide: those whose top-k lies in the window, and
        those whose nucleus ends in it."""
        at_or_above = mass.cumsum(-1)  # the mass of each token and the better ones
        top_k_mass = torch.where(self.in_window, at_or_above.gather(1, self.k_w - 1), total)
        target = torch.ceil(self.p_w * top_k_mass)
        # a token is kept when the mass ahead of it (strictly better, for the first of a tie) < target
        kept = torch.minimum(((at_or_above - mass) < target).sum(-1, keepdim=True), self.k_w)
        cut = values.gather(1, kept - 1).masked_fill_(self.everything, -torch.inf)
        return cut, kept < self.limit


def _radix_cutoffs(x: Tensor, mass: Tensor, k: Tensor, p: Tensor, total: Tensor, counted: bool) -> Tensor:
    """The cuts of _cutoffs, for any rows, by radix selection (`counted`: some k must be counted)."""
    V = x.shape[1]
    key = _order_keys(x)
    if not counted:  # then the rows the window left have no top-k and a top_p < 1
        return _key_values(_select(key, mass, torch.ceil(p * total).long()))
    limited = k < V
    kth = torch.where(limited, _select(key, None, k.long()), _LOWEST)
    # the best k: every token from the k-th up, less the copies of the k-th (the lightest) past k
    kept = key >= kth
    kept_mass = torch.where(kept, mass, 0).sum(-1, keepdim=True)
    at_kth = torch.where(kept, mass, torch.iinfo(torch.int64).max).amin(-1, keepdim=True)
    top_k_mass = torch.where(limited, kept_mass - (kept.sum(-1, keepdim=True) - k) * at_kth, total)
    nucleus = _select(key, mass, torch.ceil(p * top_k_mass).long())
    return _key_values(torch.where(p < 1.0, torch.maximum(kth, nucleus), kth))


def _select(key: Tensor, weight: Tensor | None, target: Tensor) -> Tensor:
    """Per row, the smallest key a (any int32, token or not) such that the tokens above a weigh less
    than target (int64 [B, 1], at least 1): the row's tokens with key >= a are exactly those whose
    better tokens weigh < target. weight: int64 [B, V], or None to count tokens. Returns int64 [B, 1].

    The weight above a only shrinks as a grows, so a is found a digit at a time, high bits first:
    each round histograms the tokens that share a's bits so far, by their next digit.
    """
    above, prefix, high_before = 0, None, None  # weight above a's bucket; a's bits so far; every token's
    for shift, bits in _DIGITS:
        high = key >> shift if shift else key
        if prefix is None:
            digit = high + (1 << (31 - shift))  # the sign bit flipped: digits in key order
            w = torch.ones_like(key, dtype=torch.int64) if weight is None else weight
        else:  # the tokens outside the bucket weigh nothing now, and are spread over all digits
            digit, inside = high & ((1 << bits) - 1), high_before == prefix.int()
            w = inside.long() if weight is None else torch.where(inside, weight, 0)
        d, above = _lightest_digit(digit, w, bits, above, target)
        prefix = d - (1 << (31 - shift)) if prefix is None else (prefix << bits) + d
        high_before = high
    return prefix


def _lightest_digit(digit: Tensor, weight: Tensor, bits: int, above: Tensor | int,
                    target: Tensor) -> tuple[Tensor, Tensor]:
    """The lowest digit whose heavier digits and `above` weigh < target, and that weight."""
    hist = torch.zeros(digit.shape[0], 1 << bits, device=digit.device, dtype=torch.int64)
    below = hist.scatter_add_(1, digit.long(), weight).cumsum_(-1)  # weight at or below each digit
    slack = above + below[:, -1:] - target  # weight above a digit >= target  <=>  below it <= slack
    d = (below <= slack).sum(-1, keepdim=True)  # that weight only shrinks: d is the lowest digit < target
    return d, slack + target - below.gather(1, d)


def _order_keys(x: Tensor) -> Tensor:
    """float32 -> int32 keys in the same order (sign-magnitude -> two's complement; -0 == +0)."""
    bits = x.contiguous().view(torch.int32)
    return torch.where(bits < 0, torch.iinfo(torch.int32).min - bits, bits)


def _key_values(key: Tensor) -> Tensor:
    """int64 keys from _order_keys -> the float32 values they stand for."""
    bits = torch.where(key < 0, torch.iinfo(torch.int32).min - key, key)
    return bits.to(torch.int32).view(torch.float32)
