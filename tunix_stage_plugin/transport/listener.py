"""The trainer's end of the bulk channel: a call's bytes received into pooled aligned buffers.

Why pooled and aligned: numpy arrays unpickled over a 64-byte-aligned buffer are writable, and on
CPU `jax.device_put` of one is zero-copy; a fresh large buffer pays its page faults on first
touch. A buffer goes back to its `HostBufferPool` once nothing references it (CPython's reference
count). The listener never unpickles, fills buffers only for a header that passed its cap, and
bounds every wait on a peer by `wire.BulkLimits`. docs/embedded.md "The bulk channel".
"""


from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import gc
import logging
import socket
import struct
import sys
import threading
import time
from typing import Sequence

import numpy as np

from tunix_stage_plugin.core import tracks
from tunix_stage_plugin.core.telemetry import recorder as recorder_lib
from tunix_stage_plugin.transport import wire
from tunix_stage_plugin.transport.wire import WireError

log = logging.getLogger("tunix_stage_plugin.transport")

RECV_BYTES = 16 << 20  # one recv_into asks for at most this much
REMEMBERED = 4096  # ended transfer ids remembered, so a late frame for one is dropped at once
STOPPING = "the trainer is stopping: its bulk listener closed before this call's bytes arrived"


POOL_MIN_BYTES = 1 << 20  # smaller buffers are allocated fresh: their faults cost nothing
# A take that finds every buffer of its size in use waits this long at most (and no longer than
# a fresh buffer's faults at FAULT_BYTES_PER_S would take) for one to come back from JAX.
RELEASE_WAIT_S = 0.05
FAULT_BYTES_PER_S = 4 << 30
# A bounded pool's transfer waits this long at most for in-use buffers to come back (computations
# that end); then it makes its buffers as an unbounded pool would, and counts it (`over_bound`).
BOUND_WAIT_S = 2.0


class _Slot:
  __slots__ = ("raw", "nbytes")

  def __init__(self, nbytes: int) -> None:
    self.raw = wire.aligned_empty(nbytes).base  # the owner: every view handed out refers to it
    self.nbytes = nbytes

  def free(self) -> bool:
    # References: this slot's attribute and getrefcount's own argument. Any view, any array
    # unpickled over one, any JAX array aliasing one holds one more.
    return sys.getrefcount(self.raw) <= 2

  def view(self) -> np.ndarray:
    offset = (-self.raw.ctypes.data) % wire.ALIGNMENT
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
      return wire.aligned_empty(nbytes)
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


# ---------------------------------------------------------------- the bulk channel's listener


class _Transfer:
  __slots__ = ("sizes", "future", "claimed", "connection")

  def __init__(self, sizes: list[int]) -> None:
    self.sizes = sizes
    self.future: concurrent.futures.Future = concurrent.futures.Future()
    self.claimed = False
    self.connection: socket.socket | None = None  # the one receiving its bytes, once claimed


class Transfers:
  """Transfer ids announced by gRPC calls, matched with the frames that carry their bytes.

  Only the call that announced an id ends it (`receive`); a header refused before that marks an
  id nobody holds as ended (`refuse`), so its frame is dropped at once, and never touches an id
  another call holds."""

  def __init__(self, limits: wire.BulkLimits = wire.BulkLimits()) -> None:
    self.limits = limits
    self._cond = threading.Condition()
    self._open: dict[bytes, _Transfer] = {}
    self._ended: collections.OrderedDict[bytes, None] = collections.OrderedDict()
    self._closed = False

  def close(self) -> None:
    """No frame is claimed any more (the listener is stopping): waiting frames are dropped, and a
    call still waiting for its frame to begin fails."""
    with self._cond:
      self._closed = True
      waiting = [t for t in self._open.values() if not t.claimed]
      self._cond.notify_all()
    for transfer in waiting:
      _fail(transfer, WireError(STOPPING))

  def expect(self, transfer_id: bytes, sizes: list[int]) -> concurrent.futures.Future:
    """Called for a call's header: its bytes will arrive under `transfer_id`."""
    with self._cond:
      if self._closed:
        raise WireError(STOPPING)
      if transfer_id in self._open or transfer_id in self._ended:
        raise WireError("a bulk transfer id was used twice; ids are single-use")
      transfer = self._open[transfer_id] = _Transfer(list(sizes))
      self._cond.notify_all()
      return transfer.future

  def end(self, transfer_id: bytes) -> None:
    """The call is over (answered, refused or cancelled): a frame for it is dropped."""
    with self._cond:
      transfer = self._open.pop(transfer_id, None)
      self._remember(transfer_id)
      self._cond.notify_all()
    if transfer is not None:
      transfer.future.cancel()  # no-op once received
      if transfer.connection is not None and transfer.future.cancelled():
        wire.shutdown(transfer.connection)  # its bytes were still coming: their buffers go back

  def refuse(self, transfer_id: bytes) -> None:
    """A header refused before it announced its id: a frame for it is dropped at once. An id
    another call holds is left alone."""
    with self._cond:
      if transfer_id not in self._open:
        self._remember(transfer_id)
        self._cond.notify_all()

  async def receive(self, transfer_id: bytes, sizes: list[int]) -> wire.Received:
    """The bytes a call's header announced. Its frame must begin within `pair_wait_s`; the
    listener bounds the rest. The transfer is ended on every path."""
    future = self.expect(transfer_id, sizes)  # an id in use is refused here, untouched
    try:
      arrival = asyncio.wrap_future(future)
      await asyncio.wait({arrival}, timeout=self.limits.pair_wait_s)
      if not arrival.done() and self._give_up(transfer_id):
        raise WireError(
            f"no bulk frame for this call began within {self.limits.pair_wait_s:g} s of its "
            "header (BulkLimits.pair_wait_s): its bytes never arrived on the bulk channel")
      return await arrival
    finally:
      self.end(transfer_id)

  def _give_up(self, transfer_id: bytes) -> bool:
    """True when the transfer was not claimed by a frame; it can no longer be."""
    with self._cond:
      transfer = self._open.get(transfer_id)
      if transfer is None or transfer.claimed:
        return False
      transfer.claimed = True
      return True

  def _remember(self, transfer_id: bytes) -> None:
    self._ended[transfer_id] = None
    while len(self._ended) > REMEMBERED:
      self._ended.popitem(last=False)

  def claim(self, transfer_id: bytes, connection: socket.socket | None = None
            ) -> _Transfer | str:
    """For a frame's header: the announced transfer, or why the frame is not wanted. Waits at
    most `pair_wait_s` for the call's header. A call that ends before its bytes are in shuts
    `connection` down (the receive stops, its buffers go back)."""
    timeout = self.limits.pair_wait_s
    deadline = time.monotonic() + timeout
    with self._cond:
      while True:
        transfer = self._open.get(transfer_id)
        if transfer is not None and not transfer.claimed:
          transfer.claimed = True
          transfer.connection = connection
          return transfer
        if transfer is not None:
          return "its transfer id is already being received"
        if transfer_id in self._ended:
          return "its call already ended (answered, refused or cancelled)"
        if self._closed:
          return "the listener is closing"
        remaining = deadline - time.monotonic()
        if remaining <= 0:
          return f"no call announced its transfer id within {timeout:g} s"
        self._cond.wait(remaining)


class _Late(TimeoutError):
  """A peer missed a BulkLimits bound; the message names it."""


def _recv_exact(sock: socket.socket, nbytes: int, deadline: float, what: str) -> bytes | None:
  """Exactly `nbytes` by `deadline` (monotonic), or None at a clean end of stream before the
  first byte."""
  data = bytearray()
  while len(data) < nbytes:
    remaining = deadline - time.monotonic()
    try:
      if remaining <= 0:
        raise TimeoutError
      sock.settimeout(remaining)
      piece = sock.recv(nbytes - len(data))
    except TimeoutError:
      raise _Late(f"{len(data)} of the {nbytes} bytes of {what} arrived in time") from None
    if not piece:
      if not data:
        return None
      raise ConnectionError(f"the connection closed {len(data)} bytes into {what}")
    data += piece
  return bytes(data)


def _receive_into(sock: socket.socket, buffers: Sequence[np.ndarray], stall_s: float
                  ) -> str | None:
  """Fills `buffers` from `sock`, each byte within `stall_s` of the last; returns why not (None:
  filled). Returns rather than raises, so no traceback keeps a buffer out of the pool."""
  total = sum(b.nbytes for b in buffers)
  received = 0
  sock.settimeout(stall_s)
  try:
    for buffer in buffers:
      view = memoryview(buffer).cast("B")
      filled = 0
      while filled < view.nbytes:
        n = sock.recv_into(view[filled:], min(RECV_BYTES, view.nbytes - filled))
        if not n:
          return (f"the bulk connection broke mid-transfer: the connection closed after "
                  f"{received} of {total} bytes")
        filled += n
        received += n
  except TimeoutError:
    return (f"the bulk frame stalled after {received} of its {total} bytes: none came for "
            f"{stall_s:g} s (BulkLimits.stall_s)")
  except OSError as e:
    return f"the bulk connection broke mid-transfer: {e}"
  return None


class BulkListener:
  """Receives frames on `host`: a thread per connection (so the event loop moves no bytes),
  each frame into buffers from `pool`, delivered to the call that announced it; `transfers`
  carries the limits it enforces."""

  def __init__(self, pool: HostBufferPool, transfers: Transfers, *,
               host: str = "127.0.0.1") -> None:
    self._pool = pool
    self._transfers = transfers
    self.limits = transfers.limits
    self._host = host
    self._sock: socket.socket | None = None
    self._lock = threading.Lock()
    self._connections: set[socket.socket] = set()
    self._claiming: set[socket.socket] = set()  # their threads wait for a call, not for the peer
    self._threads: list[threading.Thread] = []
    self.port: int | None = None

  def start(self) -> int:
    sock = socket.socket(wire.family(self._host), socket.SOCK_STREAM)
    try:
      if sock.family == socket.AF_INET6:  # "::" takes IPv4 connections too, as tunix's "[::]"
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
      sock.bind((self._host, 0))
      sock.listen(self.limits.max_connections)
    except OSError:
      sock.close()
      raise
    self._sock, self.port = sock, sock.getsockname()[1]
    thread = threading.Thread(target=self._accept, args=(sock,), name="trainer-bulk-accept",
                              daemon=True)
    self._threads.append(thread)
    thread.start()
    return self.port

  def _accept(self, listening: socket.socket) -> None:
    while True:
      try:
        conn, peer = listening.accept()
      except OSError:  # closed: the listener is stopping
        return
      with self._lock:
        stopping = self._sock is None
        held = len(self._connections)
        if held >= self.limits.max_connections:
          # A connection whose peer closed it is on its way out (its thread, reading, sees the
          # end at once): it does not count, unless its thread waits for a call instead.
          held = sum(c in self._claiming or not wire.hung_up(c) for c in self._connections)
        if not stopping and held < self.limits.max_connections:
          self._connections.add(conn)
          self._threads = [t for t in self._threads if t.is_alive()]
          thread = threading.Thread(target=self._serve, args=(conn,), name="trainer-bulk-recv",
                                    daemon=True)
          self._threads.append(thread)
          thread.start()
          continue
      if not stopping:
        why = (f"{held} bulk connections are open, this trainer's cap "
               "(BulkLimits.max_connections); one client queues its sends within it, so the "
               "others are held by other clients")
        log.warning("refused a bulk connection from %s:%d: %s", peer[0], peer[1], why)
        _refuse(conn, why)
      conn.close()

  def _serve(self, conn: socket.socket) -> None:
    try:
      conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
      conn.settimeout(self.limits.header_wait_s)
      conn.sendall(wire.ACCEPTED)
      while self._receive_frame(conn):
        pass
    except _Late as e:
      log.info("closed a bulk connection: %s", e)
    except OSError as e:  # the peer went away or the listener is stopping
      log.debug("bulk connection ended: %s", e)
    finally:
      with self._lock:
        self._connections.discard(conn)
      conn.close()

  def _receive_frame(self, conn: socket.socket) -> bool:
    """One frame; False when the connection should end (closed, or a frame not wanted)."""
    wait = self.limits.header_wait_s
    what = f"a frame header, due within {wait:g} s of the connection's last frame or its " \
           "opening (BulkLimits.header_wait_s)"
    deadline = time.monotonic() + wait
    head = _recv_exact(conn, wire.FRAME_HEADER.size, deadline, what)
    if head is None:
      return False
    magic, transfer_id, count = wire.FRAME_HEADER.unpack(head)
    refused = (f"not a bulk frame header (magic {magic!r})" if magic != wire.MAGIC else
               f"it announced {count} buffers; a frame carries at most {wire.MAX_BUFFERS}"
               if count > wire.MAX_BUFFERS else None)
    sizes: list[int] = []
    if refused is None and count:
      raw_sizes = _recv_exact(conn, 8 * count, deadline, what)
      if raw_sizes is None:
        raise ConnectionError("the connection closed inside a frame header")
      sizes = list(struct.unpack(f"<{count}Q", raw_sizes))
    with self._lock:
      self._claiming.add(conn)
    try:
      claimed = self._transfers.claim(transfer_id, conn)
    finally:
      with self._lock:
        self._claiming.discard(conn)
    if refused is not None:  # its call, if one announced its id, hears why
      log.warning("dropped a bulk connection: %s", refused)
      if not isinstance(claimed, str):
        _fail(claimed, WireError(f"its bulk frame was refused: {refused}"))
      return False
    if isinstance(claimed, str):
      log.debug("dropped a bulk frame: %s", claimed)
      return False
    if sizes != claimed.sizes:
      _fail(claimed, WireError(
          f"the bulk frame announced buffer sizes {sizes!r:.80} where the call's header "
          f"announced {claimed.sizes!r:.80}"))
      return False
    started = time.perf_counter()
    buffers = self._pool.take_all(sizes)
    failure = _receive_into(conn, buffers, self.limits.stall_s)
    if failure is not None:
      buffers.clear()  # back to the pool: nothing else holds them
      log.info("a bulk frame failed: %s", failure)
      _fail(claimed, WireError(failure))
      return False
    try:
      claimed.future.set_result(wire.Received(buffers, started, time.perf_counter()))
    except concurrent.futures.InvalidStateError:  # the call ended meanwhile: drop the bytes
      pass
    return True

  def close(self, timeout: float = 2.0) -> None:
    """Stops accepting, ends every connection and joins the threads (bounded)."""
    with self._lock:
      sock, self._sock = self._sock, None
      connections = list(self._connections)
      threads = list(self._threads)
    self._transfers.close()
    if sock is not None:
      wire.shutdown(sock)  # wakes the accept() blocked in its thread (Linux)
      sock.close()
    for conn in connections:
      wire.shutdown(conn)
    deadline = time.monotonic() + timeout
    for thread in threads:
      thread.join(max(0.0, deadline - time.monotonic()))


def _refuse(conn: socket.socket, why: str) -> None:
  """Tells a connection why it is refused, never blocking the accepting thread."""
  try:
    conn.setblocking(False)
    conn.send(wire.REFUSED + why.encode()[:wire.MAX_REFUSAL_BYTES - 1])
    conn.shutdown(socket.SHUT_WR)
  except OSError:
    pass


def _fail(transfer: _Transfer, error: BaseException) -> None:
  try:
    transfer.future.set_exception(error)
  except concurrent.futures.InvalidStateError:
    pass
