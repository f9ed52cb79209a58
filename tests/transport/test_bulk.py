"""The bulk byte channel over real sockets on 127.0.0.1: frames matched with the calls that
announced them, in either order, and every frame that is not wanted dropped without allocating."""

from __future__ import annotations

import asyncio
import gc
import secrets
import threading

import numpy as np
import pytest

from tests.embedded.support import bulk_connection, bulk_frame, closed_by_peer, wait_for
from tunix_stage_plugin.transport import listener as buffers_lib
from tunix_stage_plugin.transport import wire
from tunix_stage_plugin.transport import listener as listener_lib
from tunix_stage_plugin.transport import sender as sender_lib

MIB = 1 << 20


@pytest.fixture
def limits():
  return wire.BulkLimits()


@pytest.fixture
def listener(limits):
  pool = buffers_lib.HostBufferPool()
  transfers = listener_lib.Transfers(limits)
  server = listener_lib.BulkListener(pool, transfers)
  server.start()
  yield server, transfers, pool
  before = threading.active_count()
  server.close()
  assert not [t for t in threading.enumerate() if t.name.startswith("trainer-bulk")], before


def _send(port: int, transfer_id: bytes, arrays: list[np.ndarray]) -> None:
  async def go() -> None:
    sender = sender_lib.BulkSender("127.0.0.1", port)
    try:
      lease = await sender.lease()
      await sender.send(lease, transfer_id, [memoryview(a).cast("B") for a in arrays])
      lease.end()
    finally:
      sender.close()
  asyncio.run(go())


def test_a_frame_reaches_its_call_whichever_arrives_first(listener):
  server, transfers, pool = listener
  arrays = [np.random.default_rng(0).integers(0, 255, 9 * MIB + 5, dtype=np.uint8),
            np.arange(100, dtype=np.int64)]
  sizes = [a.nbytes for a in arrays]
  first = secrets.token_bytes(16)
  future = transfers.expect(first, sizes)  # the call's header first
  _send(server.port, first, arrays)
  received = future.result(10)
  second = secrets.token_bytes(16)
  sending = threading.Thread(target=_send, args=(server.port, second, arrays))
  sending.start()  # the bytes first: the frame waits for its call (allocating nothing)
  later = transfers.expect(second, sizes)
  sending.join(10)
  for got in (received, later.result(10)):
    assert [b.nbytes for b in got.buffers] == sizes
    np.testing.assert_array_equal(got.buffers[0], arrays[0])
    np.testing.assert_array_equal(got.buffers[1].view(np.int64), arrays[1])
    assert all(b.ctypes.data % wire.ALIGNMENT == 0 for b in got.buffers)
    assert got.ended >= got.started
  assert pool.made == 2  # the 9 MiB buffer was pooled, once per transfer alive at once


@pytest.mark.parametrize("limits", [wire.BulkLimits(pair_wait_s=0.2)])
def test_frames_that_no_call_wants_are_dropped_before_anything_is_allocated(listener):
  server, transfers, pool = listener
  ended = secrets.token_bytes(16)
  transfers.expect(ended, [MIB])
  transfers.end(ended)  # answered or refused: its late frame is dropped at once
  for frame in (bulk_frame(ended, [MIB]),  # its call ended
                bulk_frame(secrets.token_bytes(16), [MIB]),  # no call announced it
                b"GET / HTTP/1.1\r\n\r\n" + bytes(64)):  # not a frame at all
    with bulk_connection(server.port) as sock:
      sock.sendall(frame)
      assert closed_by_peer(sock, 10)
  assert pool.made == 0
  # The listener still serves a wanted frame afterwards.
  good = secrets.token_bytes(16)
  future = transfers.expect(good, [2 * MIB])
  _send(server.port, good, [np.ones(2 * MIB, np.uint8)])
  assert future.result(10).buffers[0].sum() == 2 * MIB


def test_a_frame_whose_sizes_differ_from_its_header_fails_its_call(listener):
  server, transfers, pool = listener
  transfer_id = secrets.token_bytes(16)
  future = transfers.expect(transfer_id, [MIB])
  with bulk_connection(server.port) as sock:
    sock.sendall(bulk_frame(transfer_id, [64 * MIB]))
    with pytest.raises(wire.WireError, match=r"announced buffer sizes \[67108864\] where the "
                       r"call's header announced \[1048576\]"):
      future.result(10)
  assert pool.made == 0


def test_a_connection_that_breaks_mid_transfer_fails_its_call(listener):
  server, transfers, _ = listener
  transfer_id = secrets.token_bytes(16)
  future = transfers.expect(transfer_id, [4 * MIB])
  with bulk_connection(server.port) as sock:
    sock.sendall(bulk_frame(transfer_id, [4 * MIB]) + bytes(MIB))
  with pytest.raises(wire.WireError, match=r"broke mid-transfer: the connection closed after "
                     r"1048576 of 4194304 bytes"):
    future.result(10)


def test_an_id_is_single_use_and_an_ended_call_drops_its_bytes(listener):
  server, transfers, _ = listener
  transfer_id = secrets.token_bytes(16)
  future = transfers.expect(transfer_id, [MIB])
  with pytest.raises(wire.WireError, match="used twice"):
    transfers.expect(transfer_id, [MIB])
  transfers.end(transfer_id)
  assert future.cancelled()
  with pytest.raises(wire.WireError, match="used twice"):
    transfers.expect(transfer_id, [MIB])


def test_a_sender_reuses_a_connection_only_after_a_whole_frame(listener):
  server, transfers, _ = listener
  connections = []

  async def go() -> None:
    sender = sender_lib.BulkSender("127.0.0.1", server.port)
    try:
      for _ in range(3):
        transfer_id = secrets.token_bytes(16)
        future = transfers.expect(transfer_id, [2 * MIB])
        lease = await sender.lease()
        connections.append(lease.sock)
        await sender.send(lease, transfer_id, [memoryview(np.zeros(2 * MIB, np.uint8))])
        await asyncio.wrap_future(future)
        lease.end()
      # A send cut short closes its connection instead of leaving half a frame on it.
      # Nobody claims this frame, so its bytes back up and the send blocks.
      lease = await sender.lease()
      connections.append(lease.sock)
      stuck = asyncio.ensure_future(sender.send(lease, secrets.token_bytes(16),
                                                [memoryview(np.zeros(256 * MIB, np.uint8))]))
      await asyncio.sleep(0)  # the send starts (it blocks once the socket's buffers are full)
      stuck.cancel()
      await asyncio.gather(stuck, return_exceptions=True)
      assert stuck.cancelled() and connections[-1].fileno() == -1
    finally:
      sender.close()

  asyncio.run(go())
  assert len({id(c) for c in connections[:4]}) == 1


def test_pooled_buffers_aliased_by_jax_on_cpu_are_not_reused_while_the_jax_array_lives():
  """On CPU, device_put of an aligned buffer is zero-copy: the placed array is the buffer, so the
  pool must not hand it out again until the JAX array is gone (the digest tests of
  tests/embedded/test_job.py show the same end to end)."""
  jax = pytest.importorskip("jax")
  pool = buffers_lib.HostBufferPool()
  buffer = pool.take(4 * MIB)
  buffer[:] = 7
  address = buffer.ctypes.data
  placed = jax.device_put(buffer.view(np.float32), jax.devices("cpu")[0])
  jax.block_until_ready(placed)
  aliased = placed.unsafe_buffer_pointer() == address
  del buffer
  other = pool.take(4 * MIB)
  assert other.ctypes.data != address or not aliased
  other[:] = 0
  assert float(np.asarray(placed).view(np.uint8)[:16].sum()) == 7 * 16
  del placed, other
  gc.collect()  # JAX releases its alias at a collection (see the next test)
  assert pool.take(4 * MIB).ctypes.data == address


def test_the_pool_gets_a_buffer_back_from_jax_as_soon_as_its_placed_array_is_gone():
  """JAX releases its alias of a placed buffer only at a later collection (its deferred
  releases run in a gc callback); a take that finds every buffer in use collects and waits
  briefly instead of making another payload-sized one. Without that, an inline trainer held two
  payloads (the one arriving and the last one placed), measured at 1 GiB."""
  jax = pytest.importorskip("jax")
  pool = buffers_lib.HostBufferPool()
  largest = jax.jit(lambda a: a.max())
  addresses = set()
  for value in range(5):
    buffer = pool.take(64 * MIB)
    buffer.view(np.float32)[:] = value
    addresses.add(buffer.ctypes.data)
    placed = jax.device_put(buffer.view(np.float32), jax.devices("cpu")[0])
    del buffer
    assert float(largest(placed)) == value
    del placed
  assert pool.made == 1 and pool.reused == 4 and len(addresses) == 1



def test_a_bounded_pool_counts_a_placed_buffer_until_the_computation_reading_it_ends():
  """On CPU a placed micro-batch is its receive buffer, and JAX holds it until the computation
  that reads it ends, after every Python reference is gone (as after tunix's fwd_bwd, which
  answers once the work is queued). A bounded pool's next transfer waits for that end and reuses
  the buffer; an unbounded one would make a third (it waits a millisecond at most)."""
  jax = pytest.importorskip("jax")
  jnp = jax.numpy

  @jax.jit
  def total(a):  # seconds of work on CPU: still running when the next transfer arrives
    spin = jax.lax.fori_loop(0, 6000, lambda i, x: jnp.sin(x) + 1.0, a[:1 << 16])
    return a.sum() + 0.0 * spin.sum()

  pool = buffers_lib.HostBufferPool()
  pool.set_bound(2, wait_s=120)  # long: the computation's end, not the wait's, lets it go
  device = jax.devices("cpu")[0]
  buffers = [pool.take_all([4 * MIB])[0] for _ in range(2)]
  addresses = [b.ctypes.data for b in buffers]
  for value, buffer in enumerate(buffers):
    buffer.view(np.float32)[:] = value + 1
  computing = jax.device_put(buffers[0].view(np.float32), device)
  staged = jax.device_put(buffers[1].view(np.float32), device)
  if computing.unsafe_buffer_pointer() != addresses[0]:
    pytest.skip("this JAX copies on device_put here: a placed array holds no receive buffer")
  result = total(computing)  # queued (JAX dispatches asynchronously)
  del buffers, computing  # only the computation holds the first buffer now
  assert not result.is_ready()  # precondition: the transfer below comes while it computes
  third = pool.take_all([4 * MIB])[0]
  assert third.ctypes.data == addresses[0] and (pool.made, pool.over_bound) == (2, 0)
  assert pool.bound_waits == 1
  assert float(result) == 1.0 * MIB and float(staged[0]) == 2.0
