"""The trainer's gRPC service: a generic method call, as tunix's, on the production wire: a call is
the request tunix's host sends (transport/wire.py), a large one the bulk format with its bytes on
the bulk channel, and a failure answers in tunix's error envelope, which the client reads with
core/contract.py (`unwrap`, `RemoteError`).

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

import dataclasses
import logging
import pickle
import traceback
from typing import Any, Protocol

import grpc

from tunix_stage_plugin.transport import listener as buffers_lib
from tunix_stage_plugin.core import executor as executor_lib
from tunix_stage_plugin.core import tracks
from tunix_stage_plugin.core.telemetry import recorder as recorder_lib
from tunix_stage_plugin.transport import wire
from tunix_stage_plugin.transport import listener as listener_lib

log = logging.getLogger("tunix_stage_plugin.lab.embedded")

BIND_HOST = "127.0.0.1"
DEFAULT_MAX_CALL_BYTES = 4096 << 20
CAP_SETTING = "trainer_main --max_call_mib"

SERVICE = "tunix_stage.EmbeddedWorker"
CALL = f"/{SERVICE}/Call"  # a small call whole (request.encode_whole)
CALL_BULK = f"/{SERVICE}/CallBulk"  # a bulk call's header; its bytes come on the bulk channel
BULK_PORT = f"/{SERVICE}/BulkPort"  # () -> wire.announcement
# One message is a header, a small call or a reply; the cap leaves room for a header but refuses
# the multi-GB single messages the bulk channel exists to avoid.
MAX_MESSAGE_BYTES = 16 << 20

# The clients ping (WorkerClient's keepalive) to notice a trainer that stopped answering; accept
# those pings at any rate down to one a second, with or without calls in flight.
PING_POLICY = [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
    ("grpc.http2.max_ping_strikes", 0),
]


def grpc_options() -> list[tuple[str, int]]:
  return [
      ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
      ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
  ]


@dataclasses.dataclass
class Reply:
  """A call's answer: the fields of tunix's ExecutionResponse that contract.unwrap reads."""

  result: Any = None
  error_message: str | None = None
  error_type: str | None = None
  traceback: str | None = None


def encode_reply(result: Any) -> bytes:
  message = pickle.dumps(Reply(result), protocol=5)
  if len(message) > MAX_MESSAGE_BYTES:
    raise wire.WireError(f"reply of {len(message)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte "
                           "message cap; methods return small results")
  return message


def encode_error(error: Exception) -> bytes:
  """`error` as tunix's handler answers one (contract.unwrap raises it as a RemoteError)."""
  return pickle.dumps(Reply(error_message=str(error), error_type=type(error).__name__,
                            traceback="".join(traceback.format_exception(error))), protocol=5)


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
        options=[*grpc_options(), *PING_POLICY, ("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
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
      _, method, args, kwargs = wire.decode(request)  # small by construction: on the loop
      fn = self._method(method)
      return encode_reply(await self._executor.run(method, fn, *args, **kwargs))
    except Exception as e:  # pylint: disable=broad-except  (travels back to the caller)
      log.debug("call %s failed: %s: %s", method, type(e).__name__, e)
      return encode_error(e)

  async def _bulk_port(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return wire.announcement(self._bulk.port, self._bulk.limits)

  async def _call_bulk(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    method = "?"
    try:
      header = wire.decode_header(request)  # a few hundred bytes: fine on the loop
      method = header.method
      try:
        fn = self._method(method)
        announced = wire.announced_bytes(header, self.max_call_bytes, CAP_SETTING)
      except Exception:
        self._transfers.refuse(header.transfer)  # its frame is dropped when it comes
        raise
      received = await self._transfers.receive(header.transfer, header.sizes)
      self._timeline.add(tracks.TRAINER_RECEIVE, method, received.started, received.ended,
                         bytes=announced, transport="side")
      buffers = received.buffers
      del received

      def run() -> Any:
        _, _, args, kwargs = wire.decode_received(header, buffers)
        buffers.clear()  # the arrays over them are all that is kept
        return fn(*args, **kwargs)

      return encode_reply(await self._executor.run(method, run))
    except Exception as e:  # pylint: disable=broad-except  (travels back to the caller)
      log.debug("bulk call %s failed: %s: %s", method, type(e).__name__, e)
      return encode_error(e)
