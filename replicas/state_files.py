"""The prefix cache's disk tier: snapshots as files in a directory, written off the engine's thread.

A snapshot that the host tier evicts goes here instead of away, while the disk budget holds it
(state_cache.py keeps the books: which prefix, which tier, LRU order); a hit reads it back. A file
is one snapshot in safetensors: the state's three tensors, the logits and the prefix's tokens,
with the model's fingerprint and the cache namespace in its metadata. So the files outlive the
process: an engine that starts on a directory its model wrote takes the files back (`adopt`), and
a conversation's next turn after a restart starts from its state.

- Writing: one thread, a queue of at most WRITE_QUEUE snapshots. The engine's thread hands a
  snapshot over and goes on; one that finds the queue full is not kept, as every evicted snapshot
  was before this tier. A file is written under a temporary name and renamed once whole, so no
  crash leaves half a file under a snapshot's name.
- Reading: `read_later` on a thread of its own, so that a request waits for its state's file while
  the other rows go on (the engine admits it once read); `read` where the state is needed now.
- The files are written and read here rather than by the safetensors package, whose calls hold
  Python's lock for the whole copy: a file's bytes go in one write or readinto call, which lets
  the engine's thread run meanwhile. They are safetensors files all the same.
- Several engines on one machine may name the same directory: each takes the first numbered
  subdirectory that no live process holds (an flock on its `lock` file, which the kernel lets go
  when the process ends), so a replica that restarts takes back what an ended one left.
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import json
import logging
import os
import queue
import shutil
import struct
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from .model.state import RNNState

if TYPE_CHECKING:
    from .state_cache import Snapshot

log = logging.getLogger(__name__)

FORMAT = "rwkv-fleet-snapshot/1"
WRITE_QUEUE = 8  # snapshots waiting to be written, at most (each holds its host memory until then)
SUFFIX = ".safetensors"
_STATE = ("att_shift", "ffn_shift", "wkv")


class DiskTierError(OSError):
    """The disk tier's directory cannot be used; the message is one line for a user."""


@dataclass(eq=False)
class StateFile:
    """One snapshot's file. `written`: whole on disk under `path`; `discarded`: not wanted any
    more (deleted once written)."""

    path: Path
    nbytes: int  # what it counts against the budget: the snapshot's bytes and its tokens'
    written: bool = False
    discarded: bool = False


class DiskTier:
    """Files of one model's snapshots in `directory` (None: a temporary directory, removed by
    close). `fingerprint` names the model; files of another are left alone. `pin`: files are read
    into page-locked memory (for a CUDA device: their copy there then does not hold up the host)."""

    def __init__(self, directory: Path | None, fingerprint: str, pin: bool = False):
        self.fingerprint = fingerprint
        self.pin = pin
        self.temporary = directory is None
        if directory is None:
            self.directory = Path(tempfile.mkdtemp(prefix="rwkv-fleet-states-"))
            self._lock_file = None
        else:
            self.directory, self._lock_file = _claim(Path(directory).expanduser())
        self._queue: queue.Queue = queue.Queue(maxsize=WRITE_QUEUE)
        self._lock = threading.Lock()  # a file's written/discarded flags, and the finished list
        self._finished: list[StateFile] = []
        self._stamp = 0  # the last write's order (ns): the files are taken back in it
        self._writer = threading.Thread(target=self._write_loop, name="rwkv-state-files", daemon=True)
        self._writer.start()
        self._reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rwkv-state-reads")

    def adopt(self) -> list[tuple[str, tuple[int, ...], StateFile]]:
        """(namespace, tokens, file) of every whole file this model wrote here, in the order they
        were queued. Temporary files of writes that a crash cut short are removed."""
        found = []
        for path in self.directory.glob("*.tmp"):
            path.unlink(missing_ok=True)
        for path in self.directory.glob(f"*{SUFFIX}"):
            try:
                with open(path, "rb") as f:
                    header, meta, begin = _header(f)
                    if meta.get("format") != FORMAT or meta.get("model") != self.fingerprint:
                        continue
                    lo, hi = header["tokens"]["data_offsets"]
                    f.seek(begin + lo)
                    tokens = tuple(np.frombuffer(f.read(hi - lo), dtype="<i4").tolist())
                nbytes = sum(end - start for start, end in (header[name]["data_offsets"] for name in _NAMES))
                found.append((int(meta.get("queued_ns", 0)), meta.get("namespace", ""), tokens,
                              StateFile(path, nbytes, written=True)))
            except Exception as err:  # a damaged or foreign file: not this tier's
                log.warning("disk tier: skipping %s (%s)", path, str(err)[:120])
        found.sort(key=lambda item: item[0])
        return [(namespace, tokens, file) for _, namespace, tokens, file in found]

    def write(self, name: str, namespace: str, tokens: Sequence[int], snapshot: Snapshot,
              block: bool = False) -> StateFile | None:
        """Queues the snapshot's file (`name`: unique per prefix); None when the queue is full
        (unless `block`: then waits for room). The snapshot's tensors must stay as they are until
        finished() returns the file."""
        file = StateFile(self.directory / f"{name}{SUFFIX}", file_bytes(snapshot, tokens))
        self._stamp = max(time.time_ns(), self._stamp + 1)  # (a file's mtime may tie with the last one's)
        try:
            self._queue.put((file, namespace, tuple(tokens), snapshot, self._stamp), block=block)
        except queue.Full:
            return None
        return file

    def read(self, file: StateFile) -> Snapshot:
        """The snapshot in a written file, in host memory."""
        from .state_cache import Snapshot  # noqa: PLC0415 - (state_cache imports this module)

        with open(file.path, "rb") as f:
            header, _, begin = _header(f)
            data = torch.empty(os.fstat(f.fileno()).st_size - begin, dtype=torch.uint8, pin_memory=self.pin)
            f.readinto(data.numpy())  # (one call, without Python's lock)
        tensors = []
        for name in (*_STATE, "logits"):
            entry = header[name]
            lo, hi = entry["data_offsets"]
            tensors.append(data[lo:hi].view(_TORCH[entry["dtype"]]).view(entry["shape"]))
        return Snapshot(RNNState(*tensors[:3]), tensors[3])

    def read_later(self, file: StateFile) -> concurrent.futures.Future:
        """`read(file)` on the reading thread."""
        return self._reader.submit(self.read, file)

    def discard(self, file: StateFile) -> None:
        """The file is not wanted: deleted now, or by the writer once it is written."""
        with self._lock:
            file.discarded = True
            if file.written:
                file.path.unlink(missing_ok=True)
                file.written = False

    def finished(self) -> list[StateFile]:
        """The files whose writes ended since the last call (their snapshots may be let go)."""
        with self._lock:
            done, self._finished = self._finished, []
        return done

    def flush(self) -> None:
        """Returns once every write queued has ended."""
        self._queue.join()

    def close(self) -> None:
        """Waits for the writes queued, then lets the directory go (a temporary one is removed)."""
        self._queue.put((None, "", (), None, 0))
        self._writer.join()
        self._reader.shutdown(wait=True)
        if self.temporary:
            shutil.rmtree(self.directory, ignore_errors=True)
        elif self._lock_file is not None:
            self._lock_file.close()  # (releases the flock)
            self._lock_file = None

    def _write_loop(self) -> None:
        while True:
            file, namespace, tokens, snapshot, stamp = self._queue.get()
            if file is None:
                return
            try:
                self._write(file, namespace, tokens, snapshot, stamp)
            finally:
                self._queue.task_done()

    def _write(self, file: StateFile, namespace: str, tokens: tuple[int, ...], snapshot: Snapshot,
               stamp: int) -> None:
        written = False
        if not file.discarded:
            try:
                snapshot.wait()
                arrays = [t.numpy() for t in snapshot.tensors()] + [np.asarray(tokens, dtype="<i4")]
                temporary = file.path.with_suffix(".tmp")
                _write_file(temporary, dict(zip(_NAMES, arrays, strict=True)),
                            {"format": FORMAT, "model": self.fingerprint, "namespace": namespace,
                             "queued_ns": str(stamp)})
                os.replace(temporary, file.path)
                written = True
            except Exception as err:  # the disk full, the directory gone: the snapshot is not kept
                log.warning("disk tier: writing %s failed: %s", file.path.name, err)
        with self._lock:
            file.written = written
            if file.discarded and written:
                file.path.unlink(missing_ok=True)
                file.written = False
            self._finished.append(file)


def file_bytes(snapshot: Snapshot, tokens: Sequence[int]) -> int:
    """What a snapshot's file counts against the disk budget: its tensors' bytes and its tokens'."""
    return snapshot.nbytes + 4 * len(tokens)


_NAMES = (*_STATE, "logits", "tokens")
_DTYPES = {"float32": "F32", "float16": "F16", "int32": "I32", "int64": "I64"}
_TORCH = {"F32": torch.float32, "F16": torch.float16, "I32": torch.int32, "I64": torch.int64}


def _write_file(path: Path, arrays: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    """A safetensors file: the header's length (8 bytes, little-endian), its JSON (padded to 8
    bytes), then each array's bytes in order."""
    header: dict = {"__metadata__": metadata}
    at = 0
    for name, a in arrays.items():
        header[name] = {"dtype": _DTYPES[a.dtype.name], "shape": list(a.shape), "data_offsets": [at, at + a.nbytes]}
        at += a.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for a in arrays.values():
            f.write(memoryview(np.ascontiguousarray(a)).cast("B"))  # (without Python's lock)


def _header(f) -> tuple[dict, dict, int]:
    """A safetensors file's header, its metadata, and where its data begins."""
    (length,) = struct.unpack("<Q", f.read(8))
    if length > 1 << 26:
        raise ValueError(f"a header of {length} bytes")
    header = json.loads(f.read(length))
    return header, header.pop("__metadata__", {}), 8 + length


def _claim(root: Path) -> tuple[Path, object]:
    """The first subdirectory root/0, root/1, ... that no live process holds, now held by this
    one (an exclusive flock on its lock file, kept open until close)."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        for i in range(1 << 16):
            directory = root / str(i)
            directory.mkdir(exist_ok=True)
            lock = open(directory / "lock", "a")  # noqa: SIM115 - held open: the flock lives with it
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock.close()
                continue
            return directory, lock
    except OSError as err:
        raise DiskTierError(f"disk cache directory {root}: {err.strerror or err}") from None
    raise DiskTierError(f"disk cache directory {root}: every subdirectory is held")
