"""A tunix call in the form the plugin's transports carry: the request tuple tunix pickles
(request id, method, args, kwargs), pickled with protocol 5 and a `buffer_callback`, so every
contiguous array stays out of band in its own memory and the pickle is a few KiB.

Encoding copies no array byte, so the orchestrator measures every call that may carry a
micro-batch this way before it picks a transport (route.py); the side channel and the chunked
stream send this form, and the trainer decodes it over the buffers its bytes were received into
(no further copy). docs/design.md "A micro-batch's way".
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import cloudpickle

MIB = 1 << 20
# A request pickle above this travels apart from its header (arrays that are not contiguous
# travel in band), on both transports.
HEADER_BODY_MAX = 1 << 20
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


def encode(request_id: str | None, method_name: str, args: tuple, kwargs: dict[str, Any]
           ) -> EncodedRequest:
  """The request tuple tunix's ExecutionRequest.serialize pickles, pickled out of band.

  Cheap for any payload size: no array byte is copied (contiguous numpy arrays hand their memory
  to `buffer_callback`)."""
  buffers: list[pickle.PickleBuffer] = []
  body = cloudpickle.dumps((request_id, method_name, tuple(args), dict(kwargs)), protocol=5,
                           buffer_callback=buffers.append)
  return EncodedRequest(method_name, body, [b.raw() for b in buffers])


def decode(body: Any, buffers: list[Any], method: str, what: str, error: type[Exception]
           ) -> tuple[Any, ...]:
  """The request tuple `body` pickles, its arrays over `buffers`; `error` (naming `what` carried
  it) unless it is a request for the `method` its header names."""
  request = pickle.loads(body, buffers=buffers)
  if not (isinstance(request, tuple) and len(request) == 4 and request[1] == method):
    raise error(f"{method}: the {what}'s pickle is not a request for the method its header names")
  return request
