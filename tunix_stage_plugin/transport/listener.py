"""The trainer's end of the bulk channel: a listener that receives each call's bytes into pooled
aligned buffers and hands them to the call that announced them (its host binds it: 127.0.0.1 for
the embedded trainer, where tunix's server listens for tunix's). It never unpickles anything,
fills buffers only for a transfer whose header passed its cap, and bounds every wait on a peer by
`frames.BulkLimits`. docs/embedded.md "The bulk channel" and "Limits of the bulk channel".
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import socket
import struct
import threading
import time
from typing import Sequence

import numpy as np

from tunix_stage_plugin.core import buffers as buffers_lib
from tunix_stage_plugin.transport import frames
from tunix_stage_plugin.transport.frames import WireError

log = logging.getLogger("tunix_stage_plugin.transport")

RECV_BYTES = 16 << 20  # one recv_into asks for at most this much
REMEMBERED = 4096  # ended transfer ids remembered, so a late frame for one is dropped at once
STOPPING = "the trainer is stopping: its bulk listener closed before this call's bytes arrived"


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

  def __init__(self, limits: frames.BulkLimits = frames.BulkLimits()) -> None:
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
        frames.shutdown(transfer.connection)  # its bytes were still coming: their buffers go back

  def refuse(self, transfer_id: bytes) -> None:
    """A header refused before it announced its id: a frame for it is dropped at once. An id
    another call holds is left alone."""
    with self._cond:
      if transfer_id not in self._open:
        self._remember(transfer_id)
        self._cond.notify_all()

  async def receive(self, transfer_id: bytes, sizes: list[int]) -> frames.Received:
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

  def __init__(self, pool: buffers_lib.HostBufferPool, transfers: Transfers, *,
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
    sock = socket.socket(frames.family(self._host), socket.SOCK_STREAM)
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
          held = sum(c in self._claiming or not frames.hung_up(c) for c in self._connections)
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
      conn.sendall(frames.ACCEPTED)
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
    head = _recv_exact(conn, frames.FRAME_HEADER.size, deadline, what)
    if head is None:
      return False
    magic, transfer_id, count = frames.FRAME_HEADER.unpack(head)
    refused = (f"not a bulk frame header (magic {magic!r})" if magic != frames.MAGIC else
               f"it announced {count} buffers; a frame carries at most {frames.MAX_BUFFERS}"
               if count > frames.MAX_BUFFERS else None)
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
      claimed.future.set_result(frames.Received(buffers, started, time.perf_counter()))
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
      frames.shutdown(sock)  # wakes the accept() blocked in its thread (Linux)
      sock.close()
    for conn in connections:
      frames.shutdown(conn)
    deadline = time.monotonic() + timeout
    for thread in threads:
      thread.join(max(0.0, deadline - time.monotonic()))


def _refuse(conn: socket.socket, why: str) -> None:
  """Tells a connection why it is refused, never blocking the accepting thread."""
  try:
    conn.setblocking(False)
    conn.send(frames.REFUSED + why.encode()[:frames.MAX_REFUSAL_BYTES - 1])
    conn.shutdown(socket.SHUT_WR)
  except OSError:
    pass


def _fail(transfer: _Transfer, error: BaseException) -> None:
  try:
    transfer.future.set_exception(error)
  except concurrent.futures.InvalidStateError:
    pass
