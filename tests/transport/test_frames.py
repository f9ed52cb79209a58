"""The transport's header, limits and chunks, and one call's header and bytes sent together, over
real sockets on 127.0.0.1 (and "::", dual-stack, where this machine has IPv6)."""

from __future__ import annotations

import asyncio
import pickle
import socket

import numpy as np
import pytest

from tests.transport.test_bulk import limits, listener  # pylint: disable=unused-import  (fixtures)
from tunix_stage_plugin.transport import listener as buffers_lib
from tunix_stage_plugin.transport import wire
from tunix_stage_plugin.transport import listener as listener_lib
from tunix_stage_plugin.transport import sender as sender_lib

MIB = 1 << 20


def views(*arrays):
  return [memoryview(a).cast("B") for a in arrays]


def test_a_header_round_trips_and_its_cap_names_the_setting():
  transfer = wire.new_transfer_id()
  assert len(transfer) == wire.TRANSFER_ID_BYTES and transfer != wire.new_transfer_id()
  message = wire.encode_header("fwd_bwd", b"body", views(np.zeros(3, np.int16),
                                                           np.zeros(5, np.uint8)), transfer)
  header = wire.decode_header(message)
  assert header == wire.Header("fwd_bwd", b"body", [6, 5], transfer)
  assert wire.announced_bytes(header, 11, "the setting") == 11
  with pytest.raises(wire.WireError, match=r"fwd_bwd announces 11 bytes \(0.0 MiB\), above "
                     r"this trainer's 10-byte cap on one call \(the setting\); refused before "
                     r"reading any"):
    wire.announced_bytes(header, 10, "the setting")
  with pytest.raises(wire.WireError, match="must be its header"):
    wire.decode_header(pickle.dumps({"method": "m", "body": b"", "sizes": [4]}))


def test_chunks_are_at_most_the_chunk_size_and_never_span_two_buffers():
  chunks = list(wire.iter_chunks(views(np.zeros(10, np.uint8), np.zeros(3, np.uint8)), 4))
  assert [c.nbytes for c in chunks] == [4, 4, 2, 3]


def test_a_call_and_its_bytes_arrive_together(listener):
  server, transfers, _ = listener
  data = np.random.default_rng(0).integers(0, 255, 3 * MIB + 7, np.uint8)
  transfer = wire.new_transfer_id()

  async def go():
    sender = sender_lib.BulkSender("127.0.0.1", server.port)
    received = transfers.expect(transfer, [data.nbytes])

    async def header_call():  # the trainer's side: answers once the bytes are in
      return (await asyncio.wrap_future(received)).buffers

    try:
      return await sender_lib.call_with_bytes(header_call(), sender, transfer, views(data), 1.0)
    finally:
      sender.close()

  buffer, = asyncio.run(go())
  np.testing.assert_array_equal(buffer, data)
  assert buffer.ctypes.data % 64 == 0


def test_a_refused_header_ends_its_send_and_closes_the_connection(listener):
  """The header's call answers (a refusal) while its 64 MiB are still being sent: the send is
  cancelled, its connection closed (never reused half-sent), and the refusal is the answer."""
  server, transfers, _ = listener
  data = np.zeros(64 * MIB, np.uint8)
  transfer = wire.new_transfer_id()

  async def go():
    sender = sender_lib.BulkSender("127.0.0.1", server.port)

    async def refused():
      raise wire.WireError("refused by its header")

    try:
      with pytest.raises(wire.WireError, match="refused by its header"):
        await sender_lib.call_with_bytes(refused(), sender, transfer, views(data), 1.0)
      return list(sender._idle)  # pylint: disable=protected-access
    finally:
      sender.close()

  assert asyncio.run(go()) == []
  transfers.end(transfer)  # the call ended: a frame for it is dropped


def test_a_refused_connection_is_the_calls_error_and_no_header_goes_out():
  """Nothing listens on the port: the connection for the bytes is refused at once, so the
  header's call is never made (cancelled) and the connection's error is the call's."""
  with socket.socket() as probe:
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]  # bound, not listening: connections are refused

    async def go():
      sender = sender_lib.BulkSender("127.0.0.1", port)
      never = asyncio.get_running_loop().create_future()
      with pytest.raises(ConnectionRefusedError):
        await sender_lib.call_with_bytes(never, sender, wire.new_transfer_id(),
                                    views(np.zeros(8, np.uint8)), 0.05)
      return never.cancelled()

    assert asyncio.run(go())


def test_a_dual_stack_listener_takes_ipv4_connections():
  if not socket.has_ipv6:
    pytest.skip("no IPv6 on this machine")
  pool, transfers = buffers_lib.HostBufferPool(), listener_lib.Transfers()
  server = listener_lib.BulkListener(pool, transfers, host="::")
  try:
    server.start()
  except OSError as e:
    pytest.skip(f"cannot bind '::' here: {e}")
  try:
    data = np.arange(1000, dtype=np.int32)
    transfer = wire.new_transfer_id()
    received = transfers.expect(transfer, [data.nbytes])

    async def go():
      sender = sender_lib.BulkSender("127.0.0.1", server.port)
      try:
        lease = await sender.lease()
        await sender.send(lease, transfer, views(data))
        lease.end()
      finally:
        sender.close()

    asyncio.run(go())
    buffer, = received.result(10).buffers
    np.testing.assert_array_equal(buffer.view(np.int32), data)
  finally:
    server.close()
