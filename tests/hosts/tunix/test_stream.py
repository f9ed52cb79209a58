"""The chunked stream for calls over tunix's message cap, against tunix's real gRPC server and
handle in one process (the two-process 256 MiB job is in test_grpc.py).

Each test lowers tunix's cap (its private `_MAX_MESSAGE_BYTES`, read when a server or channel is
made) to 8 MiB in this process, so a 24 MiB payload is over it without moving hundreds of MiB. The
server hosts a real TrainerWorker whose trainer records what it was given and on which thread.
"""

from __future__ import annotations

import asyncio
import threading
import types
from unittest import mock

import numpy as np
import pytest

pytest.importorskip("tunix.experimental.orchestrator.rl_program",
                    reason="tunix's experimental stack (google/tunix main) is not importable")

from tunix.experimental.common import datatypes  # pylint: disable=wrong-import-position
from tunix.experimental.orchestrator import distributed_rl_engine
from tunix.experimental.train import peft_trainer_v2
from tunix.experimental.worker import remote_execution
from tunix.experimental.worker import trainer_worker

import grpc  # pylint: disable=wrong-import-position
import jax
import portpicker  # tunix's own test dependency
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tunix_stage_plugin.activation import manager
from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.core.contract import StageStatus
from tunix_stage_plugin.core import contract
from tunix_stage_plugin.hosts.tunix import orchestrator
from tunix_stage_plugin.hosts.tunix.adapter import ADAPTER
from tunix_stage_plugin.transport import wire

pytestmark = pytest.mark.tunix
ACTOR = datatypes.Role.ACTOR
MIB = 1 << 20
CAP = 8 * MIB


class RecordingTrainer(peft_trainer_v2.PeftTrainer):
  """A PeftTrainer (so it can stage) that records each fwd_bwd's prepared payload and thread and
  counts updates instead of computing; its model is on a one-device mesh."""

  def __init__(self):  # pylint: disable=super-init-not-called  (nothing of PeftTrainer is run)
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    self.model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    self.config = types.SimpleNamespace(data_sharding_axis=("fsdp",))
    nnx.update(self.model, jax.tree.map(
        lambda x: jax.device_put(x, NamedSharding(mesh, PartitionSpec())), nnx.state(self.model)))
    self.fwd = []
    self.updates = 0

  def fwd_bwd(self, payload, **kwargs):
    prepared = self._prepare_payload(payload)  # the staged batch as placed, or the payload
    self.fwd.append((prepared, kwargs, threading.current_thread().name))

  def update(self, **kwargs):
    self.updates += 1
    return self.updates


@pytest.fixture
def cap(monkeypatch):
  monkeypatch.setattr(remote_execution, "_MAX_MESSAGE_BYTES", CAP)
  return CAP


@pytest.fixture
def staging():
  """Staging installed, with the trainer's side channel off (servers start without it), so calls
  over the cap take the chunked stream; the side channel's own tests are in test_side.py."""
  manager.uninstall("tunix", quiet=True)
  assert manager.install(config_lib.resolve({"mode": "stage"}, env={}), quiet=True).installed
  ADAPTER.installation.serve_side_channel = False
  yield ADAPTER.installation
  manager.uninstall("tunix", quiet=True)


def big(seed=0, mib=24):
  return {"experts": np.random.default_rng(seed).integers(-1, 64, mib * MIB // 2, np.int16),
          "tokens": np.arange(16, dtype=np.int32) + seed}


async def serve(worker):
  server = remote_execution.GrpcRemoteExecutionServer(worker)
  port = portpicker.pick_unused_port()
  await server.start_serving_async(port)
  handle = remote_execution.ActorHandle.from_address(f"grpc://127.0.0.1:{port}",
                                                     rpc_timeout_s=30)
  return server, handle, distributed_rl_engine.DistributedRLEngine([], {ACTOR: handle})


async def close(server, handle, engine):
  await ADAPTER.installation.orchestrator_side().close_connections()
  await handle.close()
  await server.stop_serving()


def new_worker():
  worker = trainer_worker.TrainerWorker(RecordingTrainer)
  worker.initialize()
  return worker


def test_an_inline_train_call_over_the_cap_goes_in_chunks_and_runs_on_the_compute_lane(
    cap, staging):
  worker = new_worker()
  sent = big()

  async def main():
    server, handle, engine = await serve(worker)
    assert server in staging.trainer_side().streaming_servers
    router = ADAPTER.installation.orchestrator_side()
    try:
      with pytest.raises(grpc.aio.AioRpcError) as unary:  # tunix's own call cannot carry it
        await engine.train_step(sent, role=ACTOR)
      trained = await router.train(engine, sent, stage_key=None,
                                       apply_optimizer=True)
    finally:
      await close(server, handle, engine)
    return unary.value.code(), trained.result, router

  code, result, router = asyncio.run(main())
  assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
  trainer = worker._trainer  # pylint: disable=protected-access
  (payload, kwargs, thread), = trainer.fwd
  np.testing.assert_array_equal(payload["experts"], sent["experts"])
  np.testing.assert_array_equal(payload["tokens"], sent["tokens"])
  assert kwargs == {} and thread.startswith("trainer-compute")  # the executor's compute lane
  assert payload["experts"].ctypes.data % 64 == 0 and payload["experts"].flags.writeable
  # The host's train_step answer, with its fwd_bwd sent in chunks and its update unary.
  assert set(result) == {"fwd_bwd", "updated", "train_step", "accumulated"}
  assert result["updated"] is True and result["train_step"] == 1 and result["accumulated"]
  assert result["fwd_bwd"].metadata["queued"] is True
  assert staging.trainer_side().chunked_calls == {"fwd_bwd": 1} and trainer.updates == 1
  sent_bytes = wire.encode(None, "fwd_bwd", (), {"payload": sent, "skip_jit": False}).nbytes
  assert (router.calls[contract.STREAM], router.bytes[contract.STREAM]) == (1, sent_bytes)


def test_below_the_cap_the_inline_call_is_the_hosts_own_train_step(cap, staging):
  worker = new_worker()
  small = big(mib=1)

  async def main():
    server, handle, engine = await serve(worker)
    router = ADAPTER.installation.orchestrator_side()
    calls = orchestrator.StagingCalls(router, engine)
    host = distributed_rl_engine.DistributedRLEngine.train_step
    try:
      with mock.patch.object(distributed_rl_engine.DistributedRLEngine, "train_step",
                             autospec=True, side_effect=host) as train_step:
        await calls.train(small, stage_key=None, apply_optimizer=False)
        await calls.train(big(), stage_key=None, apply_optimizer=True)
    finally:
      await close(server, handle, engine)
    return train_step, router

  train_step, router = asyncio.run(main())
  # The small one: exactly the host's call; the big one never reached it (it would be refused).
  assert train_step.call_args_list == [mock.call(mock.ANY, small, role=ACTOR,
                                                 accumulate_gradients=True,
                                                 apply_optimizer=False)]
  assert router.calls[contract.STREAM] == 1 and staging.trainer_side().chunked_calls == {"fwd_bwd": 1}
  assert worker._trainer.updates == 1  # pylint: disable=protected-access


def test_a_stage_over_the_cap_goes_in_chunks_on_the_staging_lane(cap, staging):
  worker = new_worker()
  sent = big(3)

  async def main():
    server, handle, engine = await serve(worker)
    try:
      outcome = await engine.stage_train_batch(sent, key="big-1")
      await engine.train_step(None, role=ACTOR, apply_optimizer=False, stage_key="big-1")
    finally:
      await close(server, handle, engine)
    return outcome

  assert asyncio.run(main()).status is StageStatus.STAGED
  assert staging.trainer_side().chunked_calls == {"stage_batch": 1}  # the train call by key went unary
  (placed, _, _), = worker._trainer.fwd  # pylint: disable=protected-access
  assert isinstance(placed["experts"], jax.Array)  # placed at stage time, on the staging lane
  np.testing.assert_array_equal(np.asarray(placed["experts"]), sent["experts"])


def test_a_header_over_the_trainers_cap_is_refused_before_its_bytes(cap, staging):
  worker = new_worker()
  staging.max_stream_bytes = 16 * MIB

  async def main():
    server, handle, engine = await serve(worker)
    try:
      with pytest.raises(RuntimeError) as refused:
        await ADAPTER.installation.orchestrator_side().train(engine, big(),
                               stage_key=None, apply_optimizer=False)
    finally:
      await close(server, handle, engine)
    return str(refused.value)

  message = asyncio.run(main())
  assert message.startswith("RemoteExecutionError [WireError]: fwd_bwd announces 25165888 "
                            "bytes (24.0 MiB), above this trainer's 16777216-byte cap"), message
  assert "refused before reading any of its bytes" in message
  assert worker._trainer.fwd == [] and not staging.trainer_side().chunked_calls  # pylint: disable=protected-access


def test_a_trainer_without_the_stream_stops_an_over_cap_call_with_one_line(cap):
  """The trainer's server is started with staging off (tunix's own server, no stream); then
  staging is switched on in this process, as on an orchestrator whose trainer lacks it."""
  worker = new_worker()
  manager.uninstall("tunix", quiet=True)

  async def main():
    server, handle, engine = await serve(worker)
    manager.install(config_lib.resolve({"mode": "stage"}, env={}), quiet=True)
    try:
      outcome = await engine.stage_train_batch(big(), key="big-1")
      with pytest.raises(orchestrator.PayloadOverCap) as stopped:
        await ADAPTER.installation.orchestrator_side().train(engine, big(),
                               stage_key=None, apply_optimizer=True)
      await ADAPTER.installation.orchestrator_side().close_connections()
    finally:
      manager.uninstall("tunix", quiet=True)
      await handle.close()
      await server.stop_serving()
    return outcome, stopped.value

  outcome, stopped = asyncio.run(main())
  line = str(stopped)
  assert "\n" not in line and stopped.__cause__ is None and stopped.__suppress_context__
  assert line.startswith("tunix-stage: a fwd_bwd call carrying 24.0 MiB is over tunix's 8 MiB "
                         "message cap"), line
  assert line.endswith("set TUNIX_STAGE_BATCH=stage on both the orchestrator and the trainer")
  assert outcome.status is StageStatus.UNSUPPORTED and outcome.reason.startswith(
      "tunix-stage: a stage_batch call carrying 24.0 MiB")  # stops offering: no resend
  assert worker._trainer.fwd == []  # pylint: disable=protected-access


def test_uninstall_removes_the_stream_from_servers_started_after(cap, staging):
  manager.uninstall("tunix", quiet=True)
  assert "_server" not in vars(remote_execution.GrpcRemoteExecutionServer)
  worker = new_worker()

  async def main():
    server, handle, engine = await serve(worker)
    try:
      channel = grpc.aio.insecure_channel(handle.target_address.replace("grpc://", ""))
      with pytest.raises(grpc.aio.AioRpcError) as missing:
        await channel.stream_unary(contract.STREAM_METHOD)(iter([b"x"]), timeout=10)
      await channel.close()
    finally:
      await handle.close()
      await server.stop_serving()
    return missing.value.code(), server._server  # pylint: disable=protected-access

  code, grpc_server = asyncio.run(main())
  assert code == grpc.StatusCode.UNIMPLEMENTED and grpc_server is not None


class Reference:
  """A reference worker's per_token_logps (not a TrainerWorker: tunix runs it on the loop)."""

  def __init__(self):
    self.threads = []

  def per_token_logps(self, items):
    self.threads.append(threading.current_thread().name)
    return np.asarray(items["experts"][:4], np.float32)


def test_reference_log_probs_over_the_cap_go_in_chunks_to_the_reference_worker(cap, staging):
  reference = Reference()

  async def main():
    server = remote_execution.GrpcRemoteExecutionServer(reference)
    port = portpicker.pick_unused_port()
    await server.start_serving_async(port)
    handle = remote_execution.ActorHandle.from_address(f"grpc://127.0.0.1:{port}",
                                                       rpc_timeout_s=30)
    engine = distributed_rl_engine.DistributedRLEngine(
        [], {}, inference_workers={datatypes.Role.REFERENCE: handle})
    router = ADAPTER.installation.orchestrator_side()
    try:
      # The engine's own method, hooked: tunix's call below the cap, the stream above it.
      small = await engine.per_token_logps(datatypes.Role.REFERENCE, items=big(1, 1))
      calls_small = router.calls[contract.STREAM]
      large = await engine.per_token_logps(datatypes.Role.REFERENCE, items=big(2))
    finally:
      await close(server, handle, engine)
    return small, calls_small, large, router.calls[contract.STREAM]

  small, calls_small, large, calls = asyncio.run(main())
  np.testing.assert_array_equal(small, big(1, 1)["experts"][:4])
  np.testing.assert_array_equal(large, big(2)["experts"][:4])
  assert (calls_small, calls) == (0, 1) and staging.trainer_side().chunked_calls == {"per_token_logps": 1}
  # Not a TrainerWorker: run as tunix runs a unary call to it, on the server's loop.
  assert reference.threads == [threading.current_thread().name] * 2
