"""What both ends of a bulk call agree on: the format of its two halves and the limits of the
channel that carries the bytes.

A bulk call is its header on the host's own call (`encode_header`: the method, the call's
protocol-5 pickle with every array out of band, the buffers' sizes, a fresh transfer id) and its
buffers' bytes on a plain TCP connection under that id (a frame: `frame_header`, then the
bytes). A connection opens with one byte from the listener, ACCEPTED, or REFUSED and why. The
listener (listener.py) enforces `BulkLimits`; the sender (sender.py) learns them from the
listener's `announcement` and lives within them. Why the bytes leave gRPC, and every rule:
docs/embedded.md "The bulk channel" and "Limits of the bulk channel".
"""

from __future__ import annotations

import dataclasses
import pickle
import secrets
import select
import socket
import struct
from typing import Any, Iterator, Sequence

TRANSFER_ID_BYTES = 16
MAX_BUFFERS = 1 << 16  # the most buffers one bulk call (its header and its frame) may carry
CHUNK_BYTES = 4 << 20  # a sender hands the socket at most this much at once
HEADER_KEYS = frozenset({"method", "body", "sizes", "transfer"})

MAGIC = b"TSB1"
FRAME_HEADER = struct.Struct(f"<4s{TRANSFER_ID_BYTES}sI")  # magic, transfer id, buffer count
ACCEPTED = b"+"  # the listener's first byte on a connection it serves
REFUSED = b"-"  # ... or this, then why (UTF-8), then it closes
MAX_REFUSAL_BYTES = 1024


class WireError(RuntimeError):
  """A message broke the wire format (sizes, order, or an oversized reply)."""


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


def encode_header(method: str, body: bytes, buffers: Sequence[memoryview], transfer: bytes
                  ) -> bytes:
  """The header of a call whose out-of-band `buffers` travel under `transfer`."""
  return pickle.dumps({"method": method, "body": body, "sizes": [b.nbytes for b in buffers],
                       "transfer": transfer}, protocol=5)


def decode_header(message: bytes) -> dict[str, Any]:
  header = pickle.loads(message)
  if not isinstance(header, dict) or set(header) != HEADER_KEYS:
    raise WireError(f"a bulk call's message must be its header {sorted(HEADER_KEYS)}")
  sizes = header["sizes"]
  if not isinstance(sizes, list) or not all(type(n) is int and n >= 0 for n in sizes):
    raise WireError(f"a bulk call's header must announce its buffer sizes as a list of "
                    f"integers >= 0; got {sizes!r:.80}")
  transfer = header["transfer"]
  if not isinstance(transfer, bytes) or len(transfer) != TRANSFER_ID_BYTES:
    raise WireError(f"a bulk call's header must carry a {TRANSFER_ID_BYTES}-byte transfer id")
  return header


def announced_bytes(header: dict[str, Any], max_call_bytes: int, setting: str) -> int:
  """The bytes a bulk call's header announces; refuses more than MAX_BUFFERS buffers or more than
  `max_call_bytes` bytes (`setting` names where that cap is set)."""
  count = len(header["sizes"])
  if count > MAX_BUFFERS:
    raise WireError(f"{header['method']} announces {count} buffers, above the {MAX_BUFFERS} "
                    "one call may carry; refused before reading any of its bytes")
  total = sum(header["sizes"])
  if total > max_call_bytes:
    raise WireError(f"{header['method']} announces {total} bytes, above this trainer's "
                    f"{max_call_bytes}-byte cap on one call ({setting}); "
                    "refused before reading any of its bytes")
  return total


# ---------------------------------------------------------------- the frame


def frame_header(transfer: bytes, sizes: Sequence[int]) -> bytes:
  """What a frame's bytes follow: MAGIC, the transfer id, the buffer count and sizes."""
  return FRAME_HEADER.pack(MAGIC, transfer, len(sizes)) + struct.pack(f"<{len(sizes)}Q", *sizes)


def iter_chunks(buffers: Sequence[memoryview], chunk_bytes: int = CHUNK_BYTES
                ) -> Iterator[memoryview]:
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
