"""Aligned host buffers for received payloads, reused once nothing references them.

Why: numpy arrays unpickled over a 64-byte-aligned buffer are writable and aligned, and on CPU
`jax.device_put` of one is zero-copy; a fresh large buffer costs its page faults on first touch
(docs/performance.md "Throughput of the host path"). So the receive path takes its buffers from a
`HostBufferPool`, where a buffer goes back only when no array, view or JAX alias references it
(CPython's reference count of its owner). A pool can be bounded in transfers (`set_bound`),
counting on CPU the buffers whose computation has not ended.
docs/tunix.md "Where the trainer's memory goes"; docs/embedded.md "How a call travels".
"""

from __future__ import annotations

import gc
import sys
import threading
import time
from typing import Sequence

import numpy as np

from tunix_stage_plugin.core import tracks
from tunix_stage_plugin.core.telemetry import recorder as recorder_lib

ALIGNMENT = 64
POOL_MIN_BYTES = 1 << 20  # smaller buffers are allocated fresh: their faults cost nothing
# A take that finds every buffer of its size in use waits this long at most (and no longer than
# a fresh buffer's faults at FAULT_BYTES_PER_S would take) for one to come back from JAX.
RELEASE_WAIT_S = 0.05
FAULT_BYTES_PER_S = 4 << 30
# A bounded pool's transfer waits this long at most for in-use buffers to come back (computations
# that end); then it makes its buffers as an unbounded pool would, and counts it (`over_bound`).
BOUND_WAIT_S = 2.0


def aligned_empty(nbytes: int) -> np.ndarray:
  """A writable uint8 buffer of `nbytes` whose data starts on a 64-byte boundary."""
  raw = np.empty(nbytes + ALIGNMENT, dtype=np.uint8)
  offset = (-raw.ctypes.data) % ALIGNMENT
  return raw[offset:offset + nbytes]


class _Slot:
  __slots__ = ("raw", "nbytes")

  def __init__(self, nbytes: int) -> None:
    self.raw = aligned_empty(nbytes).base  # the owner: every view handed out refers to it
    self.nbytes = nbytes

  def free(self) -> bool:
    # References: this slot's attribute and getrefcount's own argument. Any view, any array
    # unpickled over one, any JAX array aliasing one holds one more.
    return sys.getrefcount(self.raw) <= 2

  def view(self) -> np.ndarray:
    offset = (-self.raw.ctypes.data) % ALIGNMENT
    return self.raw[offset:offset + self.nbytes]


class HostBufferPool:
  """Aligned buffers by exact size; `take` reuses a buffer nothing references, else makes one.

  The pool holds at most the buffers that were in use at once (a run's peak), and `trim()` gives
  back the idle ones (between jobs). Thread-safe.
  """

  def __init__(self) -> None:
    self._lock = threading.Lock()
    self._admit = threading.Lock()  # bounded transfers take their buffers one at a time
    self._slots: list[_Slot] = []
    self.made = 0  # buffers allocated (each paid its page faults once)
    self.reused = 0
    self.bound: int | None = None  # transfers whose pooled buffers may be in use at once
    self.bound_wait_s = BOUND_WAIT_S
    self.bound_waits = 0  # transfers that waited for buffers to come back (the bound reached)
    self.over_bound = 0  # of those, the ones that found none back in time and made more
    # Each such wait is a span (tracks.TRAINER_POOL_WAIT: the transfer's pooled bytes, whether
    # it ran out): the trainer's telemetry counts it in its step.
    self.recorder: recorder_lib.Recorder = recorder_lib.DISABLED

  def set_bound(self, transfers: int | None, wait_s: float = BOUND_WAIT_S) -> None:
    """At most `transfers` transfers' worth of pooled bytes in use at once (None: unbounded); a
    transfer beyond it waits at most `wait_s` for a release, then goes ahead anyway."""
    if transfers is not None and (not isinstance(transfers, int) or isinstance(transfers, bool)
                                  or transfers < 1):
      raise ValueError(f"a pool bound must be an int >= 1 (transfers) or None; got {transfers!r}")
    if not isinstance(wait_s, (int, float)) or isinstance(wait_s, bool) or not 0 <= wait_s < 3600:
      raise ValueError(f"a pool bound's wait must be 0-3600 seconds; got {wait_s!r}")
    with self._lock:
      self.bound, self.bound_wait_s = transfers, float(wait_s)

  def take(self, nbytes: int) -> np.ndarray:
    if not isinstance(nbytes, int) or nbytes < 0:
      raise ValueError(f"buffer size must be an int >= 0; got {nbytes!r}")
    if nbytes < POOL_MIN_BYTES:
      return aligned_empty(nbytes)
    view = self._reuse(nbytes)
    if view is None and self._holds(nbytes):
      view = self._await_release(nbytes)
    if view is not None:
      return view
    with self._lock:
      slot = _Slot(nbytes)
      self._slots.append(slot)
      self.made += 1
      return slot.view()

  def _await_release(self, nbytes: int) -> np.ndarray | None:
    # JAX drops its alias of a placed host buffer (the batch trained last) from one of its own
    # threads once the computation is done, and that release waits for the next collection (JAX
    # runs its deferred releases in a gc callback): a young-generation collection (~0.1 ms) gives
    # the buffer back, within a millisecond of the compute measured at 1 GiB. Waiting is bounded
    # by a fraction of what a fresh buffer's page faults would cost.
    deadline = time.monotonic() + min(RELEASE_WAIT_S, nbytes / FAULT_BYTES_PER_S)
    while True:
      gc.collect(0)
      view = self._reuse(nbytes)
      if view is not None or time.monotonic() >= deadline:
        return view
      time.sleep(0.0005)

  def _reuse(self, nbytes: int) -> np.ndarray | None:
    with self._lock:
      for slot in self._slots:
        if slot.nbytes == nbytes and slot.free():
          self.reused += 1
          return slot.view()
    return None

  def _holds(self, nbytes: int) -> bool:
    with self._lock:
      return any(slot.nbytes == nbytes for slot in self._slots)

  def reserve(self, nbytes: int, count: int) -> int:
    """Makes sure `count` buffers of `nbytes` exist, each written once (its pages faulted now,
    not on the first receive into it); returns how many were made. A long job reaches this on
    its own after a few micro-batches; a short one (a benchmark run) starts from it."""
    if nbytes < POOL_MIN_BYTES:
      return 0
    with self._lock:
      missing = count - sum(s.nbytes == nbytes for s in self._slots)
      for _ in range(max(0, missing)):
        slot = _Slot(nbytes)
        slot.view().fill(0)
        self._slots.append(slot)
        self.made += 1
    return max(0, missing)

  def take_all(self, sizes: Sequence[int]) -> list[np.ndarray]:
    """One transfer's buffers, within the pool's bound (see `set_bound`)."""
    pooled = sum(n for n in sizes if isinstance(n, int) and n >= POOL_MIN_BYTES)
    with self._lock:
      bound, wait_s = self.bound, self.bound_wait_s
    if bound is None or pooled == 0:
      return [self.take(n) for n in sizes]
    with self._admit:  # one bounded transfer at a time: the next one counts this one's buffers
      self._within_bound(pooled, bound, wait_s)
      return [self.take(n) for n in sizes]

  def _within_bound(self, nbytes: int, bound: int, wait_s: float) -> None:
    """Waits (at most `wait_s`) while `bound` transfers of `nbytes` would be in use with this
    one."""
    if self._in_use() <= (bound - 1) * nbytes:
      return
    with self._lock:
      self.bound_waits += 1
    with self.recorder.span(tracks.TRAINER_POOL_WAIT, "pool wait", bytes=nbytes) as args:
      deadline, pause, back = time.monotonic() + wait_s, 0.0005, False
      while not back and time.monotonic() < deadline:
        time.sleep(pause)  # a polling interval: JAX gives buffers back from its own threads
        pause = min(2 * pause, 0.005)
        gc.collect(0)  # JAX's deferred releases run in a gc callback (see _await_release)
        back = self._in_use() <= (bound - 1) * nbytes
      args["over"] = not back
    if not back:
      with self._lock:
        self.over_bound += 1

  def _in_use(self) -> int:
    with self._lock:
      return sum(s.nbytes for s in self._slots if not s.free())

  def held_bytes(self) -> int:
    """Bytes of every pooled buffer, in use or idle."""
    with self._lock:
      return sum(s.nbytes for s in self._slots)

  def idle_bytes(self) -> int:
    with self._lock:
      return sum(s.nbytes for s in self._slots if s.free())

  def trim(self) -> int:
    """Gives back the idle buffers; returns their bytes. Buffers in use stay until reused."""
    with self._lock:
      kept, idle = [], 0
      for slot in self._slots:
        if slot.free():
          idle += slot.nbytes
        else:
          kept.append(slot)
      self._slots = kept
    return idle


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
