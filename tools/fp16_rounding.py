"""Which of the CUDA runner's fp16 roundings make its long-prefill logit error, on the CPU.

The CUDA runner's long prefill (more than 128 tokens: cuBLAS) keeps the residual and every sum in
fp32 but writes some activations in fp16 between kernels. This runs the benchmark's random model
(weights rounded to fp16, as the GPU runs them) through rwkv7.py's math in fp32 and rounds to fp16
at exactly those places, each one a named point that a case can leave out:

    mix_r    the token-shift mix after ln1 into receptance
    mix_k    ... into key
    mix_v    ... into value and the v LoRA
    mix_wag  ... into the w, a and g LoRAs
    lora     the LoRAs' hidden activations (first stage out, after tanh/sigmoid)
    wkv_r    the recurrence's input r (fla's chunked kernel takes fp16)
    wkv_kv   ... its k and v
    wkv_ab   ... its a and b (-κ̂ and κ̂·a)
    y        the time mix's output (GroupNorm + bonus, gated), the output product's input
    mix2     the channel mix's token-shift mix (ffn key's input)
    ffn_k    ffn key's output before relu² (cuBLAS writes it in fp16)
    relu2    relu²'s output (ffn value's input)
    head     the final LayerNorm's output (the head's input)

Cases: `gpu` rounds at every point (what the runner does), `gpu-X-Y` at all but X and Y,
`only-X-Y` at X and Y only; the reference rounds nowhere. The error ‖Δ‖/‖ref‖ over the logits of
the benchmark's four rows (48, 17, 5 and 64 tokens from zero states) at every position, which
varies less from draw to draw than the benchmark's reading over the rows' last tokens (the second
figure), for several draws of tokens, and the rms over draws.

    python tools/fp16_rounding.py [--model 1.5b] [--layers N] [--draws 3] [--cases gpu,gpu-ffn_k]
                                  [--bf16 relu2]

With --bf16 P[,P...], those points round to bf16 instead (what an activation in bf16 would cost:
12-07i tried relu²'s output, the value product's input, as a lever on the products' power).

With --demo-run TEXT:N, the demo model (models/demo, weights rounded to fp16) on one row of N
times TEXT's first token instead (a run of one token; docs/gpu.md, "Runs of one token"), e.g.
`--demo-run " ":260 --cases gpu@1`. It also names the head whose time-mix output enters
GroupNorm with the least variance at the last token (the reference's), which GroupNorm scales up
by 1/sqrt(variance + eps); --gn-eps EPS sets that eps (64e-5) in the model and the reference alike.

The points are those of the runner with fp32 product outputs (`fp32_outputs_prefill=True`, the
default until 12-01f). Its default now also writes r, k, v, the LoRAs' second stages and the
residual's two updates in fp16; this tool does not round those (measured on the GPU instead: 1-2e-4
more, docs/gpu.md).

The model is held in fp16 and each product's weight widened to fp32 when used, so 7.2B's 32
layers fit in 24 GB (about 30 s a prefill on two cores).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu import EXACTNESS_LENGTHS, SHAPES, random_model  # noqa: E402

from replicas.model.rwkv7 import DECAY_SCALE, Rows, token_shift, wkv_reference  # noqa: E402

POINTS = ("mix_r", "mix_k", "mix_v", "mix_wag", "lora", "wkv_r", "wkv_kv", "wkv_ab", "y", "mix2", "ffn_k", "relu2",
          "head")


@dataclasses.dataclass
class Case:
    points: set[str]  # where it rounds
    first: int = 0  # ... except at each row's first `first` tokens,
    first_points: set[str] = dataclasses.field(default_factory=lambda: set(POINTS))  # at these points
    bf16: set[str] = dataclasses.field(default_factory=set)  # points that round to bf16 instead (--bf16)


def make_rounder(case: Case, rows: Rows):
    exempt = torch.zeros(rows.total, dtype=torch.bool)
    for t in range(case.first):
        exempt[rows.starts[torch.tensor(rows.lengths) > t] + t] = True

    def rnd(point: str, t: torch.Tensor) -> torch.Tensor:
        if point not in case.points:
            return t
        rounded = t.bfloat16().float() if point in case.bf16 else t.half().float()
        if case.first and point in case.first_points:
            rounded[exempt] = t[exempt]
        return rounded

    return rnd


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight.float())


def time_mix(att, x, shift, v_first, rows: Rows, rnd, gn_inputs: list | None = None):
    """rwkv7.TimeMix.forward from a zero state, rounded where the runner rounds; with gn_inputs, the
    last token's GroupNorm input per head [H, N] is appended to it."""
    T, C = x.shape
    H, N = att.n_head, att.head_size
    p = {n: getattr(att, n).float() for n in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g", "w0", "a0", "v0", "k_k",
                                               "k_a", "r_k", "w1", "w2", "a1", "a2", "v1", "v2", "g1", "g2")}
    xx = token_shift(x, shift, rows) - x
    xr, xw, xk, xv, xa, xg = (rnd(point, x + xx * p[m]) for point, m in (
        ("mix_r", "x_r"), ("mix_wag", "x_w"), ("mix_k", "x_k"), ("mix_v", "x_v"), ("mix_wag", "x_a"),
        ("mix_wag", "x_g")))
    r, k, v = linear(xr, att.receptance.weight), linear(xk, att.key.weight), linear(xv, att.value.weight)

    def lora(xin, name, act=None):
        hidden = rnd("lora", xin @ p[f"{name}1"])
        if act is not None:
            hidden = rnd("lora", act(hidden))
        return hidden @ p[f"{name}2"]

    w_log = -DECAY_SCALE * torch.sigmoid(p["w0"] + lora(xw, "w", torch.tanh))
    a = torch.sigmoid(p["a0"] + lora(xa, "a"))
    g = lora(xg, "g", torch.sigmoid)
    kk = F.normalize((k * p["k_k"]).view(T, H, N), dim=-1, p=2.0)
    k = k * (1 + (a - 1) * p["k_a"])
    if v_first is None:
        v_first = v
    else:
        v = v + (v_first - v) * torch.sigmoid(p["v0"] + lora(xv, "v"))
    r, k, v, a = (t.view(T, H, N) for t in (r, k, v, a))
    rq, kq, vq, aq, bq = (rnd(point, t) for point, t in (
        ("wkv_r", r), ("wkv_kv", k), ("wkv_kv", v), ("wkv_ab", -kk), ("wkv_ab", kk * a)))
    state = torch.zeros(rows.count, H, N, N)
    y, _ = wkv_reference(state, rq, w_log.view(T, H, N), kq, vq, aq, bq, rows)
    if gn_inputs is not None:
        gn_inputs.append(y[-1])
    y = F.group_norm(y.reshape(T, C), H, att.ln_x.weight.float(), att.ln_x.bias.float(), eps=att.ln_x.eps)
    y = y + ((r * k * p["r_k"].view(H, N)).sum(-1, keepdim=True) * v).view(T, C)
    return linear(rnd("y", y * g), att.output.weight), v_first


def prefill(model, chunks: list[list[int]], case: Case, gn_inputs: list | None = None) -> torch.Tensor:
    """Logits at every position of the rows, from zero states."""
    rows = Rows([len(c) for c in chunks])
    rnd = make_rounder(case, rows)
    C = model.config.n_embd
    zero = torch.zeros(rows.count, C)

    def ln(module, t):
        return F.layer_norm(t, (C,), module.weight.float(), module.bias.float(), module.eps)

    x = ln(model.blocks[0].ln0, model.emb.weight[torch.tensor(sum(chunks, []))].float())
    v_first = None
    for block in model.blocks:
        dx, v_first = time_mix(block.att, ln(block.ln1, x), zero, v_first, rows, rnd, gn_inputs)
        x = x + dx
        h = ln(block.ln2, x)
        kin = rnd("mix2", h + (token_shift(h, zero, rows) - h) * block.ffn.x_k.float())
        kf = rnd("relu2", torch.relu(rnd("ffn_k", linear(kin, block.ffn.key.weight))) ** 2)
        x = x + linear(kf, block.ffn.value.weight)
    return linear(rnd("head", ln(model.ln_out, x)), model.head.weight)


def cases(names: list[str], bf16: set[str]) -> dict[str, Case]:
    """gpu | gpu-P[-P...] | only-P[-P...], each optionally @N (no rounding at each row's first N
    tokens) or @N:P[-P...] (none at those points of the first N tokens)"""
    out = {}
    for name in names:
        base, _, first = name.partition("@")
        first, _, first_listed = first.partition(":")
        kind, _, listed = base.partition("-")
        named = set(listed.split("-")) if listed else set()
        first_points = set(first_listed.split("-")) if first_listed else set(POINTS)
        if kind not in ("gpu", "only") or not (named | first_points) <= set(POINTS) or (kind == "only" and not named):
            raise SystemExit(f"bad case {name!r}: {cases.__doc__}; points: {', '.join(POINTS)}")
        out[name] = Case(named if kind == "only" else set(POINTS) - named, int(first or 0), first_points, bf16)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="1.5b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=0, help="fewer layers than the shape's (0: all)")
    parser.add_argument("--draws", type=int, default=3, help="draws of the four rows' tokens")
    parser.add_argument("--cases", default="gpu," + ",".join(f"gpu-{p}" for p in POINTS))
    parser.add_argument("--demo-run", metavar="TEXT:N", help="the demo model on N times TEXT's first token")
    parser.add_argument("--bf16", default="", metavar="P[,P...]", help="points that round to bf16 instead")
    parser.add_argument("--gn-eps", type=float, help="with --demo-run: the time mix's GroupNorm eps")
    args = parser.parse_args()
    bf16 = set(filter(None, args.bf16.split(",")))
    if not bf16 <= set(POINTS):
        raise SystemExit(f"bad --bf16 {args.bf16!r}; points: {', '.join(POINTS)}")
    torch.set_grad_enabled(False)
    if args.demo_run:
        demo_run(args.demo_run, cases(args.cases.split(","), bf16), args.gn_eps)
        return
    start = time.perf_counter()
    cfg = SHAPES[args.model]
    if args.layers:
        cfg = dataclasses.replace(cfg, n_layer=args.layers)
    todo = cases(args.cases.split(","), bf16)
    print(f"[{time.perf_counter() - start:5.1f}s] building the random {args.model} model (fp16) on the CPU",
          file=sys.stderr, flush=True)
    model = random_model(cfg, torch.float16, device="cpu")
    results = {name: [] for name in todo}
    for draw in range(args.draws):
        gen = torch.Generator().manual_seed(1 + draw)
        chunks = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in EXACTNESS_LENGTHS]
        ref = prefill(model, chunks, Case(set()))
        lasts = Rows(EXACTNESS_LENGTHS).lasts
        for name, case in todo.items():
            out = prefill(model, chunks, case)
            results[name].append((rel_err(out, ref), rel_err(out[lasts], ref[lasts])))
            print(f"[{time.perf_counter() - start:5.1f}s] draw {draw + 1} {name}: {results[name][-1]}",
                  file=sys.stderr, flush=True)
    print(f"| case ({args.model}{f', {args.layers} layers' if args.layers else ''}): all positions / last tokens | "
          f"{' | '.join(f'draw {d + 1}' for d in range(args.draws))} | rms |")
    print(f"|---|{'---:|' * (args.draws + 1)}")
    for name, errs in results.items():
        rms = [(sum(e[i] ** 2 for e in errs) / len(errs)) ** 0.5 for i in (0, 1)]
        print(f"| {name} | {' | '.join(f'{a:.1e} / {b:.1e}' for a, b in [*errs, rms])} |", flush=True)


def demo_run(spec: str, todo: dict[str, Case], gn_eps: float | None = None) -> None:
    """The demo model on a run of one token: each case's error over every position / the last, and
    the head whose output enters GroupNorm with the least variance at the last token."""
    from replicas.model.checkpoint import load_model  # noqa: PLC0415
    from replicas.model.loader import default_model_dir  # noqa: PLC0415
    from replicas.tokenizer import load_tokenizer  # noqa: PLC0415

    text, _, n = spec.rpartition(":")
    if not text or not n.isdigit():
        raise SystemExit(f"--demo-run wants TEXT:N, not {spec!r}")
    model, _ = load_model(default_model_dir(), "cpu", torch.float16)  # (fp16 held, widened where used)
    tokens = load_tokenizer(default_model_dir() / "tokenizer.json").encode(text)[:1] * int(n)
    if gn_eps is not None:
        for block in model.blocks:
            block.att.ln_x.eps = gn_eps
    gn_inputs = []  # the reference's, a layer each
    ref = prefill(model, [tokens], Case(set()), gn_inputs)
    variances = sorted((v, i, h) for i, y in enumerate(gn_inputs)
                       for h, v in enumerate(y.var(-1, unbiased=False).tolist()))
    var, layer, head = variances[0]
    print(f"least variance into GroupNorm at the last token: layer {layer}, head {head}: {var:.1e} "
          f"(eps {model.blocks[0].att.ln_x.eps:g}; the heads' median {variances[len(variances) // 2][0]:.1e})")
    print(f"| case (demo model, {n} × token {tokens[0]}): all positions / last token |")
    print("|---|")
    for name, case in todo.items():
        out = prefill(model, [tokens], case)
        print(f"| {name} | {rel_err(out, ref):.1e} / {rel_err(out[-1:], ref[-1:]):.1e} |", flush=True)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).norm() / ref.norm()).item()


if __name__ == "__main__":
    main()
