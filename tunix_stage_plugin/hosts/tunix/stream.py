"""Calls that carry a micro-batch: the bulk side channel (side.py), else, over tunix's message cap,
a chunked gRPC client stream on the trainer's own server port, else tunix's own call.

tunix's channels and servers refuse any message over `remote_execution._MAX_MESSAGE_BYTES`
(128 MiB), so a larger micro-batch could not train at all: not staged, not inline, not as a
fallback. With staging installed:

- Trainer: every GrpcRemoteExecutionServer also serves `/tunix_stage.ExecutionStream/Execute`
  on the port it binds (no new port). The handler is added to the grpc.aio server tunix creates
  in `start_serving_async` before tunix starts it (grpc takes handlers only before start), by a
  `_server` property that sees the assignment while our `start_serving_async` wrapper runs. It
  receives the call in chunks into the installation's HostBufferPool (chunked.py), then runs it
  through the server's `execute_request`, so exactly as a unary call (the executor's lanes), and
  answers tunix's ExecutionResponse.
- Orchestrator: `invoke` measures a call to a gRPC handle out of band (its pickle plus its
  arrays' bytes, no copy). One carrying at least side.MIN_BYTES goes over the trainer's side
  channel when it has one; else one over the cap goes through the stream on a grpc.aio channel of
  its own to the trainer handle's address, with tunix's channel options and the handle's
  deadline; any other call is the host's own `_invoke_worker`, byte for byte. `train_step` is the
  host's train_step unless its fwd_bwd takes one of those paths; `per_token_logps` (a micro-batch
  to the reference worker, whose server serves both too) likewise. A trainer without the stream
  (no plugin there, or staging off there) answers UNIMPLEMENTED, which becomes one line
  (PayloadOverCap) naming the cap, the size and the setting that helps.

docs/tunix.md, "Which path a call takes" and "Micro-batches over tunix's message cap".
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
import traceback
import weakref
from typing import Any

import grpc
from tunix.experimental.common import datatypes
from tunix.experimental.worker import remote_execution

from tunix_stage_plugin.core import patching
from tunix_stage_plugin.hosts.tunix import chunked
from tunix_stage_plugin.hosts.tunix import installation as installation_lib
from tunix_stage_plugin.hosts.tunix import side as side_lib

MIB = chunked.MIB
# The server whose start_serving_async is running in this context (its grpc server gets the
# stream's handler when tunix assigns it).
_starting: contextvars.ContextVar[Any] = contextvars.ContextVar("tunix_stage_starting_server",
                                                                default=None)


def message_cap() -> int:
  """tunix's cap on one message, read at call time (as tunix's `_grpc_options` reads it)."""
  return remote_execution._MAX_MESSAGE_BYTES  # pylint: disable=protected-access


class PayloadOverCap(RuntimeError):
  """A call over tunix's message cap met a trainer that cannot take it in chunks; one line."""


# ---------------------------------------------------------------- trainer side


def _stream_handler(inst: installation_lib.Installation, server: Any) -> Any:
  server_ref = weakref.ref(server)  # the grpc server holds the handler; the handler not the server

  async def execute_stream(request_iterator: Any, context: Any) -> bytes:
    async def accept() -> None:  # the header passed: the client sends the chunks now
      await context.send_initial_metadata(((chunked.READY_KEY, chunked.READY),))

    try:
      request_id, method_name, args, kwargs = await chunked.receive(
          request_iterator, inst.pool, inst.max_stream_bytes, accept)
      request = remote_execution.ExecutionRequest(request_id=request_id, method_name=method_name,
                                                  args=args, kwargs=kwargs)
      del args, kwargs
      inst.chunked_calls[method_name] += 1
      serving = server_ref()
      if serving is None:
        raise RuntimeError("the server this stream belongs to is gone")
      response = await serving.execute_request(request)  # as a unary call: the executor's lanes
    except Exception as e:  # pylint: disable=broad-except  (travels back, as tunix's handler does)
      response = remote_execution.ExecutionResponse(error_message=str(e),
                                                    error_type=type(e).__name__,
                                                    traceback=traceback.format_exc())
    return response.serialize()

  return grpc.method_handlers_generic_handler(chunked.SERVICE, {
      chunked.METHOD_NAME: grpc.stream_unary_rpc_method_handler(execute_stream),
  })


def apply_server(registry: patching.PatchRegistry, inst: installation_lib.Installation,
                 grpc_server_cls: type) -> None:
  original_start = grpc_server_cls.__dict__["start_serving_async"]

  def get_server(self: Any) -> Any:
    return self.__dict__.get("_server")

  def set_server(self: Any, value: Any) -> None:
    self.__dict__["_server"] = value
    if value is not None and _starting.get() is self:  # tunix made it and has not started it yet
      value.add_generic_rpc_handlers((_stream_handler(inst, self),))
      inst.streaming_servers.add(self)

  @functools.wraps(original_start)
  async def start_serving_async(self: Any, *args: Any, **kwargs: Any) -> Any:
    token = _starting.set(self)
    try:
      result = await original_start(self, *args, **kwargs)
    finally:
      _starting.reset(token)
    if self in inst.streaming_servers and inst.serve_side_channel:
      side_lib.start(inst, self)  # started with tunix's server; stop_serving closes it (server.py)
    return result

  registry.set(grpc_server_cls, "_server", property(get_server, set_server))
  registry.set(grpc_server_cls, "start_serving_async", start_serving_async)


# ---------------------------------------------------------------- orchestrator side


def address_of(handle: remote_execution.GrpcRemoteActorHandle) -> str:
  """HOST:PORT, what tunix's handle dials (it strips the same scheme)."""
  return handle.target_address.replace("grpc://", "", 1)


class StreamClient:
  """The chunked stream to one trainer: a grpc.aio channel beside the trainer handle's own."""

  def __init__(self, handle: remote_execution.GrpcRemoteActorHandle) -> None:
    self.address = address_of(handle)  # with the handle's deadline
    self.timeout = handle._rpc_timeout_s  # pylint: disable=protected-access
    self._loop: asyncio.AbstractEventLoop | None = None
    self._channel: Any = None
    self._rpc: Any = None

  def _call(self) -> Any:
    loop = asyncio.get_running_loop()
    if self._rpc is None or self._loop is not loop:  # aio channels belong to their loop
      self._loop = loop
      options = remote_execution._grpc_options()  # pylint: disable=protected-access
      self._channel = grpc.aio.insecure_channel(self.address, options=options)
      self._rpc = self._channel.stream_unary(
          chunked.METHOD, response_deserializer=remote_execution.ExecutionResponse.deserialize)
    return self._rpc

  async def call(self, encoded: chunked.EncodedRequest) -> Any:
    """Sends `encoded` in chunks; the result, or the host's RuntimeError envelope for an error."""
    calls: list[Any] = []

    async def accepted() -> bool:  # the trainer's answer to the header
      metadata = await calls[0].initial_metadata()
      return metadata.get(chunked.READY_KEY) == chunked.READY

    calls.append(self._call()(encoded.send(accepted), timeout=self.timeout))
    try:
      response = await calls[0]
    except grpc.aio.AioRpcError as e:
      if e.code() == grpc.StatusCode.UNIMPLEMENTED:
        raise PayloadOverCap(over_cap_line(encoded, self.address)) from None
      raise
    return response.unwrap()

  async def close(self) -> None:
    channel, loop = self._channel, self._loop
    self._channel = self._rpc = self._loop = None
    if channel is not None and loop is asyncio.get_running_loop():
      await channel.close()


def over_cap_line(encoded: chunked.EncodedRequest, address: str) -> str:
  return (f"tunix-stage: a {encoded.method} call carrying {encoded.nbytes / MIB:.1f} MiB is over "
          f"tunix's {message_cap() / MIB:.0f} MiB message cap "
          f"(remote_execution._MAX_MESSAGE_BYTES) and the trainer at {address} cannot take it "
          "in chunks (tunix-stage-plugin is not installed there, or staging is off there); set "
          "TUNIX_STAGE_BATCH=stage on both the orchestrator and the trainer")


class Streams:
  """One engine's stream clients and side channels, one per trainer handle, made on first use;
  closed with the program's train loop (or `close()`). Counts what each sent."""

  def __init__(self) -> None:
    self._clients: "weakref.WeakKeyDictionary[Any, StreamClient]" = weakref.WeakKeyDictionary()
    self._sides: "weakref.WeakKeyDictionary[Any, side_lib.Channel]" = weakref.WeakKeyDictionary()
    self.calls = 0
    self.bytes = 0
    self.bulk_calls = 0
    self.bulk_bytes = 0

  def client(self, handle: remote_execution.GrpcRemoteActorHandle) -> StreamClient:
    client = self._clients.get(handle)
    if client is None:
      client = self._clients[handle] = StreamClient(handle)
    return client

  async def send(self, handle: remote_execution.GrpcRemoteActorHandle,
                 encoded: chunked.EncodedRequest) -> Any:
    result = await self.client(handle).call(encoded)
    self.calls += 1
    self.bytes += encoded.nbytes
    return result

  def side(self, handle: remote_execution.GrpcRemoteActorHandle) -> side_lib.Channel:
    channel = self._sides.get(handle)
    if channel is None:
      channel = self._sides[handle] = side_lib.Channel(address_of(handle))
    return channel

  async def send_bulk(self, handle: remote_execution.GrpcRemoteActorHandle, sender: Any,
                      encoded: chunked.EncodedRequest) -> Any:
    result = await self.side(handle).call(handle, sender, encoded)
    self.bulk_calls += 1
    self.bulk_bytes += encoded.nbytes
    return result

  def close_sides(self) -> None:
    for channel in list(self._sides.values()):
      channel.close()

  async def close(self) -> None:
    self.close_sides()
    for client in list(self._clients.values()):
      await client.close()


# Orchestrator side: each engine's stream clients, made on first use. The staged train loop closes
# its engine's channels when it ends; uninstall drops what is left (drop_streams).
_streams: "weakref.WeakKeyDictionary[Any, Streams]" = weakref.WeakKeyDictionary()
_streams_lock = threading.Lock()


def streams_of(engine: Any) -> Streams:
  """`engine`'s stream clients, one set per DistributedRLEngine."""
  with _streams_lock:
    streams = _streams.get(engine)
    if streams is None:
      streams = _streams[engine] = Streams()
    return streams


def drop_streams() -> None:
  with _streams_lock:
    streams = list(_streams.values())
    _streams.clear()
  for each in streams:
    each.close_sides()  # sockets; the grpc.aio channels close with their loop


async def close_streams(engine: Any) -> None:
  """Closes `engine`'s stream channels. The staged train loop does it when it ends; a caller of
  `stage_train_batch` outside that loop calls it on the same event loop before the loop ends."""
  await streams_of(engine).close()


def measure(worker: Any, method: str, kwargs: dict[str, Any]) -> chunked.EncodedRequest | None:
  """The call encoded out of band when `worker` is tunix's gRPC handle (the only one with a cap
  and a side channel; its in-process handle passes objects); None otherwise, or when it does not
  pickle (the host's own call reports that)."""
  if not issubclass(type(worker), remote_execution.GrpcRemoteActorHandle):  # the real type
    return None
  try:
    return chunked.encode(None, method, (), kwargs)  # the tuple tunix's request pickles
  except Exception:  # pylint: disable=broad-except
    return None


_HOST = object()  # the call is the host's own


async def _carry(streams: Streams, worker: Any, method: str, kwargs: dict[str, Any]) -> Any:
  """The call's result over the side channel or the chunked stream; _HOST when neither takes it
  (then nothing of the measurement is used)."""
  encoded = measure(worker, method, kwargs)
  if encoded is None:
    return _HOST
  if side_lib.wanted(encoded):
    sender = await streams.side(worker).open(worker)
    if sender is not None:
      return await streams.send_bulk(worker, sender, encoded)
  if encoded.over(message_cap()):
    return await streams.send(worker, encoded)
  return _HOST


async def invoke(engine: Any, streams: Streams, worker: Any, method: str, **kwargs: Any) -> Any:
  """The host's `_invoke_worker(worker, method, **kwargs)`, or the side channel or the chunked
  stream when the call takes one."""
  result = await _carry(streams, worker, method, kwargs)
  if result is _HOST:
    return await engine._invoke_worker(worker, method, **kwargs)  # pylint: disable=protected-access
  return result


async def train_step(engine: Any, streams: Streams, payload: Any, *, role: datatypes.Role,
                     accumulate_gradients: bool, apply_optimizer: bool) -> Any:
  """The host's `train_step(payload, ...)`, unless its fwd_bwd takes the side channel or the
  stream: then that fwd_bwd goes there with the same keywords, and `update` and the answer are
  the host's train_step's (distributed_rl_engine.DistributedRLEngine.train_step)."""
  worker = engine._trainer_workers.get(role)  # pylint: disable=protected-access
  fwd_bwd = await _carry(streams, worker, "fwd_bwd", {"payload": payload, "skip_jit": False})
  if fwd_bwd is _HOST:  # byte for byte the host's own call
    return await engine.train_step(payload, role=role, accumulate_gradients=accumulate_gradients,
                                   apply_optimizer=apply_optimizer)
  if not apply_optimizer:
    return fwd_bwd
  step = await engine._invoke_worker(worker, "update")  # pylint: disable=protected-access
  return {"fwd_bwd": fwd_bwd, "updated": True, "train_step": step,
          "accumulated": accumulate_gradients}


async def per_token_logps(engine: Any, streams: Streams, role: datatypes.Role, items: Any,
                          host_call: Any) -> Any:
  """`host_call(role, items=items)` (the host's per_token_logps), unless the call takes the side
  channel or the stream, to the worker the host's method picks (an inference worker of `role`,
  else the trainer)."""
  # pylint: disable-next=protected-access
  worker = engine._inference_workers.get(role) or engine._trainer_workers.get(role)
  result = await _carry(streams, worker, "per_token_logps", {"items": items})
  if result is _HOST:  # byte for byte the host's own call
    return await host_call(role, items=items)
  return result
