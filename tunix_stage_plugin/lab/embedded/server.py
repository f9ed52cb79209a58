"""The trainer's gRPC service: a generic method call (method name + pickled arguments), as tunix's.

The server's event loop only moves messages: it never copies a payload, unpickles one, places it
or waits for the device. Each method runs on its core.executor lane (compute, staging or inline),
and a large call's unpickling runs on that lane too (work on the loop delays every other call:
measured, a ping waits 452 ms behind a 0.5 s handler run there). A large call's bytes arrive on
the bulk channel (transport/listener.py), received by its own threads into pooled aligned buffers.

A large call is refused by its header, before any of its bytes are read: more buffers than a call
may carry or more than `max_call_bytes` announced, or a bulk frame whose sizes differ from the
header's; a header whose frame never begins fails after the bulk channel's own wait, and only
the call that announced a transfer id ever ends it (docs/embedded.md "Limits of one call",
"Limits of the bulk channel").

Binds 127.0.0.1 only: the calls are pickles, trusted because they come from this machine.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import grpc

from tunix_stage_plugin.core import buffers as buffers_lib
from tunix_stage_plugin.core import executor as executor_lib
from tunix_stage_plugin.core.telemetry import recorder as recorder_lib
from tunix_stage_plugin.core import tracks
from tunix_stage_plugin.lab.embedded import wire
from tunix_stage_plugin.transport import frames
from tunix_stage_plugin.transport import listener as listener_lib

log = logging.getLogger("tunix_stage_plugin.lab.embedded")

BIND_HOST = "127.0.0.1"
DEFAULT_MAX_CALL_BYTES = 4096 << 20

# The clients ping (WorkerClient's keepalive) to notice a trainer that stopped answering; accept
# those pings at any rate down to one a second, with or without calls in flight.
PING_POLICY = [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
    ("grpc.http2.max_ping_strikes", 0),
]


class ServedWorker(Protocol):
  """What the server needs from the object it serves."""

  METHODS: frozenset[str]  # the callable method names; anything else is refused by name


class WorkerServer:
  """Serves one worker's METHODS on 127.0.0.1, each on its executor lane."""

  def __init__(self, worker: ServedWorker, executor: executor_lib.MethodExecutor, *,
               timeline: recorder_lib.Recorder | None = None,
               max_call_bytes: int = DEFAULT_MAX_CALL_BYTES,
               pool: buffers_lib.HostBufferPool | None = None) -> None:
    if not max_call_bytes > 0:
      raise ValueError(f"max_call_bytes must be > 0; got {max_call_bytes!r}")
    self._worker = worker
    self.max_call_bytes = max_call_bytes
    self._executor = executor
    self._timeline = timeline or recorder_lib.Recorder()
    self.pool = pool or buffers_lib.HostBufferPool()  # where large calls' bytes are received
    self._transfers = listener_lib.Transfers()
    self._bulk = listener_lib.BulkListener(self.pool, self._transfers, host=BIND_HOST)
    self._server: grpc.aio.Server | None = None
    self.port: int | None = None

  async def start(self, port: int = 0) -> int:
    """Starts serving; `port=0` picks a free port. Returns the bound port."""
    if not isinstance(port, int) or not 0 <= port <= 65535:
      raise ValueError(f"port must be an int in 0..65535 (0: any free port); got {port!r}")
    # grpc sets SO_REUSEPORT by default: a second trainer would then "bind" a port in use and
    # share its connections. Refuse instead.
    server = grpc.aio.server(
        options=[*wire.grpc_options(), *PING_POLICY, ("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(wire.SERVICE, {
        "Call": grpc.unary_unary_rpc_method_handler(self._call),
        "CallBulk": grpc.unary_unary_rpc_method_handler(self._call_bulk),
        "BulkPort": grpc.unary_unary_rpc_method_handler(self._bulk_port),
    }),))
    try:
      bound = server.add_insecure_port(f"{BIND_HOST}:{port}")
    except RuntimeError as e:  # grpcio's way of saying the bind failed
      raise OSError(f"could not bind {BIND_HOST}:{port}: in use or not available ({e})") from None
    self._bulk.start()
    try:
      await server.start()
    except BaseException:
      self._bulk.close()
      raise
    self._server, self.port = server, bound
    return bound

  async def stop(self, grace: float = 1.0) -> None:
    if self._server is not None:
      server, self._server = self._server, None
      self._bulk.close()  # no new bytes; calls already received run on their lanes
      await server.stop(grace)

  def _method(self, name: str) -> Any:
    if name not in self._worker.METHODS:
      raise AttributeError(f"unknown method {name!r}; accepted: {sorted(self._worker.METHODS)}")
    return getattr(self._worker, name)

  async def _call(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    method = "?"
    try:
      method, args, kwargs = wire.decode_unary(request)  # small by construction: fine on the loop
      fn = self._method(method)
      return wire.encode_reply(await self._executor.run(method, fn, *args, **kwargs))
    except Exception as e:  # pylint: disable=broad-except  (travels back to the caller)
      log.debug("call %s failed: %s: %s", method, type(e).__name__, e)
      return wire.encode_error(e)

  async def _bulk_port(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return frames.announcement(self._bulk.port, self._bulk.limits)

  async def _call_bulk(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    method = "?"
    try:
      header = wire.decode_header(request)  # a few hundred bytes: fine on the loop
      method = header["method"]
      try:
        fn = self._method(method)
        announced = wire.announced_bytes(header, self.max_call_bytes)
      except Exception:
        self._transfers.refuse(header["transfer"])  # its frame is dropped when it comes
        raise
      received = await self._transfers.receive(header["transfer"], header["sizes"])
      self._timeline.add(tracks.TRAINER_RECEIVE, method, received.started, received.ended,
                         bytes=announced, transport="side")
      buffers = received.buffers
      del received

      def run() -> Any:
        args, kwargs = wire.decode_bulk(header, buffers)
        buffers.clear()  # the arrays over them are all that is kept
        return fn(*args, **kwargs)

      return wire.encode_reply(await self._executor.run(method, run))
    except Exception as e:  # pylint: disable=broad-except  (travels back to the caller)
      log.debug("bulk call %s failed: %s: %s", method, type(e).__name__, e)
      return wire.encode_error(e)
