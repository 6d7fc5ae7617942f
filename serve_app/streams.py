"""The ingress's side of a generation: one OpenAI request -> one replica stream per choice.

Owns calling the replica deployment (a streaming handle call per choice, over gRPC), turning a
refusal or a Ray failure into an `ApiError`, merging the choices' chunks in arrival order, and
cancelling every call when the caller leaves (a disconnected client must free its rows). Never
touches HTTP or response shapes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence

from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, RequestCancelledError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from replicas.deployment import Chunk, ReplicaError
from replicas.engine import Request

from .protocol import ApiError, busy

log = logging.getLogger("ray.serve.rwkv_fleet")

# A replica call streams over gRPC, from the ingress straight to the replica's own server, pickled
# by the standard pickle (what crosses are plain classes that import): not as a Ray actor task whose
# streamed items each take Ray's object path, with a serializer thread in the replica. Measured with
# the proxy's calls over gRPC too (serve_app/config.py, CONTROLLER_ENV_VARS; docs/serving.md).
REPLICA_CALL = {"stream": True, "_by_reference": False, "request_serialization": "pickle",
                "response_serialization": "pickle"}


class ChoiceStreams:
    """The replica streams of one request, after each accepted it; iterate for (choice, chunk)."""

    def __init__(self, calls: list[DeploymentResponseGenerator]):
        self._calls = calls

    @classmethod
    async def open(cls, replica: DeploymentHandle, requests: Sequence[Request]) -> ChoiceStreams:
        """Starts every choice; raises ApiError (and cancels the rest) if any is refused. The first
        starts alone, the others once a replica has accepted it: the router has recorded by then
        where its prompt went, so that the choices of one prompt follow it there and prefill it
        once (the engine's wait for a prompt being prefilled; docs/serving.md, "Requests that
        share a prompt"). Started together, their routings raced that record."""
        def start(request: Request) -> DeploymentResponseGenerator:
            return replica.options(**REPLICA_CALL).generate.remote(request)

        streams = cls([start(requests[0])])
        try:
            firsts = [await _next(streams._calls[0])]
            if len(requests) > 1 and firsts[0] is not None and not firsts[0].error:
                streams._calls += [start(r) for r in requests[1:]]
                firsts += await asyncio.gather(*(_next(call) for call in streams._calls[1:]))
        except BaseException:
            streams.cancel()
            raise
        for chunk in firsts:
            if chunk is None or chunk.error:
                streams.cancel()
                raise _api_error(chunk.error if chunk else ReplicaError(500, "the replica ended the stream at once"))
        return streams

    async def __aiter__(self) -> AsyncIterator[tuple[int, Chunk]]:
        try:
            if len(self._calls) == 1:
                async for chunk in _chunks(self._calls[0]):
                    yield 0, chunk
            else:
                async for item in _merged(self._calls):
                    yield item
        finally:
            self.cancel()

    def cancel(self) -> None:
        """Cancels every call still running (their replicas cancel the rows)."""
        for call in self._calls:
            try:
                call.cancel()
            except Exception:  # noqa: S110 - Serve re-raises a failed call's error (e.g. back-pressure) here
                pass


async def _next(call: DeploymentResponseGenerator) -> Chunk | None:
    try:
        return await anext(call)
    except StopAsyncIteration:
        return None
    except Exception as err:
        raise _ray_error(err) from None


async def _chunks(call: DeploymentResponseGenerator) -> AsyncIterator[Chunk]:
    """A call's chunks after the first; a call that fails mid-stream ends with an error chunk."""
    try:
        async for chunk in call:
            yield chunk
    except (RequestCancelledError, asyncio.CancelledError):
        raise
    except Exception as err:
        e = _ray_error(err)
        yield Chunk(finish_reason="error", error=ReplicaError(e.status, e.message, e.code))


async def _merged(calls: list[DeploymentResponseGenerator]) -> AsyncIterator[tuple[int, Chunk]]:
    queue: asyncio.Queue[tuple[int, Chunk | None]] = asyncio.Queue()

    async def pump(index: int, call: DeploymentResponseGenerator) -> None:
        try:
            async for chunk in _chunks(call):
                await queue.put((index, chunk))
        finally:
            await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, call)) for i, call in enumerate(calls)]
    try:
        running = len(tasks)
        while running:
            index, chunk = await queue.get()
            if chunk is None:
                running -= 1
            else:
                yield index, chunk
    finally:
        for task in tasks:
            task.cancel()


def _api_error(error: ReplicaError) -> ApiError:
    return ApiError(error.status, error.message, code=error.code, retry_after=error.retry_after,
                    param="init_state" if error.code == "init_state_not_found" else None)


def _ray_error(err: Exception) -> ApiError:
    if isinstance(err, BackPressureError):
        return busy(err.retry_after_s)
    if isinstance(err, RayActorError | DeploymentUnavailableError):
        return ApiError(503, "no model replica could take the request; try again shortly", code="unavailable",
                        retry_after=2.0)
    log.error("replica call failed: %r", err)
    return ApiError(500, "internal error in a model replica", code="internal_error")
