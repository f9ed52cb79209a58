"""The tunix hooks against real tunix classes, in one process.

A real StandardRLProgram and DistributedRLEngine drive a real TrainerWorker over tunix's
in-process server (routed through the method executor like the gRPC one). The trainer is a
PeftTrainer subclass that records what fwd_bwd/update received (in order) instead of computing:
tunix's own preparation seam (`_prepare_payload`: `_prepare_inputs` + shard_input) runs as in
production, with its model on a one-device mesh. The two-device gRPC path with tunix's real
PeftTrainer computing is in test_grpc.py.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import types
from unittest import mock

import numpy as np
import pytest

pytest.importorskip("tunix.experimental.orchestrator.rl_program",
                    reason="tunix's experimental stack (google/tunix main) is not importable")

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tunix.experimental.common import datatypes
from tunix.experimental.orchestrator import distributed_rl_engine
from tunix.experimental.orchestrator import rl_program
from tunix.experimental.train import peft_trainer_v2
from tunix.experimental.worker import remote_execution
from tunix.experimental.worker import trainer_worker

from tunix.rl import common as rl_common

from tunix_stage_plugin.activation import manager
from tunix_stage_plugin.core import codec as codec_lib
from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.core import store as store_lib
from tunix_stage_plugin.core.contract import StageStatus
from tunix_stage_plugin.hosts import tunix as tunix_host
from tunix_stage_plugin.core import codec_spec
from tunix_stage_plugin.hosts.tunix.adapter import ADAPTER
from tunix_stage_plugin.core import contract
from tunix_stage_plugin.hosts.tunix import probes
from tunix_stage_plugin.hosts.tunix import orchestrator

pytestmark = pytest.mark.tunix
ACTOR = datatypes.Role.ACTOR
MB_PER_STEP = 4  # mini_batch_size 2 groups x group_size 2 items, one micro-batch per item
ALGO = types.SimpleNamespace(group_size=2, mini_batch_size=2, requires_reference_kl=False)
# How this tunix's train loop is staged: through its seam (patched tree) or the plugin's copy.
WAY = probes.loop_way(rl_program.StandardRLProgram)


@pytest.fixture
def staging(request):
  """Installs the hooks with the given settings for one test; uninstalls after."""
  settings = getattr(request, "param", {})
  cfg = config_lib.resolve({"mode": "stage", "max_staged_batches": 2, "max_device_batches": 4,
                            **settings}, env={})
  manager.uninstall("tunix", quiet=True)
  assert manager.install(cfg, quiet=True).installed
  yield cfg
  manager.uninstall("tunix", quiet=True)


class RecordingTrainer(peft_trainer_v2.PeftTrainer):
  """A PeftTrainer that records each fwd_bwd/update instead of computing (no optimizer, no jit).

  Its fwd_bwd prepares through PeftTrainer's own `_prepare_payload`, as PeftTrainer.fwd_bwd does.
  """

  def __init__(self):  # pylint: disable=super-init-not-called  (nothing of PeftTrainer is run)
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    self.model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    self.config = types.SimpleNamespace(data_sharding_axis=("fsdp",))
    state = nnx.state(self.model)
    nnx.update(self.model, jax.tree.map(
        lambda x: jax.device_put(x, NamedSharding(mesh, PartitionSpec())), state))
    self.calls = []

  def fwd_bwd(self, payload, **kwargs):
    leaf = self._prepare_payload(payload)["mb"]
    self.calls.append(("fwd", int(np.asarray(leaf).ravel()[0]), isinstance(leaf, jax.Array)))

  def update(self, **kwargs):
    self.calls.append(("update",))
    return sum(c[0] == "update" for c in self.calls)

  def fwd_order(self):
    return [c[1] for c in self.calls if c[0] == "fwd"]


class SlowTrainHandle(remote_execution.InProcessActorHandle):
  """tunix's in-process handle, with a fwd_bwd that takes a while (as over the network).

  In-process calls never suspend, so without the delay every train call would finish before the
  next micro-batch could be staged and the pipeline (rightly) would train it inline.
  """

  async def asubmit(self, method_name=None, *args, **kwargs):
    if method_name == "fwd_bwd":
      await asyncio.sleep(0.02)
    return await super().asubmit(method_name, *args, **kwargs)


def make_engine(worker):
  handle = SlowTrainHandle(remote_execution.InProcessRemoteExecutionServer(worker))
  return distributed_rl_engine.DistributedRLEngine(rollout_workers=[],
                                                   trainer_workers={ACTOR: handle})


class OnePerItem:
  """An assembler packing each payload into its own micro-batch."""

  def pack(self, payloads):
    return list(payloads)


async def fill_queue(program, steps):
  n = 0
  for group in range(steps * 2):
    for pair in range(2):
      item = datatypes.TrajectoryItem(pair_index=pair, group_id=f"g{group}", start_step=0,
                                      traj=datatypes.Trajectory(reward=float(n)))
      item.payload = {"mb": np.full((1, 2), n, np.int32)}
      await program.scored_q.put(item)
      n += 1


def run_program(steps=3, max_staleness=None, trainer_cls=None, program_cls=None):
  trainer = (trainer_cls or RecordingTrainer)()
  worker = trainer_worker.TrainerWorker(lambda: trainer)
  reports = []
  program = (program_cls or rl_program.StandardRLProgram)(
      algo=ALGO, assembler=OnePerItem(), max_staleness=max_staleness, sync_weights=False,
      on_step_end=lambda step, result: reports.append(program.last_step_result))

  async def main():
    await fill_queue(program, steps)
    await program.train_stage(make_engine(worker), num_steps=steps)

  asyncio.run(main())
  return trainer, worker, reports


def expected_calls(steps):
  calls = []
  for step in range(steps):
    calls += [("fwd", n) for n in range(step * MB_PER_STEP, (step + 1) * MB_PER_STEP)]
    calls.append(("update",))
  return calls


@pytest.mark.loop_way
def test_staged_program_trains_every_microbatch_once_in_order(staging):
  trainer, worker, reports = run_program(steps=3)
  assert [c[:2] for c in trainer.calls] == expected_calls(3)
  staged = [c[1] for c in trainer.calls if c[0] == "fwd" and c[2]]
  assert len(staged) >= 6, trainer.calls  # most micro-batches arrived already on the device
  for step, result in enumerate(reports):
    assert isinstance(result, rl_program.RLStepResult) and result.step == step
    assert result.num_microbatches == MB_PER_STEP and result.num_rollouts == 4
    assert result.reward_mean == pytest.approx(np.mean(range(4 * step, 4 * step + 4)))
    m = result.stage_metrics
    assert m["stage/fallbacks"] == 0
    assert m["stage/staged"] + m["stage/inline"] == MB_PER_STEP
  # Steps after the first start with micro-batches staged during the previous boundary.
  assert all(r.stage_metrics["stage/prestaged"] >= 1 for r in reports[1:])
  assert worker.state == datatypes.WorkerState.READY
  # Nothing left on the device.
  assert len(ADAPTER.installation.trainer_side().staging_of(worker).store) == 0


@pytest.mark.loop_way
def test_no_cross_step_prestage_at_max_staleness_0_logged_once(staging, caplog):
  with caplog.at_level(logging.INFO, logger="tunix_stage_plugin"):
    trainer, _, reports = run_program(steps=3, max_staleness=0)
  assert [c[:2] for c in trainer.calls] == expected_calls(3)
  assert [r.stage_metrics["stage/prestaged"] for r in reports] == [0, 0, 0]
  lines = [r.message for r in caplog.records if "max_staleness" in r.message]
  assert len(lines) == 1 and "needs max_staleness >= 1" in lines[0]


class NoPrestageProgram(rl_program.StandardRLProgram):
  """Skips the prestage across every step boundary (e.g. at its own checkpoint boundaries)."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.asked = []

  def _prestage_across_boundary(self, next_step):
    self.asked.append(next_step)
    return False


class OwnDepthProgram(rl_program.StandardRLProgram):
  """One micro-batch ahead, and none in step 1 (e.g. a step it evaluates in)."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.asked = []

  def _stage_ahead_while_pending(self, step, max_staged_batches):
    self.asked.append((step, max_staged_batches))
    return 0 if step == 1 else super()._stage_ahead_while_pending(step, 1)


def run_subclass(program_cls, steps=3):
  """run_program for a StandardRLProgram subclass; also returns the program."""
  trainer = RecordingTrainer()
  worker = trainer_worker.TrainerWorker(lambda: trainer)
  reports = []
  program = program_cls(algo=ALGO, assembler=OnePerItem(), max_staleness=None,
                        sync_weights=False,
                        on_step_end=lambda step, result: reports.append(program.last_step_result))

  async def main():
    await fill_queue(program, steps)
    await program.train_stage(make_engine(worker), num_steps=steps)

  asyncio.run(main())
  return program, trainer, worker, reports


@pytest.mark.loop_way
def test_the_seams_exist_only_while_staging_is_installed(staging):
  program = rl_program.StandardRLProgram(algo=ALGO, assembler=OnePerItem(), max_staleness=None)
  assert program._stage_ahead_while_pending(3, 2) == 2  # pylint: disable=protected-access
  assert program._prestage_across_boundary(1) is True  # pylint: disable=protected-access
  manager.uninstall("tunix", quiet=True)
  assert not hasattr(rl_program.StandardRLProgram, "_stage_ahead_while_pending")
  assert not hasattr(rl_program.StandardRLProgram, "_prestage_across_boundary")


@pytest.mark.loop_way
def test_a_subclass_that_skips_the_prestage_is_honoured(staging):
  program, trainer, _, reports = run_subclass(NoPrestageProgram)
  assert [c[:2] for c in trainer.calls] == expected_calls(3)  # the same micro-batches, in order
  assert program.asked == [1, 2]  # at each boundary that has a next step
  assert [r.stage_metrics["stage/prestaged"] for r in reports] == [0, 0, 0]
  fwd = [c for c in trainer.calls if c[0] == "fwd"]
  # Each step's head found nothing staged for it: it was dispatched inline.
  assert [fwd[s * MB_PER_STEP][2] for s in range(3)] == [False] * 3
  assert sum(r.stage_metrics["stage/staged"] for r in reports) >= 3  # staging went on in steps


@pytest.mark.loop_way
def test_a_subclass_with_its_own_depth_is_honoured(staging):
  program, trainer, worker, reports = run_subclass(OwnDepthProgram)
  assert [c[:2] for c in trainer.calls] == expected_calls(3)
  assert program.asked == [(0, 2), (1, 2), (2, 2)]  # once per step, with the configured depth
  assert [r.stage_metrics["stage/peak_staged"] <= 1 for r in reports] == [True] * 3
  fwd = [c for c in trainer.calls if c[0] == "fwd"]
  assert [c[2] for c in fwd[MB_PER_STEP:2 * MB_PER_STEP]] == [False] * MB_PER_STEP  # step 1
  assert reports[1].stage_metrics["stage/staged"] == reports[1].stage_metrics["stage/prestaged"] \
      == 0
  assert reports[0].stage_metrics["stage/staged"] >= 1  # staging went on, one ahead
  assert ADAPTER.installation.trainer_side().staging_of(worker).store.stats.staged == sum(
      r.stage_metrics["stage/staged"] for r in reports)


@pytest.mark.loop_way
def test_failing_stage_falls_back_inline_and_is_counted(staging):
  def fail_on_6(payload):
    if int(np.asarray(payload["mb"]).ravel()[0]) == 6:
      raise ValueError("cannot densify routing record")
    return payload

  tunix_host.register_payload_transform(fail_on_6)
  try:
    trainer, worker, reports = run_program(steps=2)
  finally:
    tunix_host.unregister_payload_transform(fail_on_6)
  assert [c[:2] for c in trainer.calls] == expected_calls(2)
  assert ("fwd", 6, False) in trainer.calls  # trained inline, with its payload
  assert [r.stage_metrics["stage/fallbacks"] for r in reports] == [0, 1]
  assert worker.state == datatypes.WorkerState.READY


@pytest.mark.loop_way
@pytest.mark.parametrize("staging", [{"max_device_batches": 1}], indirect=True)
def test_device_bound_holds_and_order_is_kept(staging):
  trainer, worker, reports = run_program(steps=2)
  assert [c[:2] for c in trainer.calls] == expected_calls(2)
  stats = ADAPTER.installation.trainer_side().staging_of(worker).store.stats
  assert stats.peak == 1 and stats.staged >= 1  # never more than one batch on the device
  assert all(r.stage_metrics["stage/staged"] + r.stage_metrics["stage/inline"] == MB_PER_STEP
             for r in reports)


@pytest.mark.loop_way
def test_mock_engine_keeps_the_hosts_loop(staging):
  engine = mock.MagicMock(spec=distributed_rl_engine.DistributedRLEngine)
  engine.train_step = mock.AsyncMock(return_value="step_done")
  engine.stage_train_batch = mock.AsyncMock(side_effect=AssertionError("staged path taken"))
  program = rl_program.StandardRLProgram(
      algo=ALGO, assembler=OnePerItem(), sync_weights=False)

  async def main():
    await fill_queue(program, 1)
    await program.train_stage(engine, num_steps=1)

  asyncio.run(main())
  assert [c.kwargs["apply_optimizer"] for c in engine.train_step.call_args_list] == [
      False, False, False, True]
  assert type(program.last_step_result) is rl_program.RLStepResult  # the host's own result


def test_engine_train_step_with_a_key_sends_no_payload(staging):
  calls = []

  class Handle:
    async def asubmit(self, method, **kwargs):
      calls.append((method, kwargs))
      return 7

  engine = distributed_rl_engine.DistributedRLEngine([], {ACTOR: Handle()})
  asyncio.run(engine.train_step(None, stage_key="k1", apply_optimizer=True))
  asyncio.run(engine.train_step({"x": 1}, apply_optimizer=False))
  assert calls == [("fwd_bwd", {"payload": None, "skip_jit": False, "stage_key": "k1"}),
                   ("update", {}),
                   ("fwd_bwd", {"payload": {"x": 1}, "skip_jit": False})]


def test_engine_stage_answers_a_typed_outcome(staging):
  trainer = RecordingTrainer()
  engine = make_engine(trainer_worker.TrainerWorker(lambda: trainer))
  payload = {"mb": np.zeros((1, 2), np.int32)}
  assert asyncio.run(engine.stage_train_batch(payload, key="a-1")).status is StageStatus.STAGED
  assert asyncio.run(engine.reset_staged_batches(["a-1", "never"])) == ["a-1"]
  # A malformed or reused key is the caller's bug: an error, not a fallback.
  with pytest.raises(store_lib.StageKeyError, match="already used"):
    asyncio.run(engine.stage_train_batch(payload, key="a-1"))
  with pytest.raises(store_lib.StageKeyError, match=r"\[A-Za-z0-9._:-\]"):
    asyncio.run(engine.stage_train_batch(payload, key="bad key"))

  class NoStaging:  # a worker without stage_batch (no plugin there): asked once, then no offer
    pass

  handle = remote_execution.InProcessActorHandle(
      remote_execution.InProcessRemoteExecutionServer(NoStaging()))
  other = distributed_rl_engine.DistributedRLEngine([], {ACTOR: handle})
  outcome = asyncio.run(other.stage_train_batch(payload, key="b-1"))
  assert outcome.status is StageStatus.UNSUPPORTED and "no stage_batch" in outcome.reason
  with pytest.raises(ValueError, match="No trainer worker registered"):
    asyncio.run(other.stage_train_batch(payload, key="b-2", role=datatypes.Role.CRITIC))

  class NoPlugin:
    """Stands in for a trainer process without the plugin: a compressed payload names our
    classes, so its unpickling fails there (in-process calls do not pickle, hence this raise)."""

    def stage_batch(self, payload, key):
      raise ModuleNotFoundError("No module named 'tunix_stage_plugin'")

  handle = remote_execution.InProcessActorHandle(
      remote_execution.InProcessRemoteExecutionServer(NoPlugin()))
  outcome = asyncio.run(distributed_rl_engine.DistributedRLEngine([], {ACTOR: handle})
                        .stage_train_batch(payload, key="c-1"))
  assert outcome.status is StageStatus.UNSUPPORTED
  assert outcome.reason == "tunix-stage-plugin is not installed on the trainer"


def test_the_pipelines_calls_go_once_through_the_trainers_connection(staging):
  """A stage, a train by key and an inline train: each routed once by the one connection to the
  trainer, tunix's answer as tunix gives it, and a trainer's error typed by the one map."""
  trainer = RecordingTrainer()
  worker = trainer_worker.TrainerWorker(lambda: trainer)
  engine = make_engine(worker)
  side = ADAPTER.installation.orchestrator_side()
  calls = orchestrator.StagingCalls(side, engine)
  handle = engine._trainer_workers[ACTOR]  # pylint: disable=protected-access
  connection = side.connection(handle)
  payload = {"mb": np.full((1, 2), 4, np.int32)}

  async def main():
    outcome = await calls.stage(payload, key="r-1")
    staged = await calls.train(None, stage_key="r-1", apply_optimizer=False)
    inline = await calls.train(payload, stage_key=None, apply_optimizer=True)
    with pytest.raises(store_lib.StageKeyError, match="not staged"):
      await calls.train(None, stage_key="r-1", apply_optimizer=False)  # consumed
    return outcome, staged, inline

  with mock.patch.object(connection, "route", wraps=connection.route) as route:
    outcome, staged, inline = asyncio.run(main())
  assert [c.args[0] for c in route.call_args_list] == [
      contract.STAGE_BATCH, contract.FWD_BWD, contract.FWD_BWD, contract.FWD_BWD]
  assert side.connection(handle) is connection
  assert outcome.staged and staged.fallback is None and inline.fallback is None
  assert set(inline.result) == {"fwd_bwd", "updated", "train_step", "accumulated"}
  assert inline.result["train_step"] == 1 and inline.result["accumulated"] is True
  assert trainer.calls == [("fwd", 4, True), ("fwd", 4, False), ("update",)]


def test_worker_stages_on_the_mesh_and_consumes_a_key_once(staging):
  trainer = RecordingTrainer()
  worker = trainer_worker.TrainerWorker(lambda: trainer)
  worker.initialize()
  response = worker.stage_batch({"mb": np.full((1, 2), 5, np.int32)}, key="k-5")
  assert response.metadata["staged"] is True and response.metadata["outcome"]["key"] == "k-5"
  worker.fwd_bwd(payload=None, skip_jit=False, stage_key="k-5")
  assert trainer.calls == [("fwd", 5, True)]
  with pytest.raises(store_lib.StageKeyError, match="not staged"):
    worker.fwd_bwd(payload=None, stage_key="k-5")
  assert worker.state == datatypes.WorkerState.READY
  with pytest.raises(ValueError, match="a payload and stage_key"):
    worker.fwd_bwd({"mb": 1}, stage_key="k-6")
  with pytest.raises(TypeError, match="got str 'ab'"):  # would drop 'a' and 'b'
    worker.reset_staged("ab")


needs_codec = pytest.mark.skipif(not codec_lib.installed(codec_lib.DEFAULT_CODEC),
                                 reason=f"{codec_lib.DEFAULT_CODEC} is not installed "
                                 f"({codec_lib.EXTRA})")


@needs_codec
def test_compression_round_trips_tunix_payloads_byte_for_byte():
  rng = np.random.default_rng(0)
  ids = np.full((4, 256, 64), -1, np.int32)
  ids[:, :100] = rng.integers(0, 1000, (4, 100, 64), dtype=np.int32)
  logps = jax.numpy.asarray(rng.standard_normal((4, 256, 64)), jax.numpy.bfloat16)
  example = rl_common.TrainExample(
      prompt_ids=ids, prompt_mask=ids >= 0, completion_ids=ids[:, :, :4],
      completion_mask=np.ones((4, 256), bool), advantages=np.ones(4, np.float32),
      ref_per_token_logps=None, old_per_token_logps=logps)
  packed = codec_lib.compress_payload(codec_lib.parse("on"), example)
  leaves = jax.tree.leaves(packed.tree)
  assert isinstance(packed.tree, rl_common.TrainExample)
  assert sum(isinstance(x, codec_lib.PackedArray) for x in leaves) == 3  # ids, mask, logps
  assert packed.wire_bytes < packed.nbytes / 2
  out = codec_lib.decompress_payload(packed)
  assert isinstance(out, rl_common.TrainExample) and out.ref_per_token_logps is None
  for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(example)):
    assert got.dtype == want.dtype and got.shape == want.shape
    assert np.asarray(got).tobytes() == np.asarray(want).tobytes()

  # tunix's TrainerPayload types are dataclasses, not pytrees: packed field by field.
  payload = datatypes.RLTrainerPayload(token_ids=ids, token_mask=ids >= 0,
                                       advantages=np.ones(4, np.float32), loss_mask=ids >= 0)
  packed = codec_lib.compress_payload(codec_lib.parse("on"), payload)
  assert isinstance(packed.tree, datatypes.RLTrainerPayload) and packed.tree is not payload
  assert isinstance(packed.tree.token_ids, codec_lib.PackedArray)
  assert isinstance(payload.token_ids, np.ndarray)  # the orchestrator's own payload is untouched
  out = codec_lib.decompress_payload(packed)
  assert type(out) is datatypes.RLTrainerPayload and out.prompt_ids is None
  for name in ("token_ids", "token_mask", "advantages", "loss_mask"):
    got, want = getattr(out, name), getattr(payload, name)
    assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), name


def test_a_trainer_without_the_codec_refuses_a_compressed_stage_at_once(staging, monkeypatch):
  trainer = RecordingTrainer()
  worker = trainer_worker.TrainerWorker(lambda: trainer)
  worker.initialize()
  monkeypatch.setattr(codec_lib, "installed", lambda name: False)
  payload = codec_spec.CompressedPayload("blosc2-lz4", {"mb": np.zeros((1, 2), np.int32)}, 8, 8)
  outcome = worker.stage_batch(payload, key="z-1").metadata["outcome"]
  assert outcome["status"] == "refused"
  assert "codec blosc2-lz4 is not installed on the trainer" in outcome["reason"]
  assert codec_lib.EXTRA in outcome["reason"]
  assert ADAPTER.installation.trainer_side().staging_of(worker).store.keys() == []


def test_worker_stage_never_touches_state_and_degrades(staging):
  worker = trainer_worker.TrainerWorker(lambda: types.SimpleNamespace())  # cannot stage
  outcome = worker.stage_batch({"mb": np.zeros((1, 2))}, key="k-1").metadata["outcome"]
  assert outcome["status"] == "unsupported" and \
      "a SimpleNamespace; staging supports tunix PeftTrainer" in outcome["reason"]
  assert worker.state == datatypes.WorkerState.PENDING  # no readiness check, no state write
  ready = trainer_worker.TrainerWorker(RecordingTrainer)
  ready.initialize()
  ready.state = datatypes.WorkerState.SYNCING  # e.g. a prestage during weight sync
  assert ready.stage_batch({"mb": np.zeros((1, 2), np.int32)}, key="k-2").metadata["staged"]
  assert ready.state == datatypes.WorkerState.SYNCING
  refused = ready.stage_batch(datatypes.TrainerPayload(token_ids=[1], token_mask=[1]),
                              key="k-3").metadata["outcome"]
  assert refused["status"] == "refused" and "is not a JAX pytree" in refused["reason"]


class CountingTrainer(RecordingTrainer):
  """A non-idempotent `_prepare_inputs` (a real tunix extension point): it adds 100 to the
  micro-batch, so preparing twice would train different numbers."""

  def __init__(self):
    super().__init__()
    self.prepared = []

  def _prepare_inputs(self, input_data):
    self.prepared.append(int(np.asarray(input_data["mb"]).ravel()[0]))
    return {"mb": np.asarray(input_data["mb"]) + 100}


def test_a_staged_batch_is_prepared_once_like_inline(staging):
  staged, _, reports = run_program(steps=2, trainer_cls=CountingTrainer)
  assert sum(r.stage_metrics["stage/staged"] for r in reports) >= 4  # the staged path ran
  manager.uninstall("tunix", quiet=True)
  inline, _, _ = run_program(steps=2, trainer_cls=CountingTrainer)  # no plugin at all
  numbers = list(range(2 * MB_PER_STEP))
  assert inline.prepared == numbers
  # Each micro-batch prepared exactly once (staged ones ahead of their turn, on the staging thread).
  assert sorted(staged.prepared) == numbers
  assert [c[:2] for c in staged.calls] == [c[:2] for c in inline.calls]
  assert [c[1] for c in staged.calls if c[0] == "fwd"] == [n + 100 for n in numbers]


class OwnPreparingTrainer(RecordingTrainer):
  """A PeftTrainer subclass overriding `_prepare_payload` (a real tunix extension point),
  non-idempotently: it adds 1000 before PeftTrainer's own preparation, so preparing a staged
  batch again at consume time would train other numbers. It records every call."""

  def __init__(self):
    super().__init__()
    self.own_prepared = []

  def _prepare_payload(self, payload):
    self.own_prepared.append(int(np.asarray(payload["mb"]).ravel()[0]))
    return super()._prepare_payload({"mb": np.asarray(payload["mb"]) + 1000})


def test_a_subclass_overriding_prepare_payload_is_staged_through_its_override_once(staging):
  original = vars(OwnPreparingTrainer)["_prepare_payload"]
  staged, worker, reports = run_program(steps=2, trainer_cls=OwnPreparingTrainer)
  assert sum(r.stage_metrics["stage/staged"] for r in reports) >= 4  # the staged path ran
  assert ADAPTER.installation.trainer_side().staging_of(worker).unsupported is None
  assert vars(OwnPreparingTrainer)["_prepare_payload"] is not original  # now a seam
  manager.uninstall("tunix", quiet=True)
  assert vars(OwnPreparingTrainer)["_prepare_payload"] is original  # restored exactly
  inline, _, _ = run_program(steps=2, trainer_cls=OwnPreparingTrainer)  # no plugin at all
  numbers = list(range(2 * MB_PER_STEP))
  assert inline.own_prepared == numbers
  # Each micro-batch went through the override exactly once (staged ones on the staging thread).
  assert sorted(staged.own_prepared) == numbers
  assert [c[:2] for c in staged.calls] == [c[:2] for c in inline.calls]
  assert [c[1] for c in staged.calls if c[0] == "fwd"] == [n + 1000 for n in numbers]
  assert any(c[0] == "fwd" and c[2] for c in staged.calls)  # some arrived placed on the device


class InstancePreparingTrainer(RecordingTrainer):
  """Sets its preparation on the instance: no class method for a staged batch to pass through."""

  def __init__(self):
    super().__init__()
    self._prepare_payload = self._prepare_on_the_side

  def _prepare_on_the_side(self, payload):
    return peft_trainer_v2.PeftTrainer._prepare_payload(self, payload)  # pylint: disable=protected-access


@pytest.mark.loop_way
def test_a_trainer_that_cannot_stage_is_asked_once(staging, caplog):
  with caplog.at_level(logging.WARNING, logger="tunix_stage_plugin"):
    trainer, worker, reports = run_program(steps=3, trainer_cls=InstancePreparingTrainer)
  assert [c[:2] for c in trainer.calls] == expected_calls(3)
  assert [r.stage_metrics["stage/fallbacks"] for r in reports] == [1, 0, 0]
  assert all(r.stage_metrics["stage/staged"] == 0 for r in reports)
  assert ADAPTER.installation.trainer_side().staging_of(worker).unsupported.startswith(
      "InstancePreparingTrainer sets _prepare_payload on the instance")
  lines = [r.message for r in caplog.records if "cannot stage" in r.message]
  assert len(lines) == 1, lines


def test_what_the_telemetry_cannot_read_of_a_trainer_is_said_once_each_and_it_trains_on(
    staging, caplog):
  """RecordingTrainer runs nothing of PeftTrainer's __init__: it holds no computation output, no
  PerfTracer and no metrics logger. Each is said once, with what is lost; every call trains."""
  with caplog.at_level(logging.WARNING, logger="tunix_stage_plugin"):
    trainer, _, _ = run_program(steps=3)
  assert [c[:2] for c in trainer.calls] == expected_calls(3)
  said = sorted(r.message for r in caplog.records if " holds no " in r.message)
  assert [line.split(" (")[0] for line in said] == [
      "tunix-stage: telemetry: RecordingTrainer holds no PerfTracer to read",
      "tunix-stage: telemetry: RecordingTrainer holds no computation output to watch",
      "tunix-stage: telemetry: RecordingTrainer holds no metrics logger to read"]
  assert said[0].endswith("; staging's spans are not on its timelines")
  assert said[1].endswith("; its steps are not measured")
  assert said[2].endswith("; staging's figures are not logged there")


def test_fwd_bwd_without_a_key_is_the_hosts_call(staging):
  trainer = mock.MagicMock()
  worker = trainer_worker.TrainerWorker(lambda: trainer)
  response = worker.fwd_bwd({"x": 1}, skip_jit=True, extra=2)
  trainer.fwd_bwd.assert_called_once_with({"x": 1}, extra=2)
  assert response.metadata["queued"] is True


def test_uninstall_closes_executors_and_drops_staged_batches(staging):
  trainer = RecordingTrainer()
  worker = trainer_worker.TrainerWorker(lambda: trainer)
  worker.initialize()
  handle = remote_execution.InProcessActorHandle(
      remote_execution.InProcessRemoteExecutionServer(worker))
  response = asyncio.run(handle.asubmit("stage_batch", payload={"mb": np.ones((1, 2), np.int32)},
                                        key="u-1"))
  assert response.metadata["staged"]
  state = ADAPTER.installation.trainer_side().staging_of(worker)
  assert state.store.keys() == ["u-1"]
  lanes = [t for t in threading.enumerate() if t.name.startswith("trainer-")]
  assert lanes, "the stage ran on an executor lane"
  manager.uninstall("tunix", quiet=True)
  assert len(state.store) == 0  # the staged batch was dropped with the hooks
  assert not any(t.is_alive() for t in lanes)  # and the executor's threads joined
  assert "stage_batch" not in vars(trainer_worker.TrainerWorker)


def test_a_reinstall_applies_new_depths_to_live_workers(staging):
  worker = trainer_worker.TrainerWorker(RecordingTrainer)
  store = ADAPTER.installation.trainer_side().staging_of(worker).store
  assert (store.max_device_batches, store.max_host_batches) == (4, 1)
  manager.install(config_lib.resolve({"mode": "stage", "max_device_batches": 1,
                                      "max_host_batches": 2}, env={}), quiet=True)
  assert (store.max_device_batches, store.max_host_batches) == (1, 2)


# --- where the staged loop keeps tunix's loop's exact behaviour (program.py's docstring) ---------


async def fill_reading_defaults(program, steps, missing):
  """Items numbered 0, 1, ... (reward n); for `missing` "reward" a dict traj (no .reward
  attribute), for "payload" no payload attribute: tunix's loop reads both with defaults."""
  n = 0
  for group in range(steps * 2):
    for pair in range(2):
      traj = ({"reward": 9.0} if missing == "reward"
              else datatypes.Trajectory(reward=float(n)))
      item = datatypes.TrajectoryItem(pair_index=pair, group_id=f"g{group}", start_step=0,
                                      traj=traj)
      if missing != "payload":
        item.payload = {"mb": np.full((1, 2), n, np.int32)}
      await program.scored_q.put(item)
      n += 1


class NumberingAssembler:
  """One micro-batch per payload; a missing payload (None) becomes the micro-batch numbered by
  its position, so every case trains the same numbers."""

  def __init__(self):
    self.packed = 0

  def pack(self, payloads):
    batches = [{"mb": np.full((1, 2), self.packed + i, np.int32)} if p is None else p
               for i, p in enumerate(payloads)]
    self.packed += len(payloads)
    return batches


def run_reading_defaults(missing, steps=2):
  trainer = RecordingTrainer()
  worker = trainer_worker.TrainerWorker(lambda: trainer)
  reports = []
  algo = types.SimpleNamespace(group_size=2, mini_batch_size=2)  # no requires_reference_kl
  if missing != "requires_reference_kl":
    algo.requires_reference_kl = False
  program = rl_program.StandardRLProgram(
      algo=algo, assembler=NumberingAssembler(), sync_weights=False,
      on_step_end=lambda step, result: reports.append(program.last_step_result))

  async def main():
    await fill_reading_defaults(program, steps, missing)
    await program.train_stage(make_engine(worker), num_steps=steps)

  asyncio.run(main())
  return trainer, reports


@pytest.mark.loop_way
@pytest.mark.parametrize("missing", ["reward", "payload", "requires_reference_kl"])
def test_the_staged_loop_reads_with_tunix_s_defaults(staging, missing):
  staged, staged_reports = run_reading_defaults(missing)
  assert sum(r.stage_metrics["stage/staged"] for r in staged_reports) >= 4  # the staged path ran
  manager.uninstall("tunix", quiet=True)
  inline, inline_reports = run_reading_defaults(missing)  # tunix's own loop
  assert [c[:2] for c in staged.calls] == [c[:2] for c in inline.calls] == expected_calls(2)
  for got, want in zip(staged_reports, inline_reports, strict=True):
    assert (got.step, got.num_rollouts, got.num_microbatches, got.reward_mean, got.reward_std) == (
        want.step, want.num_rollouts, want.num_microbatches, want.reward_mean, want.reward_std)
  if missing == "reward":
    assert [r.reward_mean for r in staged_reports] == [0.0, 0.0]  # tunix's default


class TypeRecordingTrainer(RecordingTrainer):
  """Records the type of each micro-batch it is asked to train (whatever it is)."""

  def fwd_bwd(self, payload, **kwargs):
    self.calls.append(("fwd", type(payload).__name__))


class Reference:
  """The reference role as the engine reaches it: log-probs shaped as the completion."""

  def __init__(self):
    self.asked = 0

  def per_token_logps(self, items):
    self.asked += 1
    return np.zeros(np.asarray(items.completion_ids).shape, np.float32)


class ExampleThenDict:
  """A group packs into a TrainExample and then a dict, which cannot take reference log-probs."""

  def pack(self, payloads):
    del payloads
    ids = np.zeros((1, 2), np.int32)
    example = rl_common.TrainExample(
        prompt_ids=ids, prompt_mask=ids == 0, completion_ids=ids, completion_mask=ids == 0,
        advantages=np.ones(1, np.float32), ref_per_token_logps=None, old_per_token_logps=None)
    return [example, {"mb": ids}]


def run_reference_kl():
  trainer = TypeRecordingTrainer()
  reference = Reference()
  actor = SlowTrainHandle(remote_execution.InProcessRemoteExecutionServer(
      trainer_worker.TrainerWorker(lambda: trainer)))
  engine = distributed_rl_engine.DistributedRLEngine(
      rollout_workers=[], trainer_workers={
          ACTOR: actor,
          datatypes.Role.REFERENCE: remote_execution.InProcessActorHandle(
              remote_execution.InProcessRemoteExecutionServer(reference))})
  algo = types.SimpleNamespace(group_size=2, mini_batch_size=2, requires_reference_kl=True)
  program = rl_program.StandardRLProgram(algo=algo, assembler=ExampleThenDict(),
                                         sync_weights=False)

  async def main():
    await fill_queue(program, 1)
    await program.train_stage(engine, num_steps=1)

  with pytest.raises(TypeError, match="Reference KL requires an assembler that returns "
                     "rl_common.TrainExample microbatches; got dict"):
    asyncio.run(main())
  return trainer, reference


@pytest.mark.loop_way
def test_reference_kl_refuses_the_group_before_any_of_it_trains(staging):
  staged, staged_reference = run_reference_kl()
  manager.uninstall("tunix", quiet=True)
  inline, inline_reference = run_reference_kl()  # tunix's own loop
  assert staged.calls == inline.calls == []  # not even the TrainExample ahead of the dict
  assert staged_reference.asked == inline_reference.asked == 1  # the TrainExample's, as tunix


def clearing_after_the_first_group(program):
  """The scored queue is cleared (tunix's prepare_clear) while the step waits for its second
  group: get_batch answers no group from then on."""
  get_batch = program.scored_q.get_batch
  asked = []

  async def first_group_then_cleared(**kwargs):
    asked.append(kwargs)
    if len(asked) == 2:
      await program.scored_q.prepare_clear()
    return await get_batch(**kwargs)

  program.scored_q.get_batch = first_group_then_cleared


def run_cleared(steps=2):
  trainer = RecordingTrainer()
  worker = trainer_worker.TrainerWorker(lambda: trainer)
  reports = []
  program = rl_program.StandardRLProgram(
      algo=ALGO, assembler=OnePerItem(), sync_weights=False,
      on_step_end=lambda step, result: reports.append(program.last_step_result))
  clearing_after_the_first_group(program)

  async def main():
    await fill_queue(program, 1)
    await program.train_stage(make_engine(worker), num_steps=steps)

  return trainer, worker, reports, main


@pytest.mark.loop_way
@pytest.mark.skipif(WAY != probes.COPY, reason="the plugin's copy of train_stage only (c7d8950)")
def test_a_cleared_queue_ends_tunix_s_step_and_stops_the_staged_loop(staging):
  """The one behaviour the staged loop does not keep (program.py's docstring says why)."""
  trainer, worker, reports, main = run_cleared()
  with pytest.raises(RuntimeError, match=r"the scored queue returned no group \(1 of 2 pulled "
                     r"this step: it was cleared\); tunix's loop would end the step without an "
                     "update, the staged loop cannot"):
    asyncio.run(main())
  assert ("update",) not in trainer.calls and reports == []
  assert not ADAPTER.installation.trainer_side().staging_of(worker).store  # nothing left staged
  manager.uninstall("tunix", quiet=True)
  trainer, _, reports, main = run_cleared()
  asyncio.run(main())  # tunix's own loop: two steps, no update, each committed and reported
  assert trainer.calls == [("fwd", 0, False), ("fwd", 1, False)]
  assert [(r.step, r.num_rollouts, r.num_microbatches) for r in reports] == [(0, 2, 2), (1, 0, 0)]
  # The step's last train call answered (one that applied no update); the empty step's, none.
  assert reports[0].train_result is not None and reports[1].train_result is None


@pytest.mark.loop_way
@pytest.mark.skipif(WAY != probes.SEAM, reason="tunix with the train loop's seam only")
def test_a_cleared_queue_ends_the_step_as_tunix_s_loop_does(staging):
  """Through the seam the staged loop keeps tunix's behaviour: the step whose queue was cleared
  ends without an update and is committed and reported, and so is the empty step after it."""
  reference = []
  for staged in (True, False):
    if not staged:
      manager.uninstall("tunix", quiet=True)
    trainer, worker, reports, main = run_cleared()
    asyncio.run(main())
    reference.append((trainer.calls, [(r.step, r.num_rollouts, r.num_microbatches,
                                       r.train_result is None) for r in reports]))
    if staged:
      assert not ADAPTER.installation.trainer_side().staging_of(worker).store  # nothing left staged
      assert [r.stage_metrics["stage/staged"] + r.stage_metrics["stage/inline"]
              for r in reports] == [2, 0]
  (staged_calls, staged_steps), (plain_calls, plain_steps) = reference
  assert [c[:2] for c in staged_calls] == [c[:2] for c in plain_calls] == [("fwd", 0), ("fwd", 1)]
  assert staged_steps == plain_steps == [(0, 2, 2, False), (1, 0, 0, True)]


class WrappingProgram(rl_program.StandardRLProgram):
  """Wraps the per-step loop as a program of the user's own may (the patch's own test does the
  same), recording what it trains."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.seen = []

  async def _train_microbatches(self, engine, step, microbatches):
    inner = microbatches.batches

    async def recorded():
      async for batch, apply_optimizer in inner:
        self.seen.append((step, int(np.asarray(batch["mb"]).ravel()[0]), apply_optimizer))
        yield batch, apply_optimizer

    microbatches.batches = recorded()
    return await super()._train_microbatches(engine, step, microbatches)


@pytest.mark.loop_way
@pytest.mark.skipif(WAY != probes.SEAM, reason="tunix with the train loop's seam only")
def test_the_seam_way_leaves_train_stage_tunix_s_and_stages_through_the_seam(staging):
  program_cls = rl_program.StandardRLProgram
  hooked = vars(program_cls)["train_stage"]
  assert hooked.__wrapped__.__module__ == rl_program.__name__  # tunix's own, wrapped
  hooks = manager.installed_hooks()
  for name in ("train_stage", "_step_microbatches", "_train_microbatches", "last_step_result"):
    assert f"{rl_program.__name__}.StandardRLProgram.{name}" in hooks
  line = manager.install(staging, quiet=True).line  # installed already: the same activation
  assert "program: tunix's train_stage, staged through its seam" in line, line
  trainer, worker, reports = run_program(steps=3)
  assert [c[:2] for c in trainer.calls] == expected_calls(3)
  assert sum(r.stage_metrics["stage/staged"] for r in reports) >= 6
  assert all(r.stage_metrics["stage/prestaged"] >= 1 for r in reports[1:])
  assert len(ADAPTER.installation.trainer_side().staging_of(worker).store) == 0


class NotCallingProgram(rl_program.StandardRLProgram):
  """Trains its steps itself, never calling tunix's _train_microbatches (the seam)."""

  async def _train_microbatches(self, engine, step, microbatches):
    result = None
    async for batch, apply_optimizer in microbatches.batches:
      result = await engine.train_step(batch, role=ACTOR, accumulate_gradients=True,
                                       apply_optimizer=apply_optimizer)
    return result


@pytest.mark.loop_way
@pytest.mark.skipif(WAY != probes.SEAM, reason="tunix with the train loop's seam only")
def test_a_program_never_calling_the_seam_is_not_promised_staging_and_says_why_once(
    staging, caplog):
  """The activation line promises staging only where tunix's seam is called; a subclass whose
  own `_train_microbatches` never calls it trains as it wrote it, nothing staged, and its first
  step says so once, with why."""
  line = manager.install(staging, quiet=True).line
  assert "a subclass's own _train_microbatches stages only if it calls tunix's" in line, line
  with caplog.at_level(logging.INFO, logger="tunix_stage_plugin"):
    _, trainer, worker, reports = run_subclass(NotCallingProgram)
  assert [c[:2] for c in trainer.calls] == expected_calls(3)
  assert not any(c[2] for c in trainer.calls if c[0] == "fwd")  # none was placed ahead
  assert all(type(r) is rl_program.RLStepResult for r in reports)  # no stage/* metrics
  said = [r for r in caplog.records if "staged 0 of" in r.message]
  assert [(r.levelno, r.message) for r in said] == [(
      logging.WARNING, f"tunix-stage: step 0 staged 0 of {MB_PER_STEP} micro-batches: the seam "
      "StandardRLProgram._train_microbatches was never called; "
      "NotCallingProgram._train_microbatches overrides tunix's without calling it (call "
      "super()._train_microbatches(engine, step, microbatches) in it to stage)")]
  assert len(ADAPTER.installation.trainer_side().staging_of(worker).store) == 0


@pytest.mark.loop_way
@pytest.mark.skipif(WAY != probes.SEAM, reason="tunix with the train loop's seam only")
def test_a_program_overriding_the_seam_is_staged_within_its_steps(staging, caplog):
  with caplog.at_level(logging.INFO, logger="tunix_stage_plugin"):
    program, trainer, worker, reports = run_subclass(WrappingProgram)
  assert [c[:2] for c in trainer.calls] == expected_calls(3)
  assert program.seen == [(s, n, n % MB_PER_STEP == MB_PER_STEP - 1)
                          for s in range(3) for n in range(s * MB_PER_STEP, (s + 1) * MB_PER_STEP)]
  assert [r.stage_metrics["stage/prestaged"] for r in reports] == [0, 0, 0]
  assert sum(r.stage_metrics["stage/staged"] for r in reports) >= 3  # staged within the steps
  lines = [r.message for r in caplog.records if "overrides _train_microbatches" in r.message]
  assert len(lines) == 1 and "never across the step boundary" in lines[0]
  assert len(ADAPTER.installation.trainer_side().staging_of(worker).store) == 0
