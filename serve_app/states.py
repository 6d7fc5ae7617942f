"""The ingress's side of /v1/states: check an init state, store it in the registry, wait for replicas.

Owns what may become an init state: a safetensors upload whose tensors fit the model (checked
here, before any replica sees it), or a file named inside the configured states directory (by
file name only: never a path a client chose), among them the config's `init_states`, which an
ingress replica loads as it starts. A load or unload returns once every live replica has applied
it, or reports the replicas that had not within the timeout. Never touches engines.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

from replicas.init_states import InitStateError, state_file_bytes, state_from_bytes
from replicas.model.config import ModelConfig

from .protocol import ApiError, InitStateDeleted, InitStateList, InitStateLoaded, InitStateObject, StateFromFile

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_HEADER_ROOM = 64 << 10  # the safetensors header, beyond the tensors


class StateCatalog:
    def __init__(self, registry, model: ModelConfig, states_dir: Path | None, sync_timeout_s: float):
        self.registry = registry
        self.model = model
        self.states_dir = states_dir.resolve() if states_dir else None
        self.sync_timeout_s = sync_timeout_s

    @property
    def max_bytes(self) -> int:
        """The largest upload accepted: the state in fp64 (twice its fp32 size) and a header."""
        return 2 * self.model.state_bytes() + _HEADER_ROOM

    async def list(self) -> InitStateList:
        version, entries = await self.registry.states.remote()
        return InitStateList(data=[InitStateObject(**e) for e in entries], version=version)

    async def load(self, name: str | None, data: bytes, default: bool) -> InitStateLoaded:
        await self._check(name, data)
        entry, version = await self.registry.put_state.remote(name, data, default)
        acked, pending = await self.registry.wait_acked.remote(version, self.sync_timeout_s)
        return InitStateLoaded(**entry, replicas=len(acked), pending_replicas=pending)

    async def load_file(self, request: StateFromFile) -> InitStateLoaded:
        name, data = await self._read(request)
        return await self.load(name, data, request.default)

    async def load_configured(self, files: list[StateFromFile]) -> None:
        """The config's init states, each unless the catalog has one of its name, without waiting
        for replicas (an ingress replica's start: replicas load them as they start, or as they
        would an upload). A file that does not fit fails the start, naming it."""
        for name, data, default in await self.read_configured(files):
            await self.registry.put_state.remote(name, data, default, if_absent=True)

    async def read_configured(self, files: list[StateFromFile]) -> list[tuple[str, bytes, bool]]:
        """(name, safetensors bytes, default) of each of the config's init states, checked; a
        ValueError naming the first that does not fit (`rwkv-fleet serve` checks before Ray starts)."""
        states = []
        for request in files:
            try:
                name, data = await self._read(request)
                await self._check(name, data)
            except ApiError as err:
                raise ValueError(f"init_states: {request.file}: {err.message}") from None
            states.append((name, data, request.default))
        return states

    async def unload(self, key: str) -> InitStateDeleted:
        entry, version = await self.registry.delete_state.remote(key)
        if entry is None:
            raise ApiError(404, f"init state {key!r} is not loaded", param="init_state", code="init_state_not_found")
        await self.registry.wait_acked.remote(version, self.sync_timeout_s)
        return InitStateDeleted(id=entry["id"])

    async def _check(self, name: str | None, data: bytes) -> None:
        if not name or not _NAME.match(name):
            raise ApiError(400, "name: 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit",
                           param="name")
        if len(data) > self.max_bytes:
            raise ApiError(413, f"an init state for this model is at most {self.max_bytes} bytes", param="file")
        try:
            await asyncio.to_thread(state_from_bytes, data, self.model)
        except InitStateError as err:
            raise ApiError(400, str(err), param="file") from None

    async def _read(self, request: StateFromFile) -> tuple[str, bytes]:
        """(its name, its safetensors bytes): a state-tuned model's .pth is converted here."""
        path = self._file(request.file)
        data = await asyncio.to_thread(path.read_bytes)
        try:
            data = await asyncio.to_thread(state_file_bytes, data, self.model)
        except InitStateError as err:
            raise ApiError(400, str(err), param="file") from None
        return request.name or path.stem, data

    def _file(self, name: str) -> Path:
        """A file directly inside the states directory, by name; anything else is refused."""
        if self.states_dir is None:
            raise ApiError(400, "this server has no states directory: upload the file instead", param="file")
        if not name or "/" in name or "\\" in name or name.startswith(".") or "\0" in name:
            raise ApiError(400, "file: a file name inside the states directory, not a path", param="file")
        path = (self.states_dir / name).resolve()
        if path.parent != self.states_dir or not path.is_file():
            raise ApiError(404, f"no init state file {name!r} in the states directory", param="file",
                           code="init_state_not_found")
        return path
