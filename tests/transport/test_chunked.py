"""The bulk format carried as a gRPC client stream (transport/sender.py and transport/listener.py), without tunix: its
messages, refusals, and one payload far over a real grpc.aio channel's message cap crossing it."""

from __future__ import annotations

import asyncio
import pickle

import grpc
import numpy as np
import pytest

from tunix_stage_plugin.transport import listener as buffers_lib
from tunix_stage_plugin.transport import stream
from tunix_stage_plugin.core import contract
from tunix_stage_plugin.transport import wire

MIB = 1 << 20
CHUNK = wire.CHUNK_BYTES
TRANSFER = bytes(wire.TRANSFER_ID_BYTES)


class Messages:
  """An async message stream that counts what the receiver pulled from it."""

  def __init__(self, messages):
    self._messages = list(messages)
    self.pulled = 0

  def __aiter__(self):
    return self

  async def __anext__(self):
    if self.pulled == len(self._messages):
      raise StopAsyncIteration
    self.pulled += 1
    return self._messages[self.pulled - 1]


async def receive_call(messages, pool, max_bytes, setting="the setting"):
  """One chunked call read as the trainer reads it: its header checked, then its chunks."""
  messages = aiter(messages)
  header = await stream.receive_header(messages, max_bytes, setting)
  return header, await stream.receive_chunks(messages, header, pool)


def receive(messages, pool=None, max_bytes=1 << 40):
  header, received = asyncio.run(receive_call(messages, pool or buffers_lib.HostBufferPool(),
                                              max_bytes))
  return wire.decode_received(header, received.buffers)


def payload():
  rng = np.random.default_rng(0)
  return {"experts": rng.integers(-1, 64, (4, 3 * MIB // 8 + 5, 4), dtype=np.int16),
          "tokens": rng.integers(0, 100, (4, 16), dtype=np.int32), "tag": "x"}


def test_a_call_round_trips_in_chunks_into_aligned_pooled_buffers_without_a_copy():
  sent = payload()
  encoded = wire.encode(None, "fwd_bwd", (), {"payload": sent, "skip_jit": False})
  assert len(encoded.body) < 4096  # the arrays are out of band
  assert encoded.nbytes == len(encoded.body) + sent["experts"].nbytes + sent["tokens"].nbytes
  messages = list(stream.messages(encoded))
  # The header, then each buffer in chunks of at most CHUNK_BYTES, never spanning two buffers.
  sizes = [len(m) for m in messages[1:]]
  experts = sent["experts"].nbytes
  assert sizes == [CHUNK] * (experts // CHUNK) + [experts % CHUNK, sent["tokens"].nbytes]
  pool = buffers_lib.HostBufferPool()
  request_id, method, args, kwargs = receive(Messages(messages), pool)
  assert (request_id, method, args) == (None, "fwd_bwd", ())
  got = kwargs["payload"]
  assert kwargs["skip_jit"] is False and got["tag"] == "x"
  for name in ("experts", "tokens"):
    np.testing.assert_array_equal(got[name], sent[name])
    assert got[name].dtype == sent[name].dtype and got[name].flags.writeable
    assert got[name].ctypes.data % wire.ALIGNMENT == 0
  # The big array *is* the pooled buffer it was received into: held while it lives, reused after.
  assert pool.made == 1 and pool.held_bytes() == experts and pool.idle_bytes() == 0
  del got, kwargs
  assert pool.idle_bytes() == experts


def test_a_large_pickle_travels_as_the_streams_first_part():
  strided = np.arange(4 * MIB, dtype=np.uint8)[::2]  # not contiguous: numpy pickles it in band
  encoded = wire.encode("r-1", "stage_batch", (), {"payload": {"a": strided}, "key": "k"})
  assert len(encoded.body) > wire.HEADER_BODY_MAX and not encoded.buffers
  header = wire.decode_header(next(stream.messages(encoded)))
  assert header.body is None and header.sizes == [len(encoded.body)]
  request_id, method, _, kwargs = receive(Messages(stream.messages(encoded)))
  assert (request_id, method, kwargs["key"]) == ("r-1", "stage_batch", "k")
  np.testing.assert_array_equal(kwargs["payload"]["a"], strided)


def test_over_measures_the_pickle_and_its_buffers_against_the_cap():
  encoded = wire.encode(None, "fwd_bwd", (), {"payload": np.zeros(8 * MIB, np.uint8)})
  assert encoded.over(8 * MIB)
  assert encoded.over(encoded.nbytes + wire.CAP_MARGIN - 1)
  assert not encoded.over(encoded.nbytes + wire.CAP_MARGIN)


def _messages(sizes, chunks, method="fwd_bwd", body=b"x"):
  return [pickle.dumps({"method": method, "body": body, "sizes": sizes, "transfer": TRANSFER})
          ] + chunks


@pytest.mark.parametrize("messages, message", [
    ([], "ended before its header"),
    ([b"not a pickle"], "did not unpickle"),
    ([pickle.dumps(["method"])], "must be its header, a dict of"),
    (_messages([-1], []), "list of integers >= 0"),
    (_messages(["4"], []), "list of integers >= 0"),
    ([pickle.dumps({"method": 3, "body": b"", "sizes": [], "transfer": TRANSFER})],
     "name its method as a str"),
    (_messages([], [], body=None), "carry its pickle"),
    (_messages([CHUNK + 1], [b"\0" * (CHUNK + 1)]), "larger than the 4194304-byte chunks"),
    (_messages([8], [b"\0" * 4]), "ended after 4 of the 8 bytes"),
    (_messages([4, 4], [b"\0" * 8]), "overruns buffer 0"),
])
def test_a_stream_that_breaks_the_form_is_refused_naming_the_rule(messages, message):
  with pytest.raises(wire.WireError, match=message):
    receive(Messages(messages))


def test_a_header_announcing_more_than_the_cap_is_refused_before_any_chunk_is_read():
  stream = Messages(_messages([6 * MIB, 4 * MIB], [b"\0" * CHUNK] * 3))
  with pytest.raises(wire.WireError,
                     match=r"fwd_bwd announces 10485760 bytes \(10.0 MiB\), above this trainer's "
                     r"8388608-byte cap .* refused before reading any of its bytes"):
    receive(stream, max_bytes=8 * MIB)
  assert stream.pulled == 1


def test_a_stream_carrying_more_than_it_announced_is_refused_at_the_first_chunk_past_it():
  stream = Messages(_messages([2 * MIB], [b"\0" * MIB] * 2 + [b"\0"] + [b"\0" * MIB] * 5))
  with pytest.raises(wire.WireError, match="carried more than the 2097152 bytes it "
                     "announced"):
    receive(stream)
  assert stream.pulled == 4  # the header, two full chunks, and the one byte past the total


def test_a_pickle_for_another_method_than_the_header_names_is_refused():
  encoded = wire.encode(None, "update", (), {})
  header = pickle.dumps({"method": "fwd_bwd", "body": encoded.body, "sizes": [],
                         "transfer": TRANSFER})
  with pytest.raises(wire.WireError, match="not a request for the method its header names"):
    receive(Messages([header]))


async def send_chunked(channel, encoded):
  """Sends `encoded` as the orchestrator's connection does (stream.send); answers the reply (or
  the AioRpcError's code) and how many messages were taken to be sent."""
  sent = 0

  def counted():
    nonlocal sent
    for message in stream.messages(encoded):
      sent += 1
      yield message

  try:
    return pickle.loads(await stream.send(channel, counted(), 60)), sent
  except grpc.aio.AioRpcError as e:
    return e.code(), sent


async def serve_and_send(payload, cap, max_bytes):
  """A real grpc.aio server and channel on 127.0.0.1, both capped at `cap` bytes a message (as
  tunix caps at 128 MiB), serving the chunked method as the trainer's hook does (header accepted
  with STREAM_READY_KEY, then the chunks). Sends `payload` whole (unary), chunked, and chunked to a
  server without the stream."""
  options = [("grpc.max_send_message_length", cap), ("grpc.max_receive_message_length", cap)]
  pool = buffers_lib.HostBufferPool()

  async def execute(request_iterator, context):
    messages = aiter(request_iterator)
    try:
      header = await stream.receive_header(messages, max_bytes, "the setting")
      await context.send_initial_metadata(((contract.STREAM_READY_KEY, contract.STREAM_READY),))
      received = await stream.receive_chunks(messages, header, pool)
      _, method, _, kwargs = wire.decode_received(header, received.buffers)
      del received
    except wire.WireError as e:
      return pickle.dumps(("refused", str(e)))
    array = kwargs["payload"]
    return pickle.dumps((method, array.nbytes, int(array[::4096].astype(np.int64).sum()),
                         array.ctypes.data % wire.ALIGNMENT))

  async def unary(request, context):
    return b"unreachable"

  server = grpc.aio.server(options=options)
  server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(contract.STREAM_SERVICE, {
      contract.STREAM_METHOD_NAME: grpc.stream_unary_rpc_method_handler(execute),
      "Unary": grpc.unary_unary_rpc_method_handler(unary)}),))
  port = server.add_insecure_port("127.0.0.1:0")
  plain = grpc.aio.server(options=options)  # a server without the chunked stream
  plain_port = plain.add_insecure_port("127.0.0.1:0")
  await server.start()
  await plain.start()
  try:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
      with pytest.raises(grpc.aio.AioRpcError) as whole:
        await channel.unary_unary(f"/{contract.STREAM_SERVICE}/Unary")(pickle.dumps(payload),
                                                                        timeout=30)
      encoded = wire.encode(None, "stage_batch", (), {"payload": payload})
      chunks = await send_chunked(channel, encoded)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{plain_port}", options=options) as channel:
      missing = await send_chunked(channel, encoded)
  finally:
    await server.stop(0)
    await plain.stop(0)
  return encoded, whole.value.code(), chunks, missing


def test_a_payload_far_over_a_grpc_channels_cap_crosses_it_as_a_client_stream():
  sent = np.random.default_rng(1).integers(0, 255, 64 * MIB, dtype=np.uint8)
  encoded, whole, (reply, messages), missing = asyncio.run(
      serve_and_send(sent, 8 * MIB, 1 << 30))
  assert encoded.over(8 * MIB) and whole == grpc.StatusCode.RESOURCE_EXHAUSTED
  method, nbytes, checksum, misalignment = reply
  assert (method, nbytes, misalignment) == ("stage_batch", sent.nbytes, 0)
  assert checksum == int(sent[::4096].astype(np.int64).sum())
  assert messages == 1 + 64 * MIB // CHUNK
  # A server without the stream: UNIMPLEMENTED (never the failed write's INTERNAL), no chunk sent.
  assert missing == (grpc.StatusCode.UNIMPLEMENTED, 1)


def test_a_failed_header_write_still_tells_a_server_without_the_stream():
  """A failed write hides the server's answer: one that races it reads INTERNAL, now and then
  (grpc/grpc#36066). A send cap below the header's size fails the header's write every time: a
  server without the stream is still told by UNIMPLEMENTED, one with it by the call's own
  RESOURCE_EXHAUSTED."""

  async def execute(request_iterator, context):
    async for _ in request_iterator:
      pass
    return pickle.dumps("served")

  async def send_to_both(encoded):
    answers = []
    for handlers in ((), (grpc.method_handlers_generic_handler(contract.STREAM_SERVICE, {
        contract.STREAM_METHOD_NAME: grpc.stream_unary_rpc_method_handler(execute)}),)):
      server = grpc.aio.server()
      server.add_generic_rpc_handlers(handlers)
      port = server.add_insecure_port("127.0.0.1:0")
      await server.start()
      try:
        async with grpc.aio.insecure_channel(
            f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 64)]) as channel:
          answers.append(await send_chunked(channel, encoded))
      finally:
        await server.stop(0)
    return answers

  encoded = wire.encode(None, "fwd_bwd", (), {"payload": np.zeros(MIB, np.uint8)})
  assert len(encoded.header(TRANSFER)) > 64
  without, with_stream = asyncio.run(send_to_both(encoded))
  assert without == (grpc.StatusCode.UNIMPLEMENTED, 1)
  assert with_stream == (grpc.StatusCode.RESOURCE_EXHAUSTED, 1)


def test_a_refused_header_is_answered_before_any_chunk_is_sent():
  sent = np.zeros(64 * MIB, dtype=np.uint8)
  _, _, (reply, messages), _ = asyncio.run(serve_and_send(sent, 8 * MIB, 16 * MIB))
  assert reply[0] == "refused" and "refused before reading any of its bytes" in reply[1]
  assert messages == 1  # the header only: the client never sent a chunk


def test_a_received_call_says_what_its_header_announced_and_when_its_bytes_came():
  encoded = wire.encode(None, "fwd_bwd", (), {"payload": payload()})
  header, received = asyncio.run(receive_call(Messages(stream.messages(encoded)),
                                              buffers_lib.HostBufferPool(), 1 << 40))
  assert header.method == "fwd_bwd"
  assert header.announced == sum(b.nbytes for b in encoded.buffers)
  assert received.started <= received.ended
