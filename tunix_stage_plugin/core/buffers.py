"""Aligned host buffers for received payloads, reused once nothing references them.

A received micro-batch lands in 64-byte-aligned buffers: numpy arrays unpickled over them are
writable and aligned, and on CPU `jax.device_put` of an aligned buffer is zero-copy (the placed
array *is* the buffer). A fresh 1 GiB buffer costs its page faults on first touch (in this
project's VMs a fresh copy runs at a third of a warm one, docs/performance.md), so the receive
path takes its large buffers from a `HostBufferPool`: a buffer goes back to the pool only when no
array, view or JAX alias references it any more (CPython's reference count of its owner), so a
placement that aliases it on CPU keeps it out of the pool for as long as it lives.
"""

from __future__ import annotations

import gc
import sys
import threading
import time
from typing import Sequence

import numpy as np

ALIGNMENT = 64
POOL_MIN_BYTES = 1 << 20  # smaller buffers are allocated fresh: their faults cost nothing
# A take that finds every buffer of its size in use waits this long at most (and no longer than
# a fresh buffer's faults at FAULT_BYTES_PER_S would take) for one to come back from JAX.
RELEASE_WAIT_S = 0.05
FAULT_BYTES_PER_S = 4 << 30


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
    self._slots: list[_Slot] = []
    self.made = 0  # buffers allocated (each paid its page faults once)
    self.reused = 0

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
    return [self.take(n) for n in sizes]

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
