"""Checkpoints in and out: BlinkDL `.pth` files, and the project's model directory.

A model directory holds `config.json`, `model.safetensors` (BlinkDL tensor names, vectors
squeezed to [C]) and the tokenizer file that config.json names. `convert` turns a `.pth` into
one; `load_model` reads one back. Every check raises `ModelFormatError` with a one-line message.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from .config import WEIGHTS_FILE, ModelCard, ModelConfig, ModelFormatError, read_config, write_config
from .rwkv7 import RWKV7

WORLD_VOCAB = Path(__file__).with_name("rwkv_vocab_v20230424.txt")
WORLD_VOCAB_SIZE = 65536
# BlinkDL stores these per-channel vectors as [1, 1, C].
_VECTOR_SUFFIXES = ("att.x_r", "att.x_w", "att.x_k", "att.x_v", "att.x_a", "att.x_g",
                    "att.w0", "att.a0", "att.v0", "att.k_k", "att.k_a", "ffn.x_k")
# Key fragments that identify checkpoints this runner does not implement.
_OLDER_RWKV = {"att.time_first": 4, "att.time_faaaa": 5, "att.time_maa_x": 6, "att.time_decay": 6}
_DEEP_EMBED = ("ffn.s_emb", "ffn.s0", "ffn.s1", "ffn.s2")

Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


def check_tensors(tensors: dict[str, Tensor], origin: str) -> tuple[ModelConfig, dict[str, Tensor]]:
    """Validates a BlinkDL-named state dict; returns its config and tensors shaped as RWKV7's.

    Refuses other RWKV versions and the DeepEmbed variant by name, then demands exactly the
    tensors an RWKV7 of the shapes read from the checkpoint has, with exactly its shapes.
    """
    if not isinstance(tensors, dict) or not all(
        isinstance(k, str) and isinstance(v, Tensor) for k, v in tensors.items()
    ):
        raise ModelFormatError(f"{origin}: not a state dict of named tensors")
    for fragment, version in _OLDER_RWKV.items():
        if any(fragment in key for key in tensors):
            raise ModelFormatError(
                f"{origin}: looks like an RWKV-{version} checkpoint ({fragment}); only RWKV-7 is supported"
            )
    if any(key.split(".", 2)[-1].startswith(_DEEP_EMBED) for key in tensors):
        raise ModelFormatError(f"{origin}: the DeepEmbed variant (ffn.s_emb/s0/s1/s2) is not supported")
    if "emb.weight" not in tensors:
        raise ModelFormatError(f"{origin}: no emb.weight: not an RWKV checkpoint")
    try:
        config = ModelConfig.from_tensors(tensors)
    except (ValueError, IndexError) as err:
        raise ModelFormatError(f"{origin}: cannot read shapes ({err})") from None
    if config.n_embd % config.head_size:
        raise ModelFormatError(f"{origin}: width {config.n_embd} is not a multiple of head size {config.head_size}")

    with torch.device("meta"):  # shapes only, no memory
        expected = {k: v.shape for k, v in RWKV7(config).state_dict().items()}
    out: dict[str, Tensor] = {}
    for key, shape in expected.items():
        if key.startswith("blocks.0.att.v") and key[-1] in "012":
            # Layer 0's v0/v1/v2 are never used (layer 0 makes v_first); keep a zero of the right shape.
            out[key] = torch.zeros(shape)
            continue
        if key not in tensors:
            raise ModelFormatError(f"{origin}: missing tensor {key!r}")
        tensor = tensors[key]
        if tensor.shape != shape and tensor.squeeze().shape != shape:
            raise ModelFormatError(
                f"{origin}: tensor {key!r} has shape {list(tensor.shape)}, expected {list(shape)}"
            )
        out[key] = tensor.reshape(shape)
    unknown = sorted(set(tensors) - set(expected))
    if unknown:
        raise ModelFormatError(f"{origin}: unexpected tensor {unknown[0]!r} ({len(unknown)} unknown in all)")
    return config, out


def read_pth(path: Path) -> dict[str, Tensor]:
    if not path.is_file():
        raise ModelFormatError(f"{path}: no such file")
    for mmap in (True, False):  # files from torch's legacy (non-zip) format cannot be mapped
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        except Exception:  # torch raises many types for a file that is not a checkpoint
            continue
    raise ModelFormatError(f"{path}: not a PyTorch checkpoint (torch.load cannot read it)")


def convert(
    source: Path,
    out_dir: Path,
    tokenizer: Path | None = None,
    dtype: torch.dtype | None = None,
    name: str | None = None,
    progress: Progress = _quiet,
) -> ModelConfig:
    """Converts a BlinkDL .pth into a model directory; returns the model's config."""
    progress(f"reading {source}")
    config, tensors = check_tensors(read_pth(source), str(source))
    progress(
        f"RWKV-7: {config.n_layer} layers, width {config.n_embd}, {config.n_head} heads of {config.head_size}, "
        f"FFN {config.ffn_dim}, vocab {config.vocab_size}"
    )
    if tokenizer is None:
        if config.vocab_size != WORLD_VOCAB_SIZE:
            raise ModelFormatError(
                f"{source}: vocabulary of {config.vocab_size} is not the World vocabulary's 65536; "
                "name a tokenizer with --tokenizer"
            )
        tokenizer = WORLD_VOCAB
    eos = _check_tokenizer(tokenizer, config)
    out_dir.mkdir(parents=True, exist_ok=True)
    stored = dtype or next(iter(tensors.values())).dtype
    progress(f"writing {out_dir / WEIGHTS_FILE} ({str(stored).removeprefix('torch.')})")
    save_file({k: v.to(stored).contiguous() for k, v in tensors.items()}, out_dir / WEIGHTS_FILE)
    shutil.copyfile(tokenizer, out_dir / tokenizer.name)
    card = ModelCard(
        name=name or source.stem, tokenizer=tokenizer.name, eos_token_id=eos,
        dtype=str(stored).removeprefix("torch."),
    )
    write_config(out_dir, config, card)
    progress(f"done: {out_dir}")
    return config


def _check_tokenizer(path: Path, config: ModelConfig) -> int | None:
    from ..tokenizer import load_tokenizer  # the tokenizer module is the one place that reads vocabularies

    try:
        tok = load_tokenizer(path)
    except (OSError, ValueError) as err:
        raise ModelFormatError(f"{path}: {err}") from None
    if tok.vocab_size > config.vocab_size:
        raise ModelFormatError(
            f"{path}: tokenizer has {tok.vocab_size} tokens, more than the model's {config.vocab_size}"
        )
    return tok.eos_token_id


def save_model(model: RWKV7, out_dir: Path, card: ModelCard, tokenizer: Path) -> None:
    """Writes a model directory from a model in memory (the training script's output)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, card.dtype)
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, out_dir / WEIGHTS_FILE)
    if tokenizer.resolve() != (out_dir / card.tokenizer).resolve():
        shutil.copyfile(tokenizer, out_dir / card.tokenizer)
    write_config(out_dir, model.config, card)


def load_model(
    directory: Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
    progress: Progress = _quiet,
) -> tuple[RWKV7, ModelCard]:
    """Reads a model directory into an RWKV7 in eval mode on `device` in `dtype`."""
    directory = Path(directory)
    config, card = read_config(directory)
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        raise ModelFormatError(f"{directory}: no {WEIGHTS_FILE}")
    progress(f"loading {weights}")
    try:
        tensors = load_file(weights)
    except Exception as err:  # safetensors raises its own error types for a damaged file
        raise ModelFormatError(f"{weights}: unreadable ({str(err)[:120]})") from None
    found, tensors = check_tensors(tensors, str(weights))
    if found != config:
        raise ModelFormatError(f"{directory}: config.json says {config}, the weights say {found}")
    if not (directory / card.tokenizer).is_file():
        raise ModelFormatError(f"{directory}: tokenizer file {card.tokenizer!r} is missing")
    with torch.device("meta"):
        model = RWKV7(config)
    model.load_state_dict(tensors, assign=True)
    progress(f"{config.n_layer} layers × {config.n_embd} on {device} in {str(dtype).removeprefix('torch.')}")
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False), card


def save_pth(model: RWKV7, path: Path, dtype: torch.dtype = torch.float32) -> None:
    """Writes a model in BlinkDL's own .pth layout (the reference package reads it); for tests."""
    out = {}
    for key, tensor in model.state_dict().items():
        tensor = tensor.detach().to("cpu", dtype).contiguous()
        name = key.split(".", 2)[-1] if key.startswith("blocks.") else key
        out[key] = tensor.view(1, 1, -1) if name in _VECTOR_SUFFIXES else tensor
    torch.save(out, path)
