"""The chunked stream's format: a tunix call over tunix's 128 MiB message cap as a gRPC client
stream of messages none of which is over it.

- message 0, the header: the method, the request's out-of-band pickle (request.py; None when it
  is large and travels as the first part) and the parts' sizes;
- the trainer accepts the header with its initial metadata (contract.STREAM_READY_KEY); only then
  are the chunks sent, so a refusal or a missing method is answered before any of them;
- then each part's bytes in chunks of at most CHUNK_BYTES, never spanning two parts.

The trainer copies each chunk once, as it arrives, into pooled aligned buffers
(core.buffers.ChunkSink), refuses a header over its cap before any chunk and a stream carrying
more than it announced at the first chunk past the total, and decodes the request over the
buffers. Both ends on tunix's gRPC: stream.py. Imports no tunix (the plain suite tests it).
docs/tunix.md "Micro-batches over tunix's message cap".
"""

from __future__ import annotations

import asyncio
import dataclasses
import pickle
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator

from tunix_stage_plugin.core import buffers as buffers_lib
from tunix_stage_plugin.hosts.tunix import request as request_lib
from tunix_stage_plugin.hosts.tunix.request import MIB, EncodedRequest

CHUNK_BYTES = 4 << 20  # one message copies at most this much on the trainer's event loop
HEADER_KEYS = frozenset({"method", "body", "sizes"})


class StreamError(ValueError):
  """A stream broke the chunked form (header, sizes, chunk bounds); nothing of it is executed."""


# ---------------------------------------------------------------- the sender's side


def parts(encoded: EncodedRequest) -> list[memoryview]:
  """What the chunks carry, in order: the buffers, after the pickle when it is large."""
  if len(encoded.body) > request_lib.HEADER_BODY_MAX:
    return [memoryview(encoded.body), *encoded.buffers]
  return list(encoded.buffers)


def header(encoded: EncodedRequest) -> bytes:
  body = None if len(encoded.body) > request_lib.HEADER_BODY_MAX else encoded.body
  return pickle.dumps({"method": encoded.method, "body": body,
                       "sizes": [p.nbytes for p in parts(encoded)]}, protocol=5)


def messages(encoded: EncodedRequest) -> Iterator[bytes]:
  """The stream: the header, then every part in chunks of at most CHUNK_BYTES.

  grpcio takes each message as bytes (a memoryview is not sent), so each chunk is copied once
  into the message, a chunk at a time; nothing payload-sized is made.
  """
  yield header(encoded)
  for part in parts(encoded):  # PickleBuffer.raw() and the body: flat views of bytes
    for start in range(0, part.nbytes, CHUNK_BYTES):
      yield bytes(part[start:start + CHUNK_BYTES])


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


@dataclasses.dataclass(frozen=True)
class Header:
  method: str
  body: bytes | None  # None: the pickle is the stream's first part
  sizes: list[int]

  @property
  def announced(self) -> int:
    return sum(self.sizes)


def decode_header(message: bytes, max_bytes: int) -> Header:
  """Message 0; refuses a malformed header, and one announcing more than `max_bytes`."""
  try:
    fields = pickle.loads(message)
  except Exception as e:  # pylint: disable=broad-except  (anything but a header is refused)
    raise StreamError(f"a chunked call's first message must be its header; it did not unpickle "
                      f"({type(e).__name__})") from None
  if not isinstance(fields, dict) or set(fields) != HEADER_KEYS:
    raise StreamError(f"a chunked call's first message must be its header, a dict of "
                      f"{sorted(HEADER_KEYS)}")
  method, body, sizes = fields["method"], fields["body"], fields["sizes"]
  if not isinstance(method, str):
    raise StreamError(f"a chunked call's header must name its method as a str; got {method!r:.80}")
  if not isinstance(sizes, list) or not all(type(n) is int and n >= 0 for n in sizes):
    raise StreamError(f"{method}: a chunked call's header must announce its buffer sizes as a "
                      f"list of integers >= 0; got {sizes!r:.80}")
  if not (isinstance(body, bytes) or (body is None and sizes)):
    raise StreamError(f"{method}: a chunked call's header must carry its pickle (bytes), or None "
                      "with the pickle as its first part")
  result = Header(method, body, sizes)
  if result.announced > max_bytes:
    raise StreamError(f"{method} announces {result.announced} bytes ({result.announced / MIB:.1f} "
                      f"MiB), above this trainer's {max_bytes}-byte cap on one chunked call "
                      "(tunix_stage_plugin.hosts.tunix.installation.MAX_STREAM_BYTES); refused "
                      "before reading any of its bytes")
  return result


@dataclasses.dataclass
class Received:
  """One chunked call as received: the request tuple, its arrays over pooled buffers."""

  request: tuple[Any, ...]  # (request_id, method_name, args, kwargs)
  nbytes: int  # what its header announced
  started: float  # perf_counter: its header accepted (the chunks follow)
  ended: float  # its last chunk in


async def receive(messages: AsyncIterator[bytes], pool: buffers_lib.HostBufferPool,
                  max_bytes: int, accept: Callable[[], Awaitable[None]] | None = None
                  ) -> Received:
  """Reads one chunked call from `messages` into buffers from `pool`. `accept()` runs once the
  header passed (the server sends contract.STREAM_READY_KEY there).

  Runs on the server's event loop: each chunk costs one copy of at most CHUNK_BYTES there; the
  buffers are taken and a large pickle is unpickled on a worker thread."""
  stream = aiter(messages)
  try:
    first = await anext(stream)
  except StopAsyncIteration:
    raise StreamError("a chunked call ended before its header") from None
  head = decode_header(first, max_bytes)
  # Off the event loop: a bounded pool may wait for a computation to give buffers back.
  sink = await asyncio.to_thread(buffers_lib.ChunkSink, head.sizes, pool)
  if accept is not None:
    await accept()
  started = time.perf_counter()
  async for chunk in stream:
    if len(chunk) > CHUNK_BYTES:
      raise StreamError(f"{head.method}: a chunk of {len(chunk)} bytes is larger than the "
                        f"{CHUNK_BYTES}-byte chunks a chunked call sends")
    try:
      sink.write(chunk)
    except ValueError as e:
      raise StreamError(f"{head.method}: {e}") from None
  try:
    buffers = sink.finish()
  except ValueError as e:
    raise StreamError(f"{head.method}: {e}") from None
  ended = time.perf_counter()
  if head.body is not None:  # small: the arrays are out of band
    request = request_lib.decode(head.body, buffers, head.method, "chunked call", StreamError)
  else:
    request = await asyncio.to_thread(request_lib.decode, buffers[0], buffers[1:], head.method,
                                      "chunked call", StreamError)
  del buffers  # the arrays over the buffers are all that is kept
  return Received(request, head.announced, started, ended)
