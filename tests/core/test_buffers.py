"""core.buffers: aligned receive buffers, reused only once nothing references them (no JAX here;
the JAX alias case is tests/embedded/test_bulk.py)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from tunix_stage_plugin.core import buffers as buffers_lib

MIB = 1 << 20


def test_buffers_are_aligned_writable_and_of_the_asked_size():
  pool = buffers_lib.HostBufferPool()
  for nbytes in (1, 3, MIB - 1, MIB, 5 * MIB + 7):
    buffer = pool.take(nbytes)
    assert buffer.nbytes == nbytes and buffer.dtype == np.uint8
    assert buffer.ctypes.data % buffers_lib.ALIGNMENT == 0 and buffer.flags.writeable
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
  sink = buffers_lib.ChunkSink([p.nbytes for p in parts], pool)
  for part in parts:
    for start in range(0, part.nbytes, 2 * MIB):
      sink.write(part[start:start + 2 * MIB].tobytes())
  got = sink.finish()
  for buffer, part in zip(got, parts):
    np.testing.assert_array_equal(buffer, part)
    assert buffer.ctypes.data % buffers_lib.ALIGNMENT == 0


@pytest.mark.parametrize("chunks, message", [
    ([b"\0" * 10], "ended after 10 of the 16 bytes"),
    ([b"\0" * 12, b"\0" * 8], "carried more than the 16 bytes it announced"),
    ([b"\0" * 8, b"\0" * 8], "overruns buffer 0"),
])
def test_a_chunk_sink_refuses_streams_that_break_their_sizes(chunks, message):
  sink = buffers_lib.ChunkSink([12, 4], buffers_lib.HostBufferPool())
  with pytest.raises(ValueError, match=message):
    for chunk in chunks:
      sink.write(chunk)
    sink.finish()
