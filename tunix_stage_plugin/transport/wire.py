"""A call's bytes, as both ends agree on them: its encoding and the one bulk format.

`encode` pickles tunix's request tuple with protocol 5 out of band: every contiguous array stays
in its own memory, so no array byte is copied. A call too large for the host's own message
travels in bulk: a header (`encode_header`: method, pickle, the parts' sizes, a transfer id), then
its parts in chunks of at most CHUNK_BYTES. The bulk channel and the chunked stream both carry
it. The trainer checks the header and its cap before any byte (`decode_header`,
`announced_bytes`) and fails a call with WireError. Imports no host.
"""


from __future__ import annotations

import dataclasses
import pickle
import secrets
import select
import socket
import struct
from typing import Any, Iterator, Sequence

import cloudpickle
import numpy as np

ALIGNMENT = 64  # a received buffer's data starts here: unpickled arrays over it are aligned
TRANSFER_ID_BYTES = 16
MAX_BUFFERS = 1 << 16  # the most parts one bulk call (its header and its frame) may carry
CHUNK_BYTES = 4 << 20  # a chunk carries at most this much (one socket hand-over, one message)
# A call's pickle above this travels as its first part rather than in its header (arrays that are
# not contiguous travel in band).
HEADER_BODY_MAX = 1 << 20
HEADER_KEYS = frozenset({"method", "body", "sizes", "transfer"})

MAGIC = b"TSB1"
FRAME_HEADER = struct.Struct(f"<4s{TRANSFER_ID_BYTES}sI")  # magic, transfer id, buffer count
ACCEPTED = b"+"  # the listener's first byte on a connection it serves
REFUSED = b"-"  # ... or this, then why (UTF-8), then it closes
MAX_REFUSAL_BYTES = 1024


class WireError(RuntimeError):
  """A call broke the bulk format or a bound (its header, sizes, chunks or order); nothing of it
  is executed."""


@dataclasses.dataclass(frozen=True)
class BulkLimits:
  """What the listener allows a peer; the sender lives within it (docs/embedded.md "Limits of the
  bulk channel"). A peer that breaks a bound loses its connection; the call it carried, if any,
  fails with a WireError naming the bound."""

  # Connections open at once (one thread each); one more is refused with a message. A sender
  # queues its own sends within this, so only several clients together reach it.
  max_connections: int = 32
  # A connection's next frame header (all of it) must arrive within this of the connection's
  # opening or of its previous frame's end. A sender reuses a connection idle for less than half.
  header_wait_s: float = 5.0
  # A frame waits this long for the gRPC header of its call, and a call's header this long for its
  # frame to begin (they are sent together: milliseconds).
  pair_wait_s: float = 10.0
  # A frame's bytes must keep coming: a pause this long fails its call (an emulated link paces
  # its chunks well within it: lab/embedded/pacing.py).
  stall_s: float = 10.0


def announcement(port: int, limits: BulkLimits) -> bytes:
  """The listener's answer to "where is your bulk channel": its port and the limits it enforces."""
  return pickle.dumps({"port": port, "limits": limits}, protocol=5)


def read_announcement(message: bytes) -> tuple[int, BulkLimits]:
  answer = pickle.loads(message)
  return answer["port"], answer["limits"]


# ---------------------------------------------------------------- the call's header


def aligned_empty(nbytes: int) -> np.ndarray:
  """A writable uint8 buffer of `nbytes` whose data starts on an ALIGNMENT-byte boundary."""
  raw = np.empty(nbytes + ALIGNMENT, dtype=np.uint8)
  offset = (-raw.ctypes.data) % ALIGNMENT
  return raw[offset:offset + nbytes]


def new_transfer_id() -> bytes:
  return secrets.token_bytes(TRANSFER_ID_BYTES)


def parts(body: bytes, buffers: Sequence[memoryview]) -> list[memoryview]:
  """What a call's chunks carry, in order: its out-of-band buffers, after its pickle when that is
  too large for the header."""
  if len(body) > HEADER_BODY_MAX:
    return [memoryview(body), *buffers]
  return list(buffers)


def encode_header(method: str, body: bytes, buffers: Sequence[memoryview], transfer: bytes
                  ) -> bytes:
  """The header of a call (`body`: its pickle, its arrays out of band in `buffers`) whose parts
  travel under `transfer`."""
  inline = body if len(body) <= HEADER_BODY_MAX else None
  return pickle.dumps({"method": method, "body": inline,
                       "sizes": [p.nbytes for p in parts(body, buffers)], "transfer": transfer},
                      protocol=5)


@dataclasses.dataclass(frozen=True)
class Header:
  """A bulk call's header, as the trainer decoded and checked it."""

  method: str
  body: bytes | None  # None: the pickle is the first part
  sizes: list[int]
  transfer: bytes

  @property
  def announced(self) -> int:
    return sum(self.sizes)


def decode_header(message: bytes) -> Header:
  """A bulk call's header; WireError naming the rule it breaks."""
  try:
    fields = pickle.loads(message)
  except Exception as e:  # pylint: disable=broad-except  (anything but a header is refused)
    raise WireError(f"a bulk call's message must be its header; it did not unpickle "
                    f"({type(e).__name__})") from None
  if not isinstance(fields, dict) or set(fields) != HEADER_KEYS:
    raise WireError(f"a bulk call's message must be its header, a dict of {sorted(HEADER_KEYS)}")
  method, body, sizes, transfer = (fields[k] for k in ("method", "body", "sizes", "transfer"))
  if not isinstance(method, str):
    raise WireError(f"a bulk call's header must name its method as a str; got {method!r:.80}")
  if not isinstance(sizes, list) or not all(type(n) is int and n >= 0 for n in sizes):
    raise WireError(f"{method}: a bulk call's header must announce its buffer sizes as a list of "
                    f"integers >= 0; got {sizes!r:.80}")
  if not (isinstance(body, bytes) or (body is None and sizes)):
    raise WireError(f"{method}: a bulk call's header must carry its pickle (bytes), or None with "
                    "the pickle as its first part")
  if not isinstance(transfer, bytes) or len(transfer) != TRANSFER_ID_BYTES:
    raise WireError(f"{method}: a bulk call's header must carry a {TRANSFER_ID_BYTES}-byte "
                    "transfer id")
  return Header(method, body, sizes, transfer)


def announced_bytes(header: Header, max_call_bytes: int, setting: str) -> int:
  """The bytes a bulk call's header announces; refuses more than MAX_BUFFERS parts or more than
  `max_call_bytes` bytes (`setting` names where that cap is set), before any of them is read."""
  count = len(header.sizes)
  if count > MAX_BUFFERS:
    raise WireError(f"{header.method} announces {count} buffers, above the {MAX_BUFFERS} "
                    "one call may carry; refused before reading any of its bytes")
  total = header.announced
  if total > max_call_bytes:
    raise WireError(f"{header.method} announces {total} bytes ({total / (1 << 20):.1f} MiB), above "
                    f"this trainer's {max_call_bytes}-byte cap on one call ({setting}); "
                    "refused before reading any of its bytes")
  return total


@dataclasses.dataclass
class Received:
  """A call's parts, in the buffers they were received into, and when they arrived."""

  buffers: list[np.ndarray]
  started: float  # perf_counter: its first byte was awaited (the frame's or stream's header read)
  ended: float  # its last byte was in


# ---------------------------------------------------------------- the frame


def frame_header(transfer: bytes, sizes: Sequence[int]) -> bytes:
  """What a frame's bytes follow: MAGIC, the transfer id, the buffer count and sizes."""
  return FRAME_HEADER.pack(MAGIC, transfer, len(sizes)) + struct.pack(f"<{len(sizes)}Q", *sizes)


def iter_chunks(buffers: Sequence[memoryview], chunk_bytes: int = CHUNK_BYTES
                ) -> Iterator[memoryview]:
  """`buffers` (a call's parts) in chunks of at most `chunk_bytes`, never spanning two."""
  for view in buffers:
    for start in range(0, view.nbytes, chunk_bytes):
      yield view[start:start + chunk_bytes]


# ---------------------------------------------------------------- the connection, either end


def family(host: str) -> socket.AddressFamily:
  return socket.AF_INET6 if ":" in host else socket.AF_INET


def hung_up(sock: socket.socket) -> bool:
  """True once the peer closed its end (or the connection failed); never blocks or reads."""
  poller = select.poll()
  poller.register(sock, select.POLLRDHUP)
  return bool(poller.poll(0))


def shutdown(sock: socket.socket) -> None:
  try:
    sock.shutdown(socket.SHUT_RDWR)
  except OSError:
    pass


# ---------------------------------------------------------------- a call, encoded

MIB = 1 << 20
# What a call adds to its pickle on tunix's unary path beyond the out-of-band form (each in-band
# buffer's opcode and length, the gRPC message's framing): a call this close to the cap is over it.
CAP_MARGIN = 64 << 10


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

  @property
  def out_of_band_bytes(self) -> int:
    return sum(b.nbytes for b in self.buffers)

  def over(self, cap: int) -> bool:
    """Whether tunix's unary path would refuse it (within CAP_MARGIN of `cap` counts as over)."""
    return self.nbytes > cap - CAP_MARGIN

  def header(self, transfer: bytes) -> bytes:
    """Its bulk header (encode_header), its parts to travel under `transfer`."""
    return encode_header(self.method, self.body, self.buffers, transfer)

  @property
  def parts(self) -> list[memoryview]:
    """What its bulk chunks carry (parts)."""
    return parts(self.body, self.buffers)


def encode(request_id: str | None, method_name: str, args: tuple, kwargs: dict[str, Any]
           ) -> EncodedRequest:
  """The request tuple tunix's ExecutionRequest.serialize pickles, pickled out of band.

  Cheap for any payload size: no array byte is copied (contiguous numpy arrays hand their memory
  to `buffer_callback`)."""
  buffers: list[pickle.PickleBuffer] = []
  body = cloudpickle.dumps((request_id, method_name, tuple(args), dict(kwargs)), protocol=5,
                           buffer_callback=buffers.append)
  return EncodedRequest(method_name, body, [b.raw() for b in buffers])


def encode_whole(request_id: str | None, method_name: str, args: tuple, kwargs: dict[str, Any]
                 ) -> bytes:
  """The same tuple with its arrays in band: one message (what tunix's own unary call sends)."""
  return cloudpickle.dumps((request_id, method_name, tuple(args), dict(kwargs)), protocol=5)


def decode(body: Any, buffers: Sequence[Any] = (), method: str | None = None) -> tuple[Any, ...]:
  """The request tuple `body` pickles, its arrays over `buffers`; WireError unless it is a request
  (for `method`, when a header named one)."""
  request = pickle.loads(body, buffers=buffers)
  if not (isinstance(request, tuple) and len(request) == 4
          and (request[1] == method if method is not None else isinstance(request[1], str))):
    raise WireError(f"{method}: the call's pickle is not a request for the method its "
                           "header names" if method is not None else
                           "a call's message is not a request (request_id, method, args, kwargs)")
  return request


def decode_received(header: Header, buffers: list[Any]) -> tuple[Any, ...]:
  """The request a bulk call carried, over the buffers its parts were received into."""
  if header.body is None:  # the pickle came as the first part
    return decode(buffers[0], buffers[1:], header.method)
  return decode(header.body, buffers, header.method)
