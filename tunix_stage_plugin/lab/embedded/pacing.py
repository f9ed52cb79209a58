"""Emulated links: a wire of given bandwidth, and a host-to-device copy of given bandwidth.

On a CPU machine, loopback gRPC runs at ~1 GB/s and `jax.device_put` of an aligned buffer is
zero-copy, so neither resembles production (wire 8-10 s, host-to-device 3.9 s per micro-batch).
Both are emulated by *sleeping* for the bytes' transmission time: the CPU stays free, as it would
while a NIC or a DMA engine moves the bytes (docs/embedded.md).
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import AsyncIterator, Awaitable, Callable, Sequence

from tunix_stage_plugin.transport import wire
from tunix_stage_plugin.transport import sender as sender_lib


# The event loop sleeps in whole milliseconds (epoll's timeout), so a sender ahead of its link by
# less than this keeps sending and sleeps once its lead is this large: pacing stays exact on
# average, and a fast link is not slowed by a millisecond per chunk.
MIN_SLEEP_S = 0.002
# A sender that fell behind its link's schedule by less than this (or one chunk's time, when
# longer) continues on it and catches up: one slow hand-over of a chunk to the socket does not
# put the link behind for the rest of the transfer. A longer gap is the link idle: the next chunk
# starts when it is sent.
CATCH_UP_S = 0.05
# A paced chunk takes at most this much of its link's time, so even the cap's worth of calls
# sharing a slow emulated link pause each frame far less than the listener's stall bound
# (wire.BulkLimits.stall_s): at most 10 chunks a second a link, however slow.
PACED_CHUNK_S = 0.1


class LinkPacer:
  """One shared link: bytes are sent in order, each chunk leaves once its transmission time is up.

  `bytes_per_s=None` means an unpaced link (the real loopback speed).
  """

  def __init__(self, bytes_per_s: float | None = None, *,
               clock: Callable[[], float] = time.perf_counter,
               sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
    self.set_rate(bytes_per_s)
    self._clock = clock
    self._sleep = sleep
    self._free_at = 0.0  # when the link has finished the bytes queued so far

  def set_rate(self, bytes_per_s: float | None) -> None:
    if bytes_per_s is not None and not bytes_per_s > 0:
      raise ValueError(f"link bandwidth must be > 0 bytes/s or None (unpaced); got {bytes_per_s!r}")
    self.bytes_per_s = bytes_per_s

  def backlog_s(self) -> float:
    """Seconds until the link has sent the bytes queued on it so far (0 when idle or unpaced)."""
    if self.bytes_per_s is None:
      return 0.0
    return max(0.0, self._free_at - self._clock())

  async def transmit(self, nbytes: int) -> None:
    """Returns when `nbytes` queued behind earlier chunks have crossed the link."""
    if self.bytes_per_s is None or nbytes <= 0:
      return
    now = self._clock()
    slot = nbytes / self.bytes_per_s
    # A sender handing over its next chunk soon after the link went free is sending back to back:
    # the hand-over itself (the chunk into the socket, a few ms) overlaps the transmission instead
    # of adding to it on every chunk.
    start = self._free_at if now < self._free_at + max(slot, CATCH_UP_S) else now
    self._free_at = start + slot
    delay = self._free_at - now
    if delay >= MIN_SLEEP_S:
      await self._sleep(delay)

  def chunks(self, pace: float = 1.0) -> sender_lib.Chunks:
    """How a bulk sender hands a frame's bytes to this link (transport.sender.Chunks): each chunk
    once it crossed, `pace` times slower than the link's rate (the bench's bursty scenario)."""

    async def paced(buffers: Sequence[memoryview]) -> AsyncIterator[memoryview]:
      chunk_bytes = wire.CHUNK_BYTES
      if self.bytes_per_s is not None:
        chunk_bytes = max(1, min(chunk_bytes, int(self.bytes_per_s / pace * PACED_CHUNK_S)))
      for chunk in wire.iter_chunks(buffers, chunk_bytes):
        await self.transmit(round(chunk.nbytes * pace))
        yield chunk

    return paced


class SharedLink:
  """One host-to-device link shared by threads: a copy starts when the link is free (the copies
  of two threads queue, in arrival order, as on one PCIe link, instead of each running at full
  speed); the real copy time counts toward the emulated one. `bytes_per_s=None`: unpaced."""

  def __init__(self, bytes_per_s: float | None = None) -> None:
    if bytes_per_s is not None and not bytes_per_s > 0:
      raise ValueError(f"link bandwidth must be > 0 bytes/s or None (unpaced); got {bytes_per_s!r}")
    self.bytes_per_s = bytes_per_s
    self._lock = threading.Lock()
    self._free_at = 0.0

  def transfer(self, nbytes: int, started: float) -> float:
    """Sleeps until `nbytes`, handed over at `started`, have crossed; returns the seconds slept."""
    if self.bytes_per_s is None:
      return 0.0
    with self._lock:
      begin = max(started, self._free_at)
      self._free_at = end = begin + nbytes / self.bytes_per_s
    remaining = end - time.perf_counter()
    if remaining > 0:
      time.sleep(remaining)
    return max(0.0, remaining)
