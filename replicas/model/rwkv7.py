"""RWKV-7 ("Goose", x070) in torch: its parameters and its math, in the paper's symbols.

One forward pass serves training and serving alike. A batch is a set of rows, each with its own
number of tokens, packed flat along one token axis ([T, C], T = all rows' tokens, row-major);
`Rows` says where each row lies. Everything but the time-mix recurrence is per token (matrix
products over all T at once) or looks one token back (the token shift, which takes a row's first
"previous token" from its state). The recurrence runs through a `WkvFn` that the caller picks:
`wkv_reference` below (token by token, the definition), `wkv_chunked` (the same in chunks of
tokens, the CPU runner's) or a GPU kernel with the same contract.

Parameter names are BlinkDL's, so a checkpoint's state dict loads as it is once its [1, 1, C]
vectors are squeezed (see checkpoint.py).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import ModelConfig
from .state import RNNState

DECAY_SCALE = 0.606531  # exp(-0.5): w = exp(-DECAY_SCALE · sigmoid(·)) lies in (0.545, 1)


class Rows:
    """Where each row's tokens lie on the flat token axis (every row has at least one token)."""

    def __init__(self, lengths: Sequence[int], device: torch.device | str = "cpu"):
        if not lengths or min(lengths) < 1:
            raise ValueError(f"every row needs at least one token, got lengths {list(lengths)}")
        self.lengths = [int(n) for n in lengths]
        ends = torch.tensor(self.lengths, device=device).cumsum(0)
        self.starts = ends - torch.tensor(self.lengths, device=device)  # [B] first token of each row
        self.lasts = ends - 1  # [B] last token of each row
        self.total = int(sum(self.lengths))

    @property
    def count(self) -> int:
        return len(self.lengths)

    @property
    def uniform(self) -> bool:
        return len(set(self.lengths)) == 1


# wkv(S [B,H,N,N], r, w_log, k, v, a, b [T,H,N], rows) -> (out [T,H,N] fp32, S' [B,H,N,N] fp32)
# with, per head and token:  S <- S·diag(exp(w_log)) + (S·a) bᵀ + v kᵀ;  out = S·r
WkvFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Rows], tuple[Tensor, Tensor]]


def wkv_reference(
    state: Tensor, r: Tensor, w_log: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, rows: Rows
) -> tuple[Tensor, Tensor]:
    """The recurrence token by token, in fp32: the definition every faster path is tested against.

    Rows are visited longest first so that at step t the rows still running are a prefix of the
    batch. Out-of-place throughout, so autograd can train through it.
    """
    with torch.autocast(state.device.type, enabled=False):  # the state update stays fp32 under autocast
        return _wkv_reference_fp32(state, r, w_log, k, v, a, b, rows)


def _wkv_reference_fp32(state, r, w_log, k, v, a, b, rows: Rows) -> tuple[Tensor, Tensor]:
    r, w, k, v, a, b = (t.float() for t in (r, torch.exp(w_log.float()), k, v, a, b))
    if rows.uniform:  # decode and training: every row has T tokens, so [B*T] is a plain [B, T] view
        return _wkv_uniform(state.float(), r, w, k, v, a, b, rows.count)
    order = sorted(range(rows.count), key=lambda i: -rows.lengths[i])
    order_t = torch.tensor(order, device=state.device)
    starts = rows.starts.to(state.device)[order_t]
    lengths = [rows.lengths[i] for i in order]
    S = state.float()[order_t]  # [B, H, N, N]
    outs, where = [], []
    for t in range(lengths[0]):
        n = sum(1 for length in lengths if length > t)
        idx = starts[:n] + t
        r_t, w_t, k_t, v_t, a_t, b_t = (x[idx] for x in (r, w, k, v, a, b))  # [n, H, N]
        out, S_n = _wkv_step(S[:n], r_t, w_t, k_t, v_t, a_t, b_t)
        S = S_n if n == len(lengths) else torch.cat([S_n, S[n:]])
        outs.append(out)
        where.append(idx)
    out = torch.zeros_like(r).index_put((torch.cat(where),), torch.cat(outs))
    return out, S[torch.argsort(order_t)]


def _wkv_step(S: Tensor, r: Tensor, w: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """One token for every row: S [n,H,N,N]; r, w, k, v, a, b [n,H,N].

    S' = S·diag(w) + (S·a) bᵀ + v kᵀ and out = S'·r, arranged to pass over the state (at decode as
    much memory as the weights) as few times as possible: out is taken from the old state,
    out = S·(w⊙r) + (S·a)(b·r) + v (k·r), so one product gives both S·a and S·(w⊙r); the two
    rank-one terms are one rank-two product.
    """
    both = S @ torch.stack([a, w * r], dim=-1)  # [n, H, N, 2]
    sa, swr = both[..., 0], both[..., 1]
    out = swr + sa * (b * r).sum(-1, keepdim=True) + v * (k * r).sum(-1, keepdim=True)
    left = torch.stack([sa, v], dim=-1)  # [n, H, N, 2]
    right = torch.stack([b, k], dim=-2)  # [n, H, 2, N]
    S = S * w[:, :, None, :]  # a new tensor: adding into it in place is safe for autograd too
    S.view(-1, *S.shape[-2:]).baddbmm_(left.flatten(0, 1), right.flatten(0, 1))
    return out, S


def _wkv_uniform(S: Tensor, r, w, k, v, a, b, B: int) -> tuple[Tensor, Tensor]:
    T = r.shape[0] // B
    r, w, k, v, a, b = (x.view(B, T, *x.shape[1:]) for x in (r, w, k, v, a, b))
    outs = []
    for t in range(T):
        out, S = _wkv_step(S, r[:, t], w[:, t], k[:, t], v[:, t], a[:, t], b[:, t])
        outs.append(out)
    out = outs[0] if T == 1 else torch.stack(outs, dim=1)
    return out.reshape(B * T, *r.shape[2:]), S


CHUNK = 32  # tokens a chunk of wkv_chunked: the decay over a chunk stays within fp32 (>= e^-19.4)
CHUNKED_MIN_TOKENS = 16  # shorter calls (decode) loop over their few tokens


def wkv_chunked(
    state: Tensor, r: Tensor, w_log: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, rows: Rows
) -> tuple[Tensor, Tensor]:
    """wkv_reference's recurrence a chunk of tokens at a time (inference on the CPU's runner: a
    Python loop over 2,000 tokens took most of a long prompt's prefill). Rows of unequal lengths
    go one at a time; rows shorter than CHUNKED_MIN_TOKENS (decode) take wkv_reference.

    Within a chunk from state S0, with W_t the decay's running product (t inclusive), the inputs
    scaled to the chunk's start (ã_t = a_t·W_{t-1}, b̃_t = b_t/W_t, k̃_t = k_t/W_t, r̃_t = r_t·W_t)
    and u_t = S_{t-1} a_t:
        u_t = S0 ã_t + Σ_{s<t} u_s (b̃_s·ã_t) + v_s (k̃_s·ã_t)     (one unit-triangular solve)
        out_t = S0 r̃_t + Σ_{s<=t} u_s (b̃_s·r̃_t) + v_s (k̃_s·r̃_t)
        S_end = (S0 + Σ_s u_s b̃_sᵀ + v_s k̃_sᵀ) · diag(W_end)
    """
    if max(rows.lengths) < CHUNKED_MIN_TOKENS or w_log.min() < -DECAY_SCALE * (1 + 1e-6):
        return wkv_reference(state, r, w_log, k, v, a, b, rows)  # short, or decays no model makes
    if not rows.uniform:
        parts = [wkv_chunked(state[i:i + 1], *(x[start:start + n] for x in (r, w_log, k, v, a, b)), Rows([n]))
                 for i, (start, n) in enumerate(zip(rows.starts.tolist(), rows.lengths, strict=True))]
        return torch.cat([o for o, _ in parts]), torch.cat([s for _, s in parts])
    with torch.autocast(state.device.type, enabled=False):
        B, T = rows.count, rows.lengths[0]
        H, N = r.shape[1], r.shape[2]

        def heads_first(x: Tensor) -> Tensor:  # [B*T, H, N] -> [B, H, T, N]
            return x.float().view(B, T, H, N).transpose(1, 2)

        r, w_log, k, v, a, b = (heads_first(x) for x in (r, w_log, k, v, a, b))
        S = state.float()
        ones = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=S.device)
        not_before, after = ones.triu(), ones.triu(1)  # [t, s]: s >= t, s > t (the terms left out)
        outs = []
        for c0 in range(0, T, CHUNK):
            rc, wl, kc, vc, ac, bc = (x[:, :, c0:c0 + CHUNK] for x in (r, w_log, k, v, a, b))
            n = rc.shape[2]
            log_w = wl.cumsum(2)
            a_ = ac * (log_w - wl).exp()
            inv = (-log_w).exp()
            b_, k_, r_ = bc * inv, kc * inv, rc * log_w.exp()
            s0 = S.transpose(-1, -2)  # [B, H, N keys, N values]
            m_ab = (a_ @ b_.transpose(-1, -2)).masked_fill_(not_before[:n, :n], 0.0)
            m_ak = (a_ @ k_.transpose(-1, -2)).masked_fill_(not_before[:n, :n], 0.0)
            u = torch.linalg.solve_triangular(-m_ab, a_ @ s0 + m_ak @ vc, upper=False, unitriangular=True)
            rb = (r_ @ b_.transpose(-1, -2)).masked_fill_(after[:n, :n], 0.0)
            rk = (r_ @ k_.transpose(-1, -2)).masked_fill_(after[:n, :n], 0.0)
            outs.append(r_ @ s0 + rb @ u + rk @ vc)
            S = (S + u.transpose(-1, -2) @ b_ + vc.transpose(-1, -2) @ k_) * log_w[:, :, -1:].exp()
        return torch.cat(outs, 2).transpose(1, 2).reshape(B * T, H, N), S


def token_shift(x: Tensor, shift: Tensor, rows: Rows) -> Tensor:
    """Each token's previous token: the one before it in its row, or the row's saved shift."""
    if rows.total == rows.count:  # one token a row (decode): the saved shifts are the previous tokens
        return shift.to(x.dtype)
    prev = torch.roll(x, 1, dims=0)
    return prev.index_put((rows.starts,), shift.to(x.dtype))


# On a CPU (fp32, no autograd) the products go to oneDNN's linear instead of torch's default, MKL's
# sgemm. On the development machine's 2 cores (AMD EPYC, torch 2.13), for matrices of 1 MB and more:
# 1.3-3.1x faster at 1-32 rows, 1.0-1.4x at 512; the 0.1B shape's head at one row 17.9 -> 8.3 ms,
# at 32 rows 68 -> 29 ms. MKL runs a one-row product on one core (12 GB/s), oneDNN on both (21-24).
# On one thread (a served replica's default: README) the engine's 0.1B decode at 8-32 rows is
# still 14-17% faster, one row equal.
# Smaller matrices (all of the demo model's but its head) lose about as much as they gain. Each
# output is the same dot product, summed in another order (1e-4 on outputs of ~30).
ONEDNN_MIN_BYTES = 1 << 20
try:
    _onednn_linear = torch.ops.mkldnn._linear_pointwise if torch.backends.mkldnn.is_available() else None
except (AttributeError, RuntimeError):  # a build without it
    _onednn_linear = None


class Linear(nn.Linear):
    """nn.Linear without bias; on a CPU, large fp32 inference products take oneDNN (see above)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight
        if (x.device.type == "cpu" and w.dtype == torch.float32 and not torch.is_grad_enabled()
                and w.numel() * 4 >= ONEDNN_MIN_BYTES):
            if _onednn_linear is not None:
                return _onednn_linear(x, w, None, "none", [], "")
            if x.shape[0] > 1 and w.shape[0] > 8192:
                # MKL multiplies a 65k-row head by several rows 1.7x faster in slices that stay in
                # cache (measured at 16 rows, 0.1B shape)
                return torch.cat([F.linear(x, part) for part in w.split(2048)], dim=1)
        return super().forward(x)


class TimeMix(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        C, H, N = config.n_embd, config.n_head, config.head_size
        self.layer_id = layer_id
        self.n_head, self.head_size = H, N
        for name in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g", "w0", "a0", "v0", "k_k", "k_a"):
            setattr(self, name, nn.Parameter(torch.zeros(C)))
        for name, rank in (("w", config.w_lora), ("a", config.a_lora), ("v", config.v_lora), ("g", config.g_lora)):
            setattr(self, f"{name}1", nn.Parameter(torch.zeros(C, rank)))
            setattr(self, f"{name}2", nn.Parameter(torch.zeros(rank, C)))
        self.r_k = nn.Parameter(torch.zeros(H, N))
        self.receptance = Linear(C, C)
        self.key = Linear(C, C)
        self.value = Linear(C, C)
        self.output = Linear(C, C)
        self.ln_x = nn.GroupNorm(H, C, eps=64e-5)

    def forward(
        self, x: Tensor, shift: Tensor, v_first: Tensor | None, wkv_state: Tensor, rows: Rows, wkv: WkvFn
    ) -> tuple[Tensor, Tensor, Tensor]:
        """x [T, C] -> (out [T, C], v_first [T, C], wkv state [B, H, N, N])."""
        T, C = x.shape
        H, N = self.n_head, self.head_size
        xx = token_shift(x, shift, rows) - x
        xr, xw, xk, xv, xa, xg = (x + xx * m for m in (self.x_r, self.x_w, self.x_k, self.x_v, self.x_a, self.x_g))
        r = self.receptance(xr)
        k = self.key(xk)
        v = self.value(xv)
        w_log = -DECAY_SCALE * torch.sigmoid((self.w0 + torch.tanh(xw @ self.w1) @ self.w2).float())
        a = torch.sigmoid(self.a0 + (xa @ self.a1) @ self.a2)
        g = torch.sigmoid(xg @ self.g1) @ self.g2
        kk = F.normalize((k * self.k_k).view(T, H, N), dim=-1, p=2.0)
        k = k * (1 + (a - 1) * self.k_a)
        if self.layer_id == 0:
            v_first = v
        else:
            v = v + (v_first - v) * torch.sigmoid(self.v0 + (xv @ self.v1) @ self.v2)
        r, k, v, a = (t.view(T, H, N) for t in (r, k, v, a))
        y, wkv_state = wkv(wkv_state, r, w_log.view(T, H, N), k, v, -kk, kk * a, rows)
        y = self.ln_x(y.reshape(T, C).to(x.dtype))
        y = y + ((r * k * self.r_k).sum(-1, keepdim=True) * v).view(T, C)
        return self.output(y * g), v_first, wkv_state


class ChannelMix(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.x_k = nn.Parameter(torch.zeros(config.n_embd))
        self.key = Linear(config.n_embd, config.ffn_dim)
        self.value = Linear(config.ffn_dim, config.n_embd)

    def forward(self, x: Tensor, shift: Tensor, rows: Rows) -> Tensor:
        k = x + (token_shift(x, shift, rows) - x) * self.x_k
        return self.value(torch.relu(self.key(k)) ** 2)


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        if layer_id == 0:
            self.ln0 = nn.LayerNorm(config.n_embd, eps=1e-5)
        self.ln1 = nn.LayerNorm(config.n_embd, eps=1e-5)
        self.ln2 = nn.LayerNorm(config.n_embd, eps=1e-5)
        self.att = TimeMix(config, layer_id)
        self.ffn = ChannelMix(config)


class RWKV7(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.ln_out = nn.LayerNorm(config.n_embd, eps=1e-5)
        self.head = Linear(config.n_embd, config.vocab_size)

    def forward(
        self,
        tokens: Tensor,
        rows: Rows,
        state: RNNState,
        wkv: WkvFn = wkv_reference,
        last_only: bool = True,
        out: RNNState | None = None,
    ) -> tuple[Tensor, RNNState]:
        """Advances each row of `state` by its tokens.

        tokens [T] (flat, row-major as `rows` says); state holds one row per row of `rows`.
        Returns fp32 logits ([B, V] for each row's last token if last_only, else [T, V]) and the
        rows' new state: written into `out` when given (which may be `state` itself: each layer's
        state is read before it is written), else new tensors with `state` left as it was.
        """
        x = self.blocks[0].ln0(self.emb(tokens))
        v_first = None
        layers = []
        for i, block in enumerate(self.blocks):
            h = block.ln1(x)
            mixed, v_first, wkv_state = block.att(h, state.att_shift[i], v_first, state.wkv[i], rows, wkv)
            att_shift = h[rows.lasts]
            x = x + mixed
            h = block.ln2(x)
            x = x + block.ffn(h, state.ffn_shift[i], rows)
            layer = (att_shift, h[rows.lasts], wkv_state)
            if out is None:
                layers.append(layer)
            else:
                for mine, new in zip((out.att_shift[i], out.ffn_shift[i], out.wkv[i]), layer, strict=True):
                    mine.copy_(new)
        if last_only:
            x = x[rows.lasts]
        logits = self.logits(x)
        if out is None:
            out = RNNState(*(torch.stack(parts).float() for parts in zip(*layers, strict=True)))
        return logits, out

    def fingerprint(self) -> str:
        """A name for these weights (the prefix cache's files carry it): each tensor's name and
        shape, and 64 of its values rounded to fp16, so the same in fp32 on a CPU and fp16 on a GPU."""
        digest = hashlib.blake2b(digest_size=12)
        samples = []
        for name, p in self.named_parameters():
            digest.update(f"{name}{tuple(p.shape)};".encode())
            flat = p.detach().reshape(-1)
            samples.append(flat[:: max(1, flat.numel() // 64)][:64].to(torch.float16))
        digest.update(torch.cat(samples).cpu().numpy().tobytes())
        return digest.hexdigest()

    def logits(self, x: Tensor) -> Tensor:
        """Final norm and head: [n, C] -> fp32 [n, V]."""
        return self.head(self.ln_out(x)).float()

    def forward_batch(self, tokens: Tensor, wkv: WkvFn = wkv_reference) -> Tensor:
        """Training form: tokens [B, T] from a zero state -> logits [B, T, V] at every position."""
        B, T = tokens.shape
        rows = Rows([T] * B, device=tokens.device)
        state = RNNState.zeros(self.config, B, device=tokens.device)
        logits, _ = self(tokens.reshape(-1), rows, state, wkv=wkv, last_only=False)
        return logits.view(B, T, -1)


@torch.no_grad()
def init_random(model: RWKV7, seed: int, scale: float = 1.0) -> RWKV7:
    """Fills a model with random weights whose activations stay in a healthy range at any size.

    Used by tests (random checkpoints of many shapes) and as the start of training.
    """
    gen = torch.Generator().manual_seed(seed)

    def normal(shape: Sequence[int], std: float) -> Tensor:
        return torch.randn(*shape, generator=gen) * std

    def uniform(shape: Sequence[int], low: float, high: float) -> Tensor:
        return low + (high - low) * torch.rand(*shape, generator=gen)

    cfg = model.config
    C = cfg.n_embd
    model.emb.weight.copy_(normal(model.emb.weight.shape, 1.0))
    model.head.weight.copy_(normal(model.head.weight.shape, scale / math.sqrt(C)))
    for module in model.modules():
        if isinstance(module, nn.LayerNorm | nn.GroupNorm):
            module.weight.copy_(uniform(module.weight.shape, 0.8, 1.2))
            module.bias.copy_(normal(module.bias.shape, 0.05))
    for block in model.blocks:
        att, ffn = block.att, block.ffn
        for name in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"):
            getattr(att, name).copy_(uniform((C,), 0.0, 1.0))
        ffn.x_k.copy_(uniform((C,), 0.0, 1.0))
        att.w0.copy_(uniform((C,), -4.0, 1.0))
        att.a0.copy_(normal((C,), 0.5))
        att.v0.copy_(normal((C,), 0.5))
        att.k_k.copy_(uniform((C,), 0.6, 1.0))
        att.k_a.copy_(uniform((C,), 0.6, 1.2))
        att.r_k.copy_(normal(att.r_k.shape, 0.3))
        for name in ("w", "a", "v", "g"):
            first, second = getattr(att, f"{name}1"), getattr(att, f"{name}2")
            first.copy_(normal(first.shape, 1.0 / math.sqrt(C)))
            second.copy_(normal(second.shape, 1.0 / math.sqrt(second.shape[0])))
        for linear in (att.receptance, att.key, att.value):
            linear.weight.copy_(normal(linear.weight.shape, 1.0 / math.sqrt(C)))
        att.output.weight.copy_(normal(att.output.weight.shape, scale * 0.5 / math.sqrt(C)))
        ffn.key.weight.copy_(normal(ffn.key.weight.shape, 1.0 / math.sqrt(C)))
        ffn.value.weight.copy_(normal(ffn.value.weight.shape, scale * 0.5 / math.sqrt(cfg.ffn_dim)))
    return model
