"""The one bulk format: what both ends of a call too large for the host's own message agree on,
whichever carrier takes its bytes.

A bulk call is its header (`encode_header`: the method, the call's out-of-band pickle or None when
that pickle travels as the first part, the parts' sizes, a fresh transfer id) and its parts' bytes
in chunks of at most CHUNK_BYTES, never spanning two parts. Two carriers take it: the bulk channel
(a `frame_header`, then the chunks, on a plain TCP connection: listener.py, sender.py) and, on
tunix's host, a gRPC client stream (hosts/tunix/chunked.py). Either way the trainer checks the
header (`decode_header`) and its cap (`announced_bytes`) before any byte, fails a call with
WireError, and hands on the buffers as `Received`. docs/embedded.md "The bulk channel" and "Limits
of the bulk channel", docs/tunix.md "Which path a call takes".
"""

from __future__ import annotations

import dataclasses
import pickle
import secrets
import select
import socket
import struct
from typing import Iterator, Sequence

import numpy as np

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
