"""The pool (transport/listener.py) and the chunked stream's sink (transport/stream.py): aligned
receive buffers, reused only once nothing references them (no JAX here; the JAX alias case is
tests/embedded/test_bulk.py)."""

from __future__ import annotations

import pickle
import threading

import numpy as np
import pytest

from tests.embedded.support import wait_for
from tunix_stage_plugin.transport import listener as buffers_lib
from tunix_stage_plugin.transport import stream
from tunix_stage_plugin.transport import wire
from tunix_stage_plugin.lab.bench import trace as trace_lib
from tunix_stage_plugin.core import tracks

MIB = 1 << 20


def test_buffers_are_aligned_writable_and_of_the_asked_size():
  pool = buffers_lib.HostBufferPool()
  for nbytes in (1, 3, MIB - 1, MIB, 5 * MIB + 7):
    buffer = pool.take(nbytes)
    assert buffer.nbytes == nbytes and buffer.dtype == np.uint8
    assert buffer.ctypes.data % wire.ALIGNMENT == 0 and buffer.flags.writeable
  assert pool.made == 2  # only the two of at least POOL_MIN_BYTES are pooled


def test_a_buffer_is_reused_only_once_every_array_over_it_is_gone():
  pool = buffers_lib.HostBufferPool()
  buffer = pool.take(4 * MIB)
  address = buffer.ctypes.data
  # An array unpickled over the buffer (as a received call's is) keeps it from the pool.
  source = np.arange(MIB, dtype=np.float32)
  pieces = []
  body = pickle.dumps(source, protocol=5, buffer_callback=pieces.append)
  buffer[:] = np.frombuffer(pieces[0].raw(), np.uint8)
  array = pickle.loads(body, buffers=[buffer])
  del buffer
  second = pool.take(4 * MIB)
  assert second.ctypes.data != address and pool.made == 2
  assert pool.idle_bytes() == 0
  view = array[10:20]
  del array
  assert pool.take(4 * MIB).ctypes.data not in (address, second.ctypes.data)  # a view holds it
  np.testing.assert_array_equal(view, np.arange(10, 20, dtype=np.float32))
  del view
  assert pool.take(4 * MIB).ctypes.data == address and pool.reused == 1


def test_sizes_are_matched_exactly_and_trim_gives_back_only_idle_buffers():
  pool = buffers_lib.HostBufferPool()
  kept = pool.take(2 * MIB)
  pool.take(3 * MIB)  # dropped at once: idle
  assert pool.held_bytes() == 5 * MIB and pool.idle_bytes() == 3 * MIB
  assert pool.take(3 * MIB).nbytes == 3 * MIB and pool.reused == 1
  assert pool.trim() == 3 * MIB
  assert pool.held_bytes() == 2 * MIB
  del kept
  assert pool.trim() == 2 * MIB and pool.held_bytes() == 0


def test_a_bad_size_is_refused():
  with pytest.raises(ValueError, match="buffer size must be an int >= 0; got -1"):
    buffers_lib.HostBufferPool().take(-1)


def test_reserve_makes_the_missing_buffers_once_and_take_reuses_them():
  pool = buffers_lib.HostBufferPool()
  assert pool.reserve(2 * MIB, 3) == 3 and pool.reserve(2 * MIB, 3) == 0
  assert pool.reserve(MIB - 1, 5) == 0  # too small to pool
  held = [pool.take(2 * MIB) for _ in range(3)]
  assert pool.made == 3 and pool.reused == 3 and all(not b.any() for b in held)


def test_a_chunk_sink_fills_each_buffer_in_order_with_one_copy():
  pool = buffers_lib.HostBufferPool()
  parts = [np.arange(3 * MIB, dtype=np.uint8), np.arange(5, dtype=np.uint8)]
  sink = stream.ChunkSink([p.nbytes for p in parts], pool)
  for part in parts:
    for start in range(0, part.nbytes, 2 * MIB):
      sink.write(part[start:start + 2 * MIB].tobytes())
  got = sink.finish()
  for buffer, part in zip(got, parts):
    np.testing.assert_array_equal(buffer, part)
    assert buffer.ctypes.data % wire.ALIGNMENT == 0


@pytest.mark.parametrize("chunks, message", [
    ([b"\0" * 10], "ended after 10 of the 16 bytes"),
    ([b"\0" * 12, b"\0" * 8], "carried more than the 16 bytes it announced"),
    ([b"\0" * 8, b"\0" * 8], "overruns buffer 0"),
])
def test_a_chunk_sink_refuses_streams_that_break_their_sizes(chunks, message):
  sink = stream.ChunkSink([12, 4], buffers_lib.HostBufferPool())
  with pytest.raises(ValueError, match=message):
    for chunk in chunks:
      sink.write(chunk)
    sink.finish()


def test_a_bounded_pool_waits_for_a_transfer_to_come_back_before_making_more():
  pool = buffers_lib.HostBufferPool()
  pool.set_bound(2, wait_s=60)  # long: the release below, not the wait's end, lets it go
  told = trace_lib.Kept()  # the pool's waits, as a telemetry sink sees them
  pool.recorder = told
  first, second = pool.take_all([4 * MIB, 2 * MIB]), pool.take_all([4 * MIB, 2 * MIB])
  got = []
  third = threading.Thread(target=lambda: got.append(pool.take_all([4 * MIB, 2 * MIB])))
  third.start()
  try:
    wait_for(lambda: pool.bound_waits == 1, 10, "the third transfer waiting for the bound")
    assert not got  # two transfers' buffers are in use: it cannot go ahead
    addresses = sorted(b.ctypes.data for b in first)
    del first  # the first transfer's arrays are gone
  finally:
    third.join(30)
  assert sorted(b.ctypes.data for b in got[0]) == addresses
  assert (pool.made, pool.reused, pool.over_bound) == (4, 2, 0)
  (wait,) = told.spans()  # one wait, for the transfer's pooled bytes, that did not run out
  assert wait.track == tracks.TRAINER_POOL_WAIT and wait.end >= wait.start
  assert dict(wait.args) == {"bytes": 6 * MIB, "over": False}
  del second


def test_a_bounded_pool_goes_ahead_after_its_wait_and_counts_it():
  pool = buffers_lib.HostBufferPool()
  pool.set_bound(1, wait_s=0)
  held = pool.take_all([2 * MIB])
  more = pool.take_all([2 * MIB])  # nothing comes back: it makes its own, as unbounded
  assert more[0].ctypes.data != held[0].ctypes.data
  assert (pool.made, pool.bound_waits, pool.over_bound) == (2, 1, 1)
  small = [pool.take_all([MIB - 1]) for _ in range(3)]  # not pooled: never waits
  assert pool.bound_waits == 1 and len(small) == 3
  pool.set_bound(None)
  pool.take_all([2 * MIB])
  assert (pool.made, pool.bound_waits) == (3, 1)


@pytest.mark.parametrize("bound, wait_s, message", [
    (0, 1.0, "a pool bound must be an int >= 1 \\(transfers\\) or None; got 0"),
    (True, 1.0, "a pool bound must be an int >= 1 \\(transfers\\) or None; got True"),
    (2.0, 1.0, "a pool bound must be an int >= 1 \\(transfers\\) or None; got 2.0"),
    (2, -1, "a pool bound's wait must be 0-3600 seconds; got -1"),
    (2, float("nan"), "a pool bound's wait must be 0-3600 seconds; got nan"),
])
def test_a_bad_pool_bound_is_refused(bound, wait_s, message):
  pool = buffers_lib.HostBufferPool()
  with pytest.raises(ValueError, match=message):
    pool.set_bound(bound, wait_s)
  assert pool.bound is None
