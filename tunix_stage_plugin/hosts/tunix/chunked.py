"""The chunked form of one tunix call, for micro-batches over tunix's 128 MiB message cap.

tunix sends a call (an ExecutionRequest: request id, method name, args, kwargs) as one cloudpickled
unary gRPC message, and its channels and servers refuse messages over `_MAX_MESSAGE_BYTES`
(128 MiB). A call that would pickle to more travels instead as a gRPC client stream on the
trainer's own server port (stream.py registers the method there):

- message 0, the header: the method name, the request pickled with cloudpickle protocol 5 and a
  `buffer_callback` (so every array travels out of band and the pickle stays small), and the
  out-of-band buffers' sizes;
- the trainer accepts the header by sending its initial metadata with READY_KEY (a trainer
  without the method, or one refusing the header, answers without it, and no chunk is sent);
- then each buffer's bytes in chunks of at most CHUNK_BYTES, in order, never spanning two buffers.

The trainer receives the chunks with core.buffers.ChunkSink into pooled aligned buffers (one copy
per byte), refuses a header announcing more than its cap before reading any chunk and a stream
carrying more than its header announced at the first chunk past the total, then unpickles the
request over the buffers (no further copy). A request whose own pickle is large (arrays that are
not contiguous travel in band) sends that pickle as the stream's first part instead of in the
header, and the trainer unpickles it off the event loop. docs/tunix.md, "Micro-batches over
tunix's message cap".

This module imports no tunix (the plain suite tests it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import pickle
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator

import cloudpickle

from tunix_stage_plugin.core import buffers as buffers_lib

SERVICE = "tunix_stage.ExecutionStream"
METHOD_NAME = "Execute"
METHOD = f"/{SERVICE}/{METHOD_NAME}"

CHUNK_BYTES = 4 << 20  # one message copies at most this much on the trainer's event loop
# A request pickle above this travels as the stream's first part (then unpickled off the loop).
HEADER_BODY_MAX = 1 << 20
# What a call adds to its pickle on tunix's unary path beyond the out-of-band form (each in-band
# buffer's opcode and length, the gRPC message's framing): a call this close to the cap streams.
CAP_MARGIN = 64 << 10
HEADER_KEYS = frozenset({"method", "body", "sizes"})
# The trainer's initial metadata once it accepted a header: the client sends the chunks only then
# (so a refusal or a missing method is answered before any chunk is sent, never lost to a write
# failing on a call the trainer already ended).
READY_KEY, READY = "tunix-stage-chunks", "send"
MIB = 1 << 20


class StreamError(ValueError):
  """A stream broke the chunked form (header, sizes, chunk bounds); nothing of it is executed."""


@dataclasses.dataclass
class EncodedRequest:
  """A call pickled out of band: the small pickle and the buffers its arrays' bytes live in."""

  method: str
  body: bytes
  buffers: list[memoryview]

  @property
  def nbytes(self) -> int:
    """About what tunix's unary message would carry (the pickle plus every buffer's bytes)."""
    return len(self.body) + sum(b.nbytes for b in self.buffers)

  def over(self, cap: int) -> bool:
    """Whether tunix's unary path would refuse it (within CAP_MARGIN of `cap` counts as over)."""
    return self.nbytes > cap - CAP_MARGIN

  def parts(self) -> list[memoryview]:
    """What the chunks carry, in order: the buffers, after the pickle when it is large."""
    if len(self.body) > HEADER_BODY_MAX:
      return [memoryview(self.body), *self.buffers]
    return list(self.buffers)

  def header(self) -> bytes:
    body = None if len(self.body) > HEADER_BODY_MAX else self.body
    return pickle.dumps({"method": self.method, "body": body,
                         "sizes": [p.nbytes for p in self.parts()]}, protocol=5)

  def messages(self) -> Iterator[bytes]:
    """The stream: the header, then every part in chunks of at most CHUNK_BYTES.

    grpcio takes each message as bytes (a memoryview is not sent), so each chunk is copied once
    into the message, a chunk at a time; nothing payload-sized is made.
    """
    yield self.header()
    for part in self.parts():  # PickleBuffer.raw() and the body: flat views of bytes
      for start in range(0, part.nbytes, CHUNK_BYTES):
        yield bytes(part[start:start + CHUNK_BYTES])

  async def send(self, accepted: Callable[[], Awaitable[bool]]) -> AsyncIterator[bytes]:
    """The stream as a client sends it: the header, then the chunks only if `accepted()` (the
    trainer's answer to the header) says so."""
    messages = self.messages()
    yield next(messages)
    if await accepted():
      for message in messages:
        yield message


def encode(request_id: str | None, method_name: str, args: tuple, kwargs: dict[str, Any]
           ) -> EncodedRequest:
  """The request tuple tunix's ExecutionRequest.serialize pickles, pickled out of band.

  Cheap for any payload size: no array byte is copied (contiguous numpy arrays hand their memory
  to `buffer_callback`)."""
  buffers: list[pickle.PickleBuffer] = []
  body = cloudpickle.dumps((request_id, method_name, tuple(args), dict(kwargs)), protocol=5,
                           buffer_callback=buffers.append)
  return EncodedRequest(method_name, body, [b.raw() for b in buffers])


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
    header = pickle.loads(message)
  except Exception as e:  # pylint: disable=broad-except  (anything but a header is refused)
    raise StreamError(f"a chunked call's first message must be its header; it did not unpickle "
                      f"({type(e).__name__})") from None
  if not isinstance(header, dict) or set(header) != HEADER_KEYS:
    raise StreamError(f"a chunked call's first message must be its header, a dict of "
                      f"{sorted(HEADER_KEYS)}")
  method, body, sizes = header["method"], header["body"], header["sizes"]
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


async def receive(messages: AsyncIterator[bytes], pool: buffers_lib.HostBufferPool,
                  max_bytes: int, accept: Callable[[], Awaitable[None]] | None = None
                  ) -> tuple[Any, ...]:
  """Reads one chunked call from `messages` into buffers from `pool`; answers the request tuple
  (request_id, method_name, args, kwargs), its arrays over those buffers. `accept()` runs once
  the header passed (the server sends READY_KEY there).

  Runs on the server's event loop: each chunk costs one copy of at most CHUNK_BYTES there; the
  buffers are taken and a large pickle is unpickled on a worker thread."""
  stream = aiter(messages)
  try:
    first = await anext(stream)
  except StopAsyncIteration:
    raise StreamError("a chunked call ended before its header") from None
  header = decode_header(first, max_bytes)
  # Off the event loop: a bounded pool may wait for a computation to give buffers back.
  sink = await asyncio.to_thread(buffers_lib.ChunkSink, header.sizes, pool)
  if accept is not None:
    await accept()
  async for chunk in stream:
    if len(chunk) > CHUNK_BYTES:
      raise StreamError(f"{header.method}: a chunk of {len(chunk)} bytes is larger than the "
                        f"{CHUNK_BYTES}-byte chunks a chunked call sends")
    try:
      sink.write(chunk)
    except ValueError as e:
      raise StreamError(f"{header.method}: {e}") from None
  try:
    parts = sink.finish()
  except ValueError as e:
    raise StreamError(f"{header.method}: {e}") from None
  if header.body is not None:
    request = pickle.loads(header.body, buffers=parts)  # small: the arrays are out of band
  else:
    request = await asyncio.to_thread(pickle.loads, parts[0], buffers=parts[1:])
  del parts  # the arrays over the buffers are all that is kept
  if not (isinstance(request, tuple) and len(request) == 4 and request[1] == header.method):
    raise StreamError(f"{header.method}: the chunked call's pickle is not a request for the "
                      "method its header names")
  return request
