"""The chunked stream on tunix's host, both ends: a call over tunix's message cap in the bulk
format, carried as a gRPC client stream (chunked.py) on the trainer's own server port.

Why: where the trainer's bulk port cannot be reached, this is what lets a micro-batch over tunix's
128 MiB cap train at all. Trainer: `handler`, added by server.py to each GrpcRemoteExecutionServer
before tunix starts it, hands the received call to lanes.Lanes.answer. Orchestrator: `StreamClient`,
its own grpc.aio channel to the handle's address; a trainer without the method answers
UNIMPLEMENTED, which becomes one line (PayloadOverCap). docs/tunix.md "Micro-batches over tunix's
message cap".
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

import grpc
from tunix.experimental.worker import remote_execution

from tunix_stage_plugin.hosts.tunix import chunked
from tunix_stage_plugin.hosts.tunix import contract
from tunix_stage_plugin.hosts.tunix import installation as installation_lib
from tunix_stage_plugin.hosts.tunix import lanes as lanes_lib
from tunix_stage_plugin.transport import frames
from tunix_stage_plugin.transport import request as request_lib

MIB = request_lib.MIB


def message_cap() -> int:
  """tunix's cap on one message, read at call time (as tunix's `_grpc_options` reads it)."""
  return remote_execution._MAX_MESSAGE_BYTES  # pylint: disable=protected-access


class PayloadOverCap(RuntimeError):
  """A call over tunix's message cap met a trainer that cannot take it in chunks; one line."""


# ---------------------------------------------------------------- trainer side


def handler(inst: installation_lib.Installation, server: Any) -> Any:
  """The stream's method for `server`'s grpc server."""
  server_ref = weakref.ref(server)  # the grpc server holds the handler; the handler not the server

  async def execute_stream(request_iterator: Any, context: Any) -> bytes:
    async def accept() -> None:  # the header passed: the client sends the chunks now
      await context.send_initial_metadata(((contract.STREAM_READY_KEY, contract.STREAM_READY),))

    serving = server_ref()  # held for this call only

    async def receive() -> tuple[frames.Header, frames.Received]:
      if serving is None:
        raise RuntimeError("the server this stream belongs to is gone")
      header, received = await chunked.receive(request_iterator, inst.pool, inst.max_stream_bytes,
                                               lanes_lib.CAP_SETTING, accept)
      inst.chunked_calls[header.method] += 1
      return header, received

    return (await inst.lanes.answer(serving, contract.STREAM, receive)).serialize()

  return grpc.method_handlers_generic_handler(contract.STREAM_SERVICE, {
      contract.STREAM_METHOD_NAME: grpc.stream_unary_rpc_method_handler(execute_stream),
  })


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
          contract.STREAM_METHOD,
          response_deserializer=remote_execution.ExecutionResponse.deserialize)
    return self._rpc

  async def send(self, encoded: request_lib.EncodedRequest) -> Any:
    """Sends `encoded` in chunks; the result, or the trainer's error as contract.RemoteError."""
    calls: list[Any] = []

    async def accepted() -> bool:  # the trainer's answer to the header
      metadata = await calls[0].initial_metadata()
      return metadata.get(contract.STREAM_READY_KEY) == contract.STREAM_READY

    calls.append(self._call()(chunked.send(encoded, accepted), timeout=self.timeout))
    try:
      response = await calls[0]
    except grpc.aio.AioRpcError as e:
      if e.code() == grpc.StatusCode.UNIMPLEMENTED:
        raise PayloadOverCap(over_cap_line(encoded, self.address)) from None
      raise
    return contract.unwrap(response)

  async def close(self) -> None:
    channel, loop = self._channel, self._loop
    self._channel = self._rpc = self._loop = None
    if channel is not None and loop is asyncio.get_running_loop():
      await channel.close()


def over_cap_line(encoded: request_lib.EncodedRequest, address: str) -> str:
  return (f"tunix-stage: a {encoded.method} call carrying {encoded.nbytes / MIB:.1f} MiB is over "
          f"tunix's {message_cap() / MIB:.0f} MiB message cap "
          f"(remote_execution._MAX_MESSAGE_BYTES) and the trainer at {address} cannot take it "
          "in chunks (tunix-stage-plugin is not installed there, or staging is off there); set "
          "TUNIX_STAGE_BATCH=stage on both the orchestrator and the trainer")
