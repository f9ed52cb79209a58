"""The bulk format (transport/frames.py) carried as a gRPC client stream: message 0 the call's
header (its transfer id unused, the stream being the call), then the parts' chunks, one message
each (`messages`, `send`, `receive`).

The chunks are sent only once the trainer accepts the header with its initial metadata
(contract.STREAM_READY_KEY), so a refusal is answered before any chunk; the trainer copies each
chunk once, as it arrives, into pooled aligned buffers (core.buffers.ChunkSink). Both ends on
tunix's gRPC: stream.py. Imports no tunix (the plain suite tests it). docs/tunix.md "Micro-batches
over tunix's message cap".
"""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator, Awaitable, Callable, Iterator

from tunix_stage_plugin.core import buffers as buffers_lib
from tunix_stage_plugin.transport import frames
from tunix_stage_plugin.transport.frames import WireError
from tunix_stage_plugin.transport.request import EncodedRequest

# ---------------------------------------------------------------- the sender's side


def messages(encoded: EncodedRequest) -> Iterator[bytes]:
  """The stream: the header, then every part in chunks.

  grpcio takes each message as bytes (a memoryview is not sent), so each chunk is copied once
  into the message, a chunk at a time; nothing payload-sized is made.
  """
  yield encoded.header(frames.new_transfer_id())
  for chunk in frames.iter_chunks(encoded.parts):  # PickleBuffer.raw() and the body: flat views
    yield bytes(chunk)


async def send(encoded: EncodedRequest, accepted: Callable[[], Awaitable[bool]]
               ) -> AsyncIterator[bytes]:
  """The stream as a client sends it: the header, then the chunks only if `accepted()` (the
  trainer's answer to the header) says so."""
  stream = messages(encoded)
  yield next(stream)
  if await accepted():
    for message in stream:
      yield message


# ---------------------------------------------------------------- the receiver's side


async def receive(messages: AsyncIterator[bytes], pool: buffers_lib.HostBufferPool,
                  max_bytes: int, setting: str,
                  accept: Callable[[], Awaitable[None]] | None = None
                  ) -> tuple[frames.Header, frames.Received]:
  """Reads one call from `messages` into buffers from `pool`; its header is checked against
  `max_bytes` (set by `setting`) first. `accept()` runs once the header passed (the server sends
  contract.STREAM_READY_KEY there).

  Runs on the server's event loop: each chunk costs one copy of at most CHUNK_BYTES there; the
  buffers are taken on a worker thread."""
  stream = aiter(messages)
  try:
    first = await anext(stream)
  except StopAsyncIteration:
    raise WireError("a chunked call ended before its header") from None
  header = frames.decode_header(first)
  frames.announced_bytes(header, max_bytes, setting)
  # Off the event loop: a bounded pool may wait for a computation to give buffers back.
  sink = await asyncio.to_thread(buffers_lib.ChunkSink, header.sizes, pool)
  if accept is not None:
    await accept()
  started = time.perf_counter()
  async for chunk in stream:
    if len(chunk) > frames.CHUNK_BYTES:
      raise WireError(f"{header.method}: a chunk of {len(chunk)} bytes is larger than the "
                      f"{frames.CHUNK_BYTES}-byte chunks a bulk call sends")
    try:
      sink.write(chunk)
    except ValueError as e:
      raise WireError(f"{header.method}: {e}") from None
  try:
    buffers = sink.finish()
  except ValueError as e:
    raise WireError(f"{header.method}: {e}") from None
  return header, frames.Received(buffers, started, time.perf_counter())
