"""The chunked stream: a bulk call's header, then its parts in chunks of at most CHUNK_BYTES, on
the host's own gRPC port (a client stream of bytes messages).

The trainer takes it where no side channel serves; it is loaded on the first chunked call. The
receiving end copies each chunk once, into pooled aligned buffers of the announced sizes
(transport/listener.py's pool), and checks the header before any chunk is read.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, AsyncIterator, Iterator, Sequence

import grpc
import numpy as np

from tunix_stage_plugin.core import contract
from tunix_stage_plugin.transport import wire
from tunix_stage_plugin.transport.wire import WireError

if TYPE_CHECKING:  # the trainer's pool; the orchestrator's end loads no listener
  from tunix_stage_plugin.transport.listener import HostBufferPool


class ChunkSink:
  """Receives a stream of chunks into aligned buffers of announced sizes, one copy per byte.

  For transports that hand over their bytes in messages (a gRPC client stream): each chunk is
  copied into the buffer it belongs to as it arrives, so nothing payload-sized is held but the
  buffers themselves; a chunk never spans two buffers. A stream that carries more than it
  announced is refused at the first chunk past the total, one that ends early at `finish`.
  """

  def __init__(self, sizes: Sequence[int], pool: HostBufferPool) -> None:
    self.sizes = list(sizes)
    self.announced = sum(self.sizes)
    self.buffers = pool.take_all(self.sizes)
    self.received = 0
    self._index = 0
    self._filled = 0

  def write(self, chunk: bytes | memoryview) -> None:
    data = memoryview(chunk).cast("B")
    if self.received + data.nbytes > self.announced:
      raise ValueError(f"the stream carried more than the {self.announced} bytes it announced "
                       f"(refused at {self.received + data.nbytes} bytes)")
    while self._index < len(self.sizes) and self._filled == self.sizes[self._index]:
      self._index, self._filled = self._index + 1, 0
    room = self.sizes[self._index] - self._filled
    if data.nbytes > room:
      raise ValueError(f"a chunk of {data.nbytes} bytes overruns buffer {self._index} "
                       f"({self._filled} of {self.sizes[self._index]} bytes filled); chunks never "
                       "span buffers")
    target = self.buffers[self._index]
    target[self._filled:self._filled + data.nbytes] = np.frombuffer(data, np.uint8)
    self._filled += data.nbytes
    self.received += data.nbytes

  def finish(self) -> list[np.ndarray]:
    if self.received != self.announced:
      raise ValueError(f"the stream ended after {self.received} of the {self.announced} bytes "
                       "it announced")
    buffers, self.buffers = self.buffers, []
    return buffers


async def receive_header(messages: AsyncIterator[bytes], max_bytes: int, setting: str
                         ) -> wire.Header:
  """A chunked call's header, its first message, checked against `max_bytes` (set by `setting`)
  before any of its bytes is read; WireError naming the rule it breaks."""
  try:
    first = await anext(messages)
  except StopAsyncIteration:
    raise WireError("a chunked call ended before its header") from None
  header = wire.decode_header(first)
  wire.announced_bytes(header, max_bytes, setting)
  return header


async def receive_chunks(messages: AsyncIterator[bytes], header: wire.Header,
                         pool: HostBufferPool) -> wire.Received:
  """The rest of a chunked call (its parts' chunks, one message each) into buffers from `pool`.

  Runs on the server's event loop: each chunk costs one copy of at most CHUNK_BYTES there; the
  buffers are taken on a worker thread (a bounded pool may wait for a computation to give
  buffers back)."""
  sink = await asyncio.to_thread(ChunkSink, header.sizes, pool)
  started = time.perf_counter()
  async for chunk in messages:
    if len(chunk) > wire.CHUNK_BYTES:
      raise WireError(f"{header.method}: a chunk of {len(chunk)} bytes is larger than the "
                      f"{wire.CHUNK_BYTES}-byte chunks a bulk call sends")
    try:
      sink.write(chunk)
    except ValueError as e:
      raise WireError(f"{header.method}: {e}") from None
  try:
    buffers = sink.finish()
  except ValueError as e:
    raise WireError(f"{header.method}: {e}") from None
  return wire.Received(buffers, started, time.perf_counter())


async def send(channel: grpc.aio.Channel, parts: Iterator[bytes], timeout: float | None) -> bytes:
  """Sends a chunked call on `channel`: its header (the first of `parts`), then its chunks once the
  server accepted the header. The server's answer; grpc.aio.AioRpcError where the call failed
  (UNIMPLEMENTED: the server has no chunked stream)."""
  call = channel.stream_unary(contract.STREAM_METHOD)(timeout=timeout)
  try:
    await call.write(next(parts))
  except asyncio.InvalidStateError:  # the server answered first: the answer says why
    return await call
  except grpc.aio.AioRpcError:
    # A failed write hides the server's answer: one that raced it reads INTERNAL, and the call
    # may end so too (grpc/grpc#36066). Only a server without the stream answers before the
    # header: one unary call asks whether it is that one (raising UNIMPLEMENTED); if not, the
    # call's end says what failed.
    await channel.unary_unary(contract.STREAM_METHOD)(b"", timeout=timeout)
    return await call
  try:
    metadata = await call.initial_metadata()
    if metadata and metadata.get(contract.STREAM_READY_KEY) == contract.STREAM_READY:
      for message in parts:
        await call.write(message)
    await call.done_writing()
  except (asyncio.InvalidStateError, grpc.aio.AioRpcError):
    pass  # the server refused early: its answer says why
  return await call


def messages(encoded: wire.EncodedRequest) -> Iterator[bytes]:
  """The stream: the header, then every part in chunks.

  grpcio takes each message as bytes (a memoryview is not sent), so each chunk is copied once
  into the message, a chunk at a time; nothing payload-sized is made.
  """
  yield encoded.header(wire.new_transfer_id())
  for chunk in wire.iter_chunks(encoded.parts):  # PickleBuffer.raw() and the body: flat views
    yield bytes(chunk)
