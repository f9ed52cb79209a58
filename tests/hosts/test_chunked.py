"""The chunked form of a tunix call (hosts/tunix/chunked.py), without tunix: framing, refusals,
and one payload far over a real grpc.aio channel's message cap crossing it as a client stream."""

from __future__ import annotations

import asyncio
import pickle

import grpc
import numpy as np
import pytest

from tunix_stage_plugin.core import buffers as buffers_lib
from tunix_stage_plugin.hosts.tunix import chunked

MIB = 1 << 20
CHUNK = chunked.CHUNK_BYTES


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


def receive(messages, pool=None, max_bytes=1 << 40):
  return asyncio.run(chunked.receive(messages, pool or buffers_lib.HostBufferPool(), max_bytes))


def payload():
  rng = np.random.default_rng(0)
  return {"experts": rng.integers(-1, 64, (4, 3 * MIB // 8 + 5, 4), dtype=np.int16),
          "tokens": rng.integers(0, 100, (4, 16), dtype=np.int32), "tag": "x"}


def test_a_call_round_trips_in_chunks_into_aligned_pooled_buffers_without_a_copy():
  sent = payload()
  encoded = chunked.encode(None, "fwd_bwd", (), {"payload": sent, "skip_jit": False})
  assert len(encoded.body) < 4096  # the arrays are out of band
  assert encoded.nbytes == len(encoded.body) + sent["experts"].nbytes + sent["tokens"].nbytes
  messages = list(encoded.messages())
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
    assert got[name].ctypes.data % buffers_lib.ALIGNMENT == 0
  # The big array *is* the pooled buffer it was received into: held while it lives, reused after.
  assert pool.made == 1 and pool.held_bytes() == experts and pool.idle_bytes() == 0
  del got, kwargs
  assert pool.idle_bytes() == experts


def test_a_large_pickle_travels_as_the_streams_first_part():
  strided = np.arange(4 * MIB, dtype=np.uint8)[::2]  # not contiguous: numpy pickles it in band
  encoded = chunked.encode("r-1", "stage_batch", (), {"payload": {"a": strided}, "key": "k"})
  assert len(encoded.body) > chunked.HEADER_BODY_MAX and not encoded.buffers
  header = chunked.decode_header(next(encoded.messages()), 1 << 40)
  assert header.body is None and header.sizes == [len(encoded.body)]
  request_id, method, _, kwargs = receive(Messages(encoded.messages()))
  assert (request_id, method, kwargs["key"]) == ("r-1", "stage_batch", "k")
  np.testing.assert_array_equal(kwargs["payload"]["a"], strided)


def test_over_measures_the_pickle_and_its_buffers_against_the_cap():
  encoded = chunked.encode(None, "fwd_bwd", (), {"payload": np.zeros(8 * MIB, np.uint8)})
  assert encoded.over(8 * MIB)
  assert encoded.over(encoded.nbytes + chunked.CAP_MARGIN - 1)
  assert not encoded.over(encoded.nbytes + chunked.CAP_MARGIN)


def _messages(sizes, chunks, method="fwd_bwd", body=b"x"):
  return [pickle.dumps({"method": method, "body": body, "sizes": sizes})] + chunks


@pytest.mark.parametrize("messages, message", [
    ([], "ended before its header"),
    ([b"not a pickle"], "did not unpickle"),
    ([pickle.dumps(["method"])], "must be its header, a dict of"),
    (_messages([-1], []), "list of integers >= 0"),
    (_messages(["4"], []), "list of integers >= 0"),
    ([pickle.dumps({"method": 3, "body": b"", "sizes": []})], "name its method as a str"),
    (_messages([], [], body=None), "carry its pickle"),
    (_messages([CHUNK + 1], [b"\0" * (CHUNK + 1)]), "larger than the 4194304-byte chunks"),
    (_messages([8], [b"\0" * 4]), "ended after 4 of the 8 bytes"),
    (_messages([4, 4], [b"\0" * 8]), "overruns buffer 0"),
])
def test_a_stream_that_breaks_the_form_is_refused_naming_the_rule(messages, message):
  with pytest.raises(chunked.StreamError, match=message):
    receive(Messages(messages))


def test_a_header_announcing_more_than_the_cap_is_refused_before_any_chunk_is_read():
  stream = Messages(_messages([6 * MIB, 4 * MIB], [b"\0" * CHUNK] * 3))
  with pytest.raises(chunked.StreamError,
                     match=r"fwd_bwd announces 10485760 bytes \(10.0 MiB\), above this trainer's "
                     r"8388608-byte cap .* refused before reading any of its bytes"):
    receive(stream, max_bytes=8 * MIB)
  assert stream.pulled == 1


def test_a_stream_carrying_more_than_it_announced_is_refused_at_the_first_chunk_past_it():
  stream = Messages(_messages([2 * MIB], [b"\0" * MIB] * 2 + [b"\0"] + [b"\0" * MIB] * 5))
  with pytest.raises(chunked.StreamError, match="carried more than the 2097152 bytes it "
                     "announced"):
    receive(stream)
  assert stream.pulled == 4  # the header, two full chunks, and the one byte past the total


def test_a_pickle_for_another_method_than_the_header_names_is_refused():
  encoded = chunked.encode(None, "update", (), {})
  header = pickle.dumps({"method": "fwd_bwd", "body": encoded.body, "sizes": []})
  with pytest.raises(chunked.StreamError, match="not a request for the method its header names"):
    receive(Messages([header]))


def test_a_payload_far_over_a_grpc_channels_cap_crosses_it_as_a_client_stream():
  """A real grpc.aio server and channel on 127.0.0.1, both capped at 8 MiB a message (as tunix
  caps at 128 MiB): 64 MiB cannot go as one message, and goes as the chunked stream."""
  cap = 8 * MIB
  options = [("grpc.max_send_message_length", cap), ("grpc.max_receive_message_length", cap)]
  sent = np.random.default_rng(1).integers(0, 255, 64 * MIB, dtype=np.uint8)
  pool = buffers_lib.HostBufferPool()

  async def execute(request_iterator, context):
    del context
    _, method, _, kwargs = await chunked.receive(request_iterator, pool, 1 << 30)
    array = kwargs["payload"]
    return pickle.dumps((method, array.nbytes, int(array[::4096].astype(np.int64).sum()),
                         array.ctypes.data % buffers_lib.ALIGNMENT))

  async def unary(request, context):
    return b"unreachable"

  async def main():
    server = grpc.aio.server(options=options)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(chunked.SERVICE, {
        chunked.METHOD_NAME: grpc.stream_unary_rpc_method_handler(execute),
        "Unary": grpc.unary_unary_rpc_method_handler(unary)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
      async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        encoded = chunked.encode(None, "stage_batch", (), {"payload": sent})
        assert encoded.over(cap)
        with pytest.raises(grpc.aio.AioRpcError) as whole:
          await channel.unary_unary(f"/{chunked.SERVICE}/Unary")(
              pickle.dumps(sent), timeout=30)
        reply = await channel.stream_unary(chunked.METHOD)(encoded.messages(), timeout=60)
    finally:
      await server.stop(0)
    return whole.value.code(), pickle.loads(reply)

  code, (method, nbytes, checksum, misalignment) = asyncio.run(main())
  assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
  assert (method, nbytes, misalignment) == ("stage_batch", sent.nbytes, 0)
  assert checksum == int(sent[::4096].astype(np.int64).sum())
