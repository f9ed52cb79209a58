"""What both ends of a bulk call agree on: its header, its transfer id, its limits and chunks.

A bulk call is two messages: its header on the host's gRPC call (the method, the call's pickle
made with protocol 5 and a `buffer_callback`, so every array is out of band and the pickle stays
small, the out-of-band buffers' sizes and a fresh 128-bit transfer id) and the buffers' bytes on
the bulk channel (bulk.py) under that id. The receiver checks the header against its cap before
any byte is read. docs/design.md "Layout", docs/embedded.md "The bulk channel", docs/tunix.md
"Which path a call takes".
"""

from __future__ import annotations

import pickle
import secrets
from typing import Any, Iterator, Sequence

TRANSFER_ID_BYTES = 16
MAX_BUFFERS = 1 << 16  # the most buffers one bulk call (its header and its frame) may carry
CHUNK_BYTES = 4 << 20  # a sender hands the socket (and a pacer) at most this much at once
HEADER_KEYS = frozenset({"method", "body", "sizes", "transfer"})


class WireError(RuntimeError):
  """A message broke the wire format (sizes, order, or an oversized reply)."""


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


def iter_chunks(buffers: Sequence[memoryview], chunk_bytes: int = CHUNK_BYTES
                ) -> Iterator[memoryview]:
  for view in buffers:
    for start in range(0, view.nbytes, chunk_bytes):
      yield view[start:start + chunk_bytes]
