"""The bulk byte channel of both hosts: a call's array bytes on a plain TCP connection.

Why not gRPC for the bytes: grpcio's Python path copies every byte twice on each side (into and
out of its slices) and pays a Python message per chunk, about 0.5-1 GiB/s on this project's
2-core machines, while a socket sends the arrays from the caller's own memory and receives them
straight into the aligned buffer that is placed: one kernel copy per side, 2.5-4 GiB/s
(docs/performance.md). The call itself (method, pickle, sizes, deadline, liveness, errors) stays
on gRPC; only the bytes travel here, keyed by the 128-bit transfer id the call's header carries.
(Newer tunix took the same route: a bulk TCP side channel next to its gRPC service.)

A frame is MAGIC, the transfer id (16 bytes), the buffer count (u32) and sizes (u64 each), then
the buffers' bytes in order. The listener binds where its host says (the embedded trainer:
127.0.0.1; tunix's trainer: where tunix's server listens), never unpickles, and fills
buffers only for a transfer a gRPC call has announced (and whose sizes passed that call's cap):
a frame nobody announced waits at most CLAIM_WAIT_S, allocating nothing, then its connection is
dropped. docs/embedded.md "The bulk channel" and "Limits of one call", docs/tunix.md.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import socket
import struct
import threading
import time
from typing import Protocol, Sequence

import numpy as np

from tunix_stage_plugin.core import buffers as buffers_lib
from tunix_stage_plugin.transport import frames as wire

log = logging.getLogger("tunix_stage_plugin.transport")

MAGIC = b"TSB1"
HEADER = struct.Struct(f"<4s{wire.TRANSFER_ID_BYTES}sI")  # magic, transfer id, buffer count
MAX_BUFFERS = 1 << 16
# How long a frame waits for the gRPC header of its call (they are sent together: milliseconds).
CLAIM_WAIT_S = 30.0
RECV_BYTES = 16 << 20  # one recv_into asks for at most this much
MAX_CONNECTIONS = 32
REMEMBERED = 4096  # ended transfer ids remembered, so a late frame for one is dropped at once


@dataclasses.dataclass
class Received:
  """A transfer's bytes, in the buffers they were received into, and when they arrived."""

  buffers: list[np.ndarray]
  started: float  # perf_counter: the frame's header was read (its call announced)
  ended: float  # the last byte was read


class _Transfer:
  __slots__ = ("sizes", "future", "claimed", "connection")

  def __init__(self, sizes: list[int]) -> None:
    self.sizes = sizes
    self.future: concurrent.futures.Future = concurrent.futures.Future()
    self.claimed = False
    self.connection: socket.socket | None = None  # the one receiving its bytes, once claimed


class Transfers:
  """Transfer ids announced by gRPC calls, matched with the frames that carry their bytes."""

  def __init__(self) -> None:
    self._cond = threading.Condition()
    self._open: dict[bytes, _Transfer] = {}
    self._ended: collections.OrderedDict[bytes, None] = collections.OrderedDict()
    self._closed = False

  def close(self) -> None:
    """No frame is claimed any more (the listener is stopping): waiting frames are dropped."""
    with self._cond:
      self._closed = True
      self._cond.notify_all()

  def expect(self, transfer_id: bytes, sizes: list[int]) -> concurrent.futures.Future:
    """Called for a call's header: its bytes will arrive under `transfer_id`."""
    with self._cond:
      if transfer_id in self._open or transfer_id in self._ended:
        raise wire.WireError("a bulk transfer id was used twice; ids are single-use")
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
        _shutdown(transfer.connection)  # its bytes were still coming: their buffers go back now

  def _remember(self, transfer_id: bytes) -> None:
    self._ended[transfer_id] = None
    while len(self._ended) > REMEMBERED:
      self._ended.popitem(last=False)

  def claim(self, transfer_id: bytes, timeout: float, connection: socket.socket | None = None
            ) -> _Transfer | str:
    """For a frame's header: the announced transfer, or why the frame is not wanted. A call that
    ends before its bytes are in shuts `connection` down (the receive stops, its buffers go)."""
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


def _recv_exact(sock: socket.socket, nbytes: int) -> bytes | None:
  """Exactly `nbytes`, or None at a clean end of stream before the first byte."""
  data = bytearray()
  while len(data) < nbytes:
    piece = sock.recv(nbytes - len(data))
    if not piece:
      if not data:
        return None
      raise ConnectionError(f"the connection closed {len(data)} bytes into a {nbytes}-byte "
                            "frame header")
    data += piece
  return bytes(data)


def _recv_into(sock: socket.socket, buffer: np.ndarray) -> None:
  view = memoryview(buffer).cast("B")
  filled = 0
  while filled < view.nbytes:
    n = sock.recv_into(view[filled:], min(RECV_BYTES, view.nbytes - filled))
    if not n:
      raise ConnectionError(f"the connection closed after {filled} of {view.nbytes} bytes")
    filled += n


class BulkListener:
  """Receives frames on `host`: a thread per connection (so the event loop moves no bytes),
  each frame into buffers from `pool`, delivered to the call that announced it."""

  def __init__(self, pool: buffers_lib.HostBufferPool, transfers: Transfers, *,
               host: str = "127.0.0.1") -> None:
    self._pool = pool
    self._transfers = transfers
    self._host = host
    self._sock: socket.socket | None = None
    self._lock = threading.Lock()
    self._connections: set[socket.socket] = set()
    self._threads: list[threading.Thread] = []
    self.port: int | None = None

  def start(self) -> int:
    sock = socket.socket(_family(self._host), socket.SOCK_STREAM)
    try:
      if sock.family == socket.AF_INET6:  # "::" takes IPv4 connections too, as tunix's "[::]"
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
      sock.bind((self._host, 0))
      sock.listen(MAX_CONNECTIONS)
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
        conn, _ = listening.accept()
      except OSError:  # closed: the listener is stopping
        return
      with self._lock:
        if self._sock is None or len(self._connections) >= MAX_CONNECTIONS:
          conn.close()
          continue
        self._connections.add(conn)
        self._threads = [t for t in self._threads if t.is_alive()]
        thread = threading.Thread(target=self._serve, args=(conn,), name="trainer-bulk-recv",
                                  daemon=True)
        self._threads.append(thread)
      thread.start()

  def _serve(self, conn: socket.socket) -> None:
    try:
      conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
      while self._receive_frame(conn):
        pass
    except OSError as e:  # the peer went away or the listener is stopping
      log.debug("bulk connection ended: %s", e)
    finally:
      with self._lock:
        self._connections.discard(conn)
      conn.close()

  def _receive_frame(self, conn: socket.socket) -> bool:
    """One frame; False when the connection should end (closed, or a frame not wanted)."""
    head = _recv_exact(conn, HEADER.size)
    if head is None:
      return False
    magic, transfer_id, count = HEADER.unpack(head)
    if magic != MAGIC or count > MAX_BUFFERS:
      log.warning("dropped a bulk connection: not a frame header (magic %r, %d buffers)", magic,
                  count)
      return False
    raw_sizes = _recv_exact(conn, 8 * count) if count else b""
    sizes = list(struct.unpack(f"<{count}Q", raw_sizes or b""))
    claimed = self._transfers.claim(transfer_id, CLAIM_WAIT_S, conn)
    if isinstance(claimed, str):
      log.debug("dropped a bulk frame: %s", claimed)
      return False
    if sizes != claimed.sizes:
      _fail(claimed, wire.WireError(
          f"the bulk frame announced buffer sizes {sizes!r:.80} where the call's header "
          f"announced {claimed.sizes!r:.80}"))
      return False
    started = time.perf_counter()
    buffers = self._pool.take_all(sizes)
    try:
      for buffer in buffers:
        _recv_into(conn, buffer)
    except OSError as e:
      _fail(claimed, wire.WireError(f"the bulk connection broke mid-transfer: {e}"))
      raise
    try:
      claimed.future.set_result(Received(buffers, started, time.perf_counter()))
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
      try:
        sock.shutdown(socket.SHUT_RDWR)  # wakes the accept() blocked in its thread (Linux)
      except OSError:
        pass
      sock.close()
    for conn in connections:
      try:
        conn.shutdown(socket.SHUT_RDWR)
      except OSError:
        pass
    deadline = time.monotonic() + timeout
    for thread in threads:
      thread.join(max(0.0, deadline - time.monotonic()))


def _shutdown(sock: socket.socket) -> None:
  try:
    sock.shutdown(socket.SHUT_RDWR)
  except OSError:
    pass


def _family(host: str) -> socket.AddressFamily:
  return socket.AF_INET6 if ":" in host else socket.AF_INET


class Pacer(Protocol):
  """An emulated link the sender waits on before each chunk (the embedded host's LinkPacer)."""

  async def transmit(self, nbytes: int) -> None: ...


def _fail(transfer: _Transfer, error: BaseException) -> None:
  try:
    transfer.future.set_exception(error)
  except concurrent.futures.InvalidStateError:
    pass


class BulkSender:
  """The orchestrator's side: frames sent on idle connections (one per transfer in flight),
  from the arrays' own memory, each chunk paced by the emulated link first (if any)."""

  def __init__(self, host: str, port: int, pacer: Pacer | None = None) -> None:
    self._address = (host, port)
    self._pacer = pacer
    self._idle: list[socket.socket] = []
    self.sent_bytes = 0  # the buffers' bytes handed to the kernel, frames' headers excluded

  async def _connection(self) -> socket.socket:
    if self._idle:
      return self._idle.pop()
    sock = socket.socket(_family(self._address[0]), socket.SOCK_STREAM)
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
      await asyncio.get_running_loop().sock_connect(sock, self._address)
    except BaseException:
      sock.close()
      raise
    return sock

  async def send(self, transfer_id: bytes, buffers: Sequence[memoryview], pace: float = 1.0
                 ) -> None:
    """Sends one frame; a connection is reused only after a whole frame went out."""
    loop = asyncio.get_running_loop()
    sizes = [b.nbytes for b in buffers]
    header = HEADER.pack(MAGIC, transfer_id, len(sizes)) + struct.pack(f"<{len(sizes)}Q", *sizes)
    sock = await self._connection()
    sent = False
    try:
      await loop.sock_sendall(sock, header)
      for chunk in wire.iter_chunks(buffers):
        if self._pacer is not None:
          await self._pacer.transmit(round(chunk.nbytes * pace))
        await loop.sock_sendall(sock, chunk)
        self.sent_bytes += chunk.nbytes
      sent = True
    finally:
      if sent:
        self._idle.append(sock)
      else:
        sock.close()

  def close(self) -> None:
    idle, self._idle = self._idle, []
    for sock in idle:
      sock.close()
