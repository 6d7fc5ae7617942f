"""The demo model's corpus: the running CPython's standard library source, tokenized.

Owns which files make the corpus, the train / held-out split, the BPE tokenizer trained on the
train split, the unigram baseline, and the token streams the trainer reads. Never touches the
model (tools/train_demo_model.py does).

Every machine with Python has this corpus without a download, and its licence (the PSF License,
LICENSE.txt beside the files) allows redistributing a model trained on it. The selection is a
pure function of the files: the same CPython version gives the same corpus, which the sha256
figures in corpus.json let anyone check.

    python tools/demo_corpus.py --out .carry/demo

writes into --out:
    tokenizer.json        ByteLevel BPE, --vocab tokens, <|endoftext|> = id 0 (end of text)
    train.npy heldout.npy uint16 token streams: each file's tokens followed by <|endoftext|>
    heldout_excerpt.txt   the first few KB of one held-out file (for the unit test)
    corpus.json           Python version, rules, per-split files / bytes / tokens / sha256,
                          the unigram baseline on the held-out split
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tokenizers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"  # id 0: ends every document
VOCAB_SIZE = 4096
HELDOUT_EVERY = 20  # a file is held out when hash(path) % 20 == 0: 5% of files
EXCERPT_BYTES = 4096

# Folders skipped anywhere on a file's path, and why.
SKIPPED_DIRS = {
    "site-packages": "third-party packages, not the standard library",
    "encodings": "generated codec tables (charmaps), not code anyone writes",
    "pydoc_data": "one generated string of documentation",
    "__pycache__": "bytecode caches",
}
SKIPPED_DIR_PREFIX = "config-"  # the build's Makefile folder (config-3.11-x86_64-linux-gnu)
SKIPPED_FILE_PREFIX = "_sysconfigdata"  # this build's configure values: differ machine to machine
# Also skipped: files that are not valid UTF-8 (a few tests of source encodings, on purpose).
# Kept: the test suites (test/, */tests/, idlelib/idle_test/): ordinary Python, two thirds of the
# text, and a small model overfits less on 29 MB than on 10.


@dataclass(frozen=True)
class Document:
    path: str  # relative to the stdlib root, '/'-separated
    text: str

    @property
    def heldout(self) -> bool:
        """The split, by a stable hash of the path: independent of file order and content."""
        digest = hashlib.sha256(self.path.encode()).hexdigest()
        return int(digest[:8], 16) % HELDOUT_EVERY == 0


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def select_documents(root: Path) -> tuple[list[Document], list[str]]:
    """The corpus's files in sorted path order, and the paths refused for not being UTF-8."""
    documents, refused = [], []
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = path.relative_to(root)
        folders = rel.parts[:-1]
        if any(f in SKIPPED_DIRS or f.startswith(SKIPPED_DIR_PREFIX) for f in folders):
            continue
        if rel.name.startswith(SKIPPED_FILE_PREFIX):
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            refused.append(rel.as_posix())
            continue
        documents.append(Document(rel.as_posix(), text))
    return documents, refused


def manifest_sha256(documents: list[Document]) -> str:
    """sha256 of a `sha256sum`-style listing ("<sha256 of file>  <path>\\n" per file, sorted)."""
    lines = "".join(f"{hashlib.sha256(d.text.encode()).hexdigest()}  {d.path}\n" for d in documents)
    return hashlib.sha256(lines.encode()).hexdigest()


def train_tokenizer(documents: list[Document], vocab_size: int) -> Tokenizer:
    """ByteLevel BPE (every byte representable, so any text encodes), EOS as id 0."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((d.text for d in documents), trainer)
    if tok.token_to_id(EOS) != 0:
        raise RuntimeError(f"{EOS} did not get id 0")
    return tok


def token_stream(tok: Tokenizer, documents: list[Document]) -> np.ndarray:
    """All documents' tokens, each document followed by EOS, as uint16 [n_tokens]."""
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for encoding in tok.encode_batch([d.text for d in documents], add_special_tokens=False):
        ids.extend(encoding.ids)
        ids.append(eos)
    return np.asarray(ids, dtype=np.uint16)


def unigram_nats(train: np.ndarray, targets: np.ndarray, vocab_size: int) -> float:
    """Cross-entropy (nats/token) of `targets` under the train stream's add-one unigram."""
    counts = np.bincount(train, minlength=vocab_size).astype(np.float64) + 1.0
    log_p = np.log(counts / counts.sum())
    return float(-log_p[targets].mean())


def excerpt(documents: list[Document]) -> Document:
    """The first EXCERPT_BYTES of the first held-out file that long, cut at a line end."""
    source = next(d for d in documents if d.heldout and len(d.text.encode()) >= 2 * EXCERPT_BYTES)
    head = source.text.encode()[:EXCERPT_BYTES].decode("utf-8", errors="ignore")
    return Document(source.path, head[: head.rindex("\n") + 1])


def split_figures(documents: list[Document], stream: np.ndarray) -> dict:
    return {
        "files": len(documents),
        "bytes": sum(len(d.text.encode()) for d in documents),
        "tokens": int(stream.size),
        "manifest_sha256": manifest_sha256(documents),
        "tokens_sha256": hashlib.sha256(stream.tobytes()).hexdigest(),
    }


def build(out: Path, vocab_size: int = VOCAB_SIZE, root: Path | None = None) -> dict:
    root = root or stdlib_root()
    documents, refused = select_documents(root)
    train_docs = [d for d in documents if not d.heldout]
    heldout_docs = [d for d in documents if d.heldout]
    tok = train_tokenizer(train_docs, vocab_size)
    train, heldout = token_stream(tok, train_docs), token_stream(tok, heldout_docs)
    sample = excerpt(documents)
    sample_ids = np.asarray(tok.encode(sample.text, add_special_tokens=False).ids)

    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    np.save(out / "train.npy", train)
    np.save(out / "heldout.npy", heldout)
    (out / "heldout_excerpt.txt").write_text(sample.text)
    # The model predicts every held-out token but the first (it starts from a zero state).
    unigram = unigram_nats(train, heldout[1:], vocab_size)
    record = {
        "corpus": "CPython standard library source (.py), PSF License",
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "stdlib_root": str(root),
        "rules": {
            "files": "*.py under the stdlib root, sorted by relative path",
            "skipped_dirs": SKIPPED_DIRS,
            "skipped_dir_prefix": SKIPPED_DIR_PREFIX,
            "skipped_file_prefix": SKIPPED_FILE_PREFIX,
            "refused_not_utf8": refused,
            "heldout": f"int(sha256(relative_path)[:8], 16) % {HELDOUT_EVERY} == 0",
            "document_separator": f"{EOS} (id 0) after every file",
        },
        "tokenizer": {
            "kind": "ByteLevel BPE",
            "library": f"tokenizers {tokenizers.__version__}",
            "vocab_size": tok.get_vocab_size(),
            "trained_on": "train split",
            "eos": EOS,
            "eos_id": 0,
            "sha256": hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest(),
        },
        "train": split_figures(train_docs, train),
        "heldout": split_figures(heldout_docs, heldout),
        "unigram_heldout_nats": unigram,
        "excerpt": {
            "path": sample.path,
            "bytes": len(sample.text.encode()),
            "tokens": int(sample_ids.size),
            "unigram_nats": unigram_nats(train, sample_ids[1:], vocab_size),
        },
    }
    (out / "corpus.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(".carry/demo"))
    parser.add_argument("--vocab", type=int, default=VOCAB_SIZE)
    args = parser.parse_args()
    record = build(args.out, args.vocab)
    for split in ("train", "heldout"):
        s = record[split]
        print(f"{split}: {s['files']} files, {s['bytes']} bytes, {s['tokens']} tokens, "
              f"manifest sha256 {s['manifest_sha256']}")
    bits = record["unigram_heldout_nats"]
    print(f"unigram baseline on held-out: {bits:.4f} nats/token ({bits / math.log(2):.3f} bits)")


if __name__ == "__main__":
    main()
