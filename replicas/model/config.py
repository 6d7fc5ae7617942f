"""The shape of an RWKV-7 model, read from its tensors, and the project's config.json.

Every size comes from a tensor's shape (never from a ratio such as FFN = 4·C), because
community checkpoints and the project's own demo model use shapes the released models don't.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from torch import Tensor

FORMAT = "rwkv-fleet/1"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


class ModelFormatError(ValueError):
    """A checkpoint or model directory that cannot be used; the message is one line for a user."""


@dataclass(frozen=True)
class ModelConfig:
    n_layer: int
    n_embd: int
    head_size: int
    vocab_size: int
    ffn_dim: int
    w_lora: int
    a_lora: int
    v_lora: int
    g_lora: int

    @property
    def n_head(self) -> int:
        return self.n_embd // self.head_size

    def state_bytes(self) -> int:
        """Bytes of one sequence's state: two fp32 shifts [C] and an fp32 wkv [H, N, N] per layer."""
        per_layer = 2 * self.n_embd + self.n_head * self.head_size * self.head_size
        return 4 * self.n_layer * per_layer

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor]) -> ModelConfig:
        """Reads every size from shapes of a (BlinkDL-named) state dict."""
        try:
            vocab, n_embd = tensors["emb.weight"].shape
            r_k = tensors["blocks.0.att.r_k"]
            head_size = r_k.shape[-1]
            n_layer = 1 + max(int(k.split(".")[1]) for k in tensors if k.startswith("blocks."))
            ffn_dim = tensors["blocks.0.ffn.key.weight"].shape[0]
            rank = {n: tensors[f"blocks.0.att.{n}1"].shape[-1] for n in "wavg"}
            if n_layer > 1:  # layer 0's v1 is unused and may be any size; layer 1 is authoritative
                rank["v"] = tensors["blocks.1.att.v1"].shape[-1]
        except KeyError as missing:
            raise ModelFormatError(f"missing tensor {missing.args[0]!r}") from None
        return cls(
            n_layer=n_layer,
            n_embd=int(n_embd),
            head_size=int(head_size),
            vocab_size=int(vocab),
            ffn_dim=int(ffn_dim),
            w_lora=int(rank["w"]),
            a_lora=int(rank["a"]),
            v_lora=int(rank["v"]),
            g_lora=int(rank["g"]),
        )


@dataclass(frozen=True)
class ModelCard:
    """What config.json holds besides the shapes: identity and the tokenizer beside the weights."""

    name: str
    tokenizer: str  # file name inside the model directory
    eos_token_id: int | None
    dtype: str  # dtype the weights are stored in


def write_config(directory: Path, config: ModelConfig, card: ModelCard) -> None:
    body = {"format": FORMAT, "architecture": "rwkv7", **asdict(card), **asdict(config)}
    (directory / CONFIG_FILE).write_text(json.dumps(body, indent=2) + "\n")


def read_config(directory: Path) -> tuple[ModelConfig, ModelCard]:
    """Reads config.json; the shapes in it are checked against the weights by the loader."""
    path = directory / CONFIG_FILE
    if not directory.is_dir():
        raise ModelFormatError(f"{directory}: not a model directory")
    if not path.is_file():
        raise ModelFormatError(f"{directory}: no {CONFIG_FILE} (convert a .pth with `rwkv-fleet convert`)")
    try:
        body = json.loads(path.read_text())
        if body.get("format") != FORMAT:
            raise ModelFormatError(f"{path}: format {body.get('format')!r}, expected {FORMAT!r}")
        config = ModelConfig(**{k: int(body[k]) for k in ModelConfig.__dataclass_fields__})
        card = ModelCard(**{k: body[k] for k in ModelCard.__dataclass_fields__})
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        if isinstance(err, ModelFormatError):
            raise
        raise ModelFormatError(f"{path}: malformed config ({err})") from None
    return config, card
