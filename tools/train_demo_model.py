"""Trains the embedded demo model: a small RWKV-7 on CPython's standard library source.

Reads what tools/demo_corpus.py wrote (token streams, tokenizer.json, corpus.json) and writes a
model directory in the project's format (`save_model`: config.json, model.safetensors in
bfloat16, tokenizer.json), the training record training.json and the loss log log.jsonl:

    python tools/demo_corpus.py --out .carry/demo                                # the corpus
    python tools/train_demo_model.py --data .carry/demo --out out/demo --time-budget 380  # GPU
    python tools/train_demo_model.py --data .carry/demo --out /tmp/smoke --smoke          # CPU

The loop: random windows of the train stream -> the project's `forward_batch`, with
`wkv_transition` below as its recurrence -> cross-entropy -> AdamW, cosine learning rate;
held-out loss on fixed windows every --eval-every steps, the best weights of those kept. At the
end the kept weights are saved in bfloat16, read back through `load_model` in fp32, and the
shipped weights' held-out loss is measured over the whole held-out split.

With --time-budget the number of steps is fixed once ten steps have been timed, and recorded:
`--steps N` with the same seed repeats the schedule exactly.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from replicas.model.checkpoint import load_model, save_model
from replicas.model.config import WEIGHTS_FILE, ModelCard, ModelConfig
from replicas.model.rwkv7 import RWKV7, Rows

# The committed model directory must stay under 10 MB in all; weights + tokenizer get 9.5 of it,
# the rest is for the card, the plot and the records.
WEIGHTS_BUDGET = 9_500_000


@dataclass
class Hyper:
    """Everything that decides the run; training.json records it."""

    layers: int = 6
    width: int = 192
    head_size: int = 64
    ffn_mult: int = 4
    w_lora: int = 32
    a_lora: int = 32
    v_lora: int = 16
    g_lora: int = 32
    ctx: int = 256  # tokens per training window
    batch: int = 256  # windows per step
    lr: float = 2e-3
    lr_final: float = 1e-4
    warmup: int = 100  # steps of linear warm-up
    weight_decay: float = 0.1  # on weight matrices only
    betas: tuple[float, float] = (0.9, 0.99)
    clip: float = 1.0
    steps: int = 0  # 0: decided by --time-budget and --max-epochs
    max_epochs: float = 16.0  # a cap on passes over the train split when the steps are decided
    time_budget: float = 0.0  # seconds of training, when steps == 0
    eval_every: int = 50
    eval_windows: int = 64  # fixed held-out windows for the periodic loss
    seed: int = 20260517


def model_config(h: Hyper, vocab_size: int) -> ModelConfig:
    return ModelConfig(
        n_layer=h.layers, n_embd=h.width, head_size=h.head_size, vocab_size=vocab_size,
        ffn_dim=h.ffn_mult * h.width, w_lora=h.w_lora, a_lora=h.a_lora, v_lora=h.v_lora,
        g_lora=h.g_lora,
    )


# ----------------------------------------------------------------------------------------------
# The recurrence for training: one batched matrix product per token
# ----------------------------------------------------------------------------------------------


def wkv_transition(
    state: Tensor, r: Tensor, w_log: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, rows: Rows
) -> tuple[Tensor, Tensor]:
    """`wkv_reference`'s contract for rows of equal length, written as S_t = S_{t-1}·A_t + v_t k_tᵀ.

    The per-token transition A_t = diag(w_t) + a_t b_tᵀ and the update v_t k_tᵀ are built for
    every token at once, so each step of the loop is one `baddbmm` (and about three kernels in
    the backward pass) instead of the reference's dozen: the loop is bound by kernel launches on
    a GPU. It costs N× the reference's arithmetic and keeps [T, B·H, N, N] tensors for autograd;
    fp32 throughout (autocast off) because w is close to 1.
    """
    if not rows.uniform:
        raise ValueError("wkv_transition needs rows of equal length (training windows)")
    B, T = rows.count, rows.lengths[0]
    _, H, N = r.shape
    with torch.autocast(r.device.type, enabled=False):

        def steps(x: Tensor) -> Tensor:  # [B·T, H, N] row-major -> [T, B·H, N]
            return x.float().view(B, T, H, N).transpose(0, 1).reshape(T, B * H, N)

        r, w, k, v, a, b = (steps(x) for x in (r, torch.exp(w_log.float()), k, v, a, b))
        A = torch.baddbmm(  # [T·B·H, N, N]: diag(w) + a bᵀ
            torch.diag_embed(w).view(-1, N, N), a.reshape(-1, N, 1), b.reshape(-1, 1, N)
        ).view(T, B * H, N, N)
        U = (v[..., :, None] * k[..., None, :]).unbind(0)  # T × [B·H, N, N]: v kᵀ
        S = state.float().reshape(B * H, N, N)
        history = []
        for A_t, U_t in zip(A.unbind(0), U, strict=True):  # unbind, not A[t]: see note below
            S = torch.baddbmm(U_t, S, A_t)
            history.append(S)
        out = (torch.stack(history) @ r[..., None])[..., 0]  # [T, B·H, N]
    out = out.view(T, B, H, N).transpose(0, 1).reshape(B * T, H, N)
    return out, S.view(B, H, N, N)
    # Note: indexing A[t] in the loop would make autograd build T full-size zero gradients of A
    # (one per index); unbind gives one backward that stacks the T slices.


# ----------------------------------------------------------------------------------------------
# Initialisation for training (BlinkDL's RWKV-7 recipe, in the project's parametrisation)
# ----------------------------------------------------------------------------------------------


@torch.no_grad()
def init_for_training(model: RWKV7, seed: int) -> RWKV7:
    """Zero output projections, decays spread from long to short memory, tiny embeddings.

    Follows RWKV-LM v7's `train_temp` initialisation: each block starts as the identity (its
    output and FFN value matrices are zero), the token-shift mixes and decays vary smoothly
    across channels and layers, and LoRA first factors start at zero.
    """
    gen = torch.Generator().manual_seed(seed)
    cfg = model.config
    C, N, L, V = cfg.n_embd, cfg.head_size, cfg.n_layer, cfg.vocab_size
    channel = torch.arange(C, dtype=torch.float32)
    ddd = channel / C
    linear = channel / (C - 1) - 0.5
    zigzag = ((channel % N) - (N - 1) / 2) / ((N - 1) / 2)
    zigzag = zigzag * zigzag.abs()

    def uniform(t: Tensor, bound: float) -> None:
        t.copy_((torch.rand(t.shape, generator=gen) * 2 - 1) * bound)

    def ortho(t: Tensor, scale: float) -> None:  # BlinkDL's ortho_init
        gain = scale * math.sqrt(max(t.shape[0] / t.shape[1], 1.0))
        nn.init.orthogonal_(t, gain=gain, generator=gen)

    for module in model.modules():
        if isinstance(module, nn.LayerNorm):
            module.weight.fill_(1.0)
            module.bias.zero_()
    uniform(model.emb.weight, 1e-4)
    # Orthogonal head, rows of norm 0.5: logits start with a spread of about 0.5.
    nn.init.orthogonal_(model.head.weight, gain=0.5 * math.sqrt(max(V / C, 1.0)), generator=gen)
    for i, block in enumerate(model.blocks):
        att, ffn = block.att, block.ffn
        early = i / max(L - 1, 1)  # 0 at the first layer, 1 at the last
        late = 1.0 - i / L  # 1 at the first layer, towards 0 at the last
        for name, power in (("x_r", 0.2), ("x_w", 0.9), ("x_k", 0.7), ("x_v", 0.7), ("x_a", 0.9), ("x_g", 0.2)):
            getattr(att, name).copy_(1.0 - ddd.pow(power * late))
        decay = -6 + 6 * (channel / (C - 1)) ** (1 + early**0.3)
        att.w0.copy_(decay + 0.5 + zigzag * 2.5)
        att.a0.copy_(-0.19 + zigzag * 0.3 + linear * 0.4)
        att.v0.copy_(0.73 - linear * 0.4)
        att.k_k.copy_(0.71 - linear * 0.1)
        att.k_a.fill_(1.02)
        att.r_k.fill_(-0.04)
        for name in "wavg":
            getattr(att, f"{name}1").zero_()
            ortho(getattr(att, f"{name}2"), 0.1)
        uniform(att.receptance.weight, 0.5 / math.sqrt(C))
        uniform(att.key.weight, 0.05 / math.sqrt(C))
        uniform(att.value.weight, 0.5 / math.sqrt(C))
        att.output.weight.zero_()
        att.ln_x.weight.fill_(((1 + i) / L) ** 0.7)
        att.ln_x.bias.zero_()
        ffn.x_k.copy_(1.0 - ddd.pow(late**4))
        uniform(ffn.key.weight, 0.5 / math.sqrt(C))
        ffn.value.weight.zero_()
    return model


# ----------------------------------------------------------------------------------------------
# Data, loss, evaluation
# ----------------------------------------------------------------------------------------------


def load_stream(path: Path, device: torch.device) -> Tensor:
    return torch.from_numpy(np.load(path).astype(np.int64)).to(device)


def sample_windows(stream: Tensor, batch: int, ctx: int, gen: torch.Generator) -> Tensor:
    """[batch, ctx + 1] windows starting at uniformly random offsets (inputs and next tokens)."""
    starts = torch.randint(0, stream.numel() - ctx - 1, (batch, 1), generator=gen, device=stream.device)
    return stream[starts + torch.arange(ctx + 1, device=stream.device)]


def window_nll(model: RWKV7, windows: Tensor) -> Tensor:
    """Summed next-token negative log-likelihood (nats) over [B, T + 1] windows."""
    logits = model.forward_batch(windows[:, :-1], wkv=wkv_transition)
    return F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten(), reduction="sum")


def heldout_windows(stream: Tensor, ctx: int) -> tuple[Tensor, Tensor]:
    """Consecutive windows overlapping by one token, so every token but the first is a target
    exactly once: full [n, ctx + 1] windows, and the shorter remainder [1, m]."""
    n = (stream.numel() - 1) // ctx
    full = stream[: n * ctx + 1]
    starts = torch.arange(n, device=stream.device)[:, None] * ctx
    return full[starts + torch.arange(ctx + 1, device=stream.device)], stream[n * ctx:][None]


@torch.no_grad()
def heldout_loss(model: RWKV7, windows: Tensor, rest: Tensor | None, batch: int, amp: bool) -> float:
    """Mean nats per target token over the given windows (and the remainder, if any)."""
    total, count = 0.0, 0
    parts = list(windows.split(batch)) + ([rest] if rest is not None and rest.shape[1] > 1 else [])
    for part in parts:
        with torch.autocast(part.device.type, dtype=torch.bfloat16, enabled=amp):
            total += float(window_nll(model, part))
        count += part[:, 1:].numel()
    return total / count


# ----------------------------------------------------------------------------------------------
# Optimisation
# ----------------------------------------------------------------------------------------------


def make_optimizer(model: RWKV7, h: Hyper, device: torch.device) -> torch.optim.AdamW:
    """AdamW; weight decay on the weight matrices (embedding, head, projections) only."""
    matrices = [p for n, p in model.named_parameters() if n.endswith(".weight") and p.ndim == 2]
    others = [p for n, p in model.named_parameters() if not (n.endswith(".weight") and p.ndim == 2)]
    groups = [{"params": matrices, "weight_decay": h.weight_decay}, {"params": others, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=h.lr, betas=h.betas, fused=device.type == "cuda")


def learning_rate(h: Hyper, step: int, total: int) -> float:
    """Linear warm-up, then a cosine from lr to lr_final at the last step."""
    if step < h.warmup:
        return h.lr * (step + 1) / h.warmup
    progress = min(1.0, (step - h.warmup) / max(1, total - h.warmup))
    return h.lr_final + 0.5 * (h.lr - h.lr_final) * (1 + math.cos(math.pi * progress))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class Log:
    """log.jsonl: one JSON object a line, flushed, so a run cut short still leaves its curve."""

    def __init__(self, path: Path):
        self.file = path.open("w")

    def write(self, **record: object) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------


def weights_bytes(config: ModelConfig) -> int:
    with torch.device("meta"):
        return 2 * sum(p.numel() for p in RWKV7(config).parameters())  # bfloat16


def train(h: Hyper, data: Path, out: Path, device: torch.device) -> dict:
    corpus = json.loads((data / "corpus.json").read_text())
    config = model_config(h, corpus["tokenizer"]["vocab_size"])
    size = weights_bytes(config) + (data / "tokenizer.json").stat().st_size
    print(f"model: {config}\nweights + tokenizer: {size / 1e6:.2f} MB (budget {WEIGHTS_BUDGET / 1e6} MB)")
    if size > WEIGHTS_BUDGET:
        raise SystemExit("model too large for the demo's size limit")

    torch.manual_seed(h.seed)
    torch.set_float32_matmul_precision("highest")  # the recurrence needs true fp32 (w ≈ 1)
    run = Run(h, init_for_training(RWKV7(config), h.seed).to(device).train(), data, out, device)
    while run.step < run.total and not run.out_of_time():
        if run.step % h.eval_every == 0:
            run.evaluate()
        run.train_step()
    seconds = time.perf_counter() - run.started
    run.evaluate()
    print(f"trained {run.step} steps, {run.tokens / 1e6:.1f}M tokens in {seconds:.0f}s; "
          f"keeping step {run.best_step} (held-out windows {run.best_loss:.4f})")
    run.model.load_state_dict(run.best_weights)
    return ship(run.model, h, corpus, data, out, device, extra={
        "steps": run.step, "planned_steps": run.total, "tokens_seen": run.tokens,
        "epochs": run.tokens / corpus["train"]["tokens"], "train_seconds": seconds,
        "kept_step": run.best_step, "device": device_name(device),
    })


class Run:
    """One training run's moving parts: model, optimiser, data, counters, the best weights so far."""

    def __init__(self, h: Hyper, model: RWKV7, data: Path, out: Path, device: torch.device):
        self.h, self.model, self.device = h, model, device
        self.amp = device.type == "cuda"  # bf16 autocast on the GPU; fp32 on the CPU
        self.opt = make_optimizer(model, h, device)
        self.train_stream = load_stream(data / "train.npy", device)
        windows, _ = heldout_windows(load_stream(data / "heldout.npy", device), h.ctx)
        pick = torch.linspace(0, windows.shape[0] - 1, h.eval_windows).long().to(device)
        self.eval_set = windows[pick]  # fixed windows spread over the held-out split
        self.gen = torch.Generator(device=device).manual_seed(h.seed)
        out.mkdir(parents=True, exist_ok=True)
        self.log = Log(out / "log.jsonl")
        self.total = h.steps or 10**9  # fixed by plan_steps when only a time budget is given
        self.step = self.tokens = 0
        self.best_loss, self.best_step, self.best_weights = math.inf, -1, {}
        self.started = self.mark = time.perf_counter()
        self.losses: list[Tensor] = []

    def out_of_time(self) -> bool:
        return bool(self.h.time_budget) and time.perf_counter() - self.started > 1.05 * self.h.time_budget

    def evaluate(self) -> None:
        """Held-out loss on the fixed windows; keeps a CPU copy of the weights when it is the best."""
        self.model.eval()
        loss = heldout_loss(self.model, self.eval_set, None, self.h.batch, self.amp)
        self.model.train()
        self.log.write(step=self.step, tokens=self.tokens, heldout=loss, elapsed=time.perf_counter() - self.started)
        print(f"step {self.step:5d}  held-out {loss:.4f}", flush=True)
        if loss < self.best_loss:
            self.best_loss, self.best_step = loss, self.step
            self.best_weights = {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def train_step(self) -> None:
        h = self.h
        lr = learning_rate(h, self.step, self.total)
        for group in self.opt.param_groups:
            group["lr"] = lr
        windows = sample_windows(self.train_stream, h.batch, h.ctx, self.gen)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp):
            loss = window_nll(self.model, windows) / windows[:, 1:].numel()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), h.clip)
        self.opt.step()
        self.step += 1
        self.tokens += windows[:, 1:].numel()
        self.losses.append(loss.detach())
        if self.step == PACE_FROM:
            sync(self.device)
            self.pace_start = time.perf_counter()
        if self.step == PACE_FROM + PACE_STEPS and not h.steps:
            self.total = self.plan_steps()
        if self.step % 10 == 0 or self.step == self.total:
            self.report(lr, grad_norm)

    def plan_steps(self) -> int:
        """Fixes the number of steps from the pace of PACE_STEPS steps after the first few."""
        sync(self.device)
        now = time.perf_counter()
        per_step = (now - self.pace_start) / PACE_STEPS
        in_time = self.step + max(1, int((0.94 * self.h.time_budget - (now - self.started)) / per_step))
        epochs = int(self.h.max_epochs * self.train_stream.numel() / (self.h.batch * self.h.ctx))
        total = min(in_time, epochs)
        memory = torch.cuda.max_memory_allocated() / 2**30 if self.device.type == "cuda" else 0.0
        print(f"pace: {per_step * 1e3:.0f} ms/step, {self.h.batch * self.h.ctx / per_step / 1e3:.0f}k tok/s, "
              f"peak GPU memory {memory:.1f} GiB -> {total} steps ({in_time} fit in {self.h.time_budget:.0f}s, "
              f"{epochs} make {self.h.max_epochs} epochs)", flush=True)
        return total

    def report(self, lr: float, grad_norm: Tensor) -> None:
        sync(self.device)
        now = time.perf_counter()
        mean = float(torch.stack(self.losses).mean())
        rate = len(self.losses) * self.h.batch * self.h.ctx / (now - self.mark)
        self.log.write(step=self.step, tokens=self.tokens, train=mean, lr=lr, grad_norm=float(grad_norm),
                       elapsed=now - self.started, tokens_per_s=rate)
        if self.step % 50 == 0 or self.step in (10, self.total):
            print(f"step {self.step:5d}/{self.total}  train {mean:.4f}  lr {lr:.2e}  |g| {float(grad_norm):.2f}  "
                  f"{rate / 1e3:.0f}k tok/s  {now - self.started:.0f}s", flush=True)
        self.mark, self.losses = now, []


PACE_FROM, PACE_STEPS = 3, 10  # the first steps pay one-off costs (allocator, cuBLAS handles)


def ship(model: RWKV7, h: Hyper, corpus: dict, data: Path, out: Path, device: torch.device,
         extra: dict) -> dict:
    """Saves in bfloat16, reads back through load_model in fp32, measures the whole held-out split."""
    card = ModelCard(name="rwkv7-demo-pystdlib", tokenizer="tokenizer.json", eos_token_id=0, dtype="bfloat16")
    model_dir = out / "model"
    save_model(model, model_dir, card, data / "tokenizer.json")
    shipped, _ = load_model(model_dir, device=device, dtype=torch.float32)
    heldout_stream = load_stream(data / "heldout.npy", device)
    windows, rest = heldout_windows(heldout_stream, h.ctx)
    t0 = time.perf_counter()
    loss = heldout_loss(shipped, windows, rest, h.batch, amp=False)  # fp32, as shipped
    unigram = corpus["unigram_heldout_nats"]
    print(f"shipped weights: held-out {loss:.4f} nats/token vs unigram {unigram:.4f} "
          f"(ratio {loss / unigram:.3f}) over {windows[:, 1:].numel() + rest.numel() - 1} tokens "
          f"in {time.perf_counter() - t0:.0f}s")
    record = {
        "hyper": asdict(h),
        "model": asdict(model.config),
        "parameters": sum(p.numel() for p in model.parameters()),
        "weights_bytes": (model_dir / WEIGHTS_FILE).stat().st_size,
        "heldout_nats": loss,
        "heldout_eval": "whole held-out split, fp32 from the bf16 file, windows of ctx+1 overlapping by one",
        "unigram_heldout_nats": unigram,
        "corpus": corpus,
        "torch": torch.__version__,
        **extra,
    }
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


SMOKE = {"layers": 2, "width": 64, "head_size": 16, "ffn_mult": 2, "w_lora": 8, "a_lora": 8,
         "v_lora": 8, "g_lora": 8, "ctx": 32, "batch": 8, "steps": 30, "warmup": 5,
         "eval_every": 10, "eval_windows": 4}


def parse_args() -> tuple[Hyper, Path, Path, torch.device]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path(".carry/demo"))
    parser.add_argument("--out", type=Path, default=Path("out/demo"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--smoke", action="store_true", help="a tiny model for a few steps (CPU check)")
    for f in fields(Hyper):
        if f.name != "betas":
            parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=None)
    args = parser.parse_args()
    values = SMOKE if args.smoke else {}
    given = {f.name: getattr(args, f.name) for f in fields(Hyper) if getattr(args, f.name, None) is not None}
    return Hyper(**{**values, **given}), args.data, args.out, torch.device(args.device)


def main() -> None:
    h, data, out, device = parse_args()
    if not h.steps and not h.time_budget:
        raise SystemExit("give --steps or --time-budget")
    train(h, data, out, device)


if __name__ == "__main__":
    main()
