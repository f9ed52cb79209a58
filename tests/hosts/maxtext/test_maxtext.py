"""Staging into MaxText's training engine (maxtext 0.2.5) behind tunix's real TrainerWorker.

A real tiny MaxText decoder (2 layers, d_model 32, vocab 128; MaxText's own base config, the
engine's own router-replay adapter and loss), no mocks. Two engines from the same seed: one
trained inline, one from staged micro-batches (one or two ahead); their accumulated gradients and
denominators are compared bitwise after every fwd_bwd, their parameters and whole train state
after every update. The same on 4 forced CPU devices (a subprocess: the device count is fixed
when JAX starts), through the fallbacks, and end to end over tunix's gRPC server in its own
process against a node without the plugin. Run `python tests/hosts/maxtext/test_maxtext.py check N`
(N devices) or `... serve plugin|plain` by hand.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import types

import numpy as np

STEPS, MICRO = 3, 3


def tiny_engine(me, pyconfig, maxtext, enable_tensorboard=False):
  base_yml = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
  config = pyconfig.initialize(
      [None, base_yml], model_name="default", hardware="cpu", attention="dot_product",
      base_emb_dim=32, base_num_query_heads=2, base_num_kv_heads=2, head_dim=16, base_mlp_dim=64,
      base_num_decoder_layers=2, vocab_size=128, max_target_length=16, per_device_batch_size=1.0,
      dtype="float32", weight_dtype="float32", grad_dtype="float32", enable_checkpointing=False,
      enable_tensorboard=enable_tensorboard, enable_dropout=False, use_weight_converter=False,
      skip_jax_distributed_system=True, init_weights_seed=0, learning_rate=1e-3, steps=10,
      profiler="", profiler_steps=0, run_name="tiny",
      base_output_directory=tempfile.mkdtemp(prefix="tunix-stage-maxtext-"))
  engine = me.MaxTextTrainingEngine(config)
  engine.with_gen_model_input_fn(me.router_replay_gen_model_input_fn)
  engine.with_loss_fn(me.make_router_replay_loss_fn(config), has_aux=True)
  engine.compile(None)  # lazy: compiled by the first fwd_bwd
  return engine


def payload(datatypes, seed, b, p=6, c=10, vocab=128):
  """A synthetic RLTrainerPayload: left-padded prompt, right-padded completion."""
  rng = np.random.default_rng(seed)
  prompt_ids = rng.integers(1, vocab, size=(b, p), dtype=np.int32)
  completion_ids = rng.integers(1, vocab, size=(b, c), dtype=np.int32)
  prompt_mask, completion_mask = np.ones((b, p), np.int32), np.ones((b, c), np.int32)
  for i in range(b):
    prompt_mask[i, :i + 1] = 0
    completion_mask[i, c - (i + 2):] = 0
  prompt_ids *= prompt_mask
  completion_ids *= completion_mask
  return datatypes.RLTrainerPayload(
      token_ids=np.concatenate([prompt_ids, completion_ids], -1),
      token_mask=np.concatenate([prompt_mask, completion_mask], -1),
      prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
      completion_mask=completion_mask, advantages=rng.standard_normal(b).astype(np.float32),
      loss_mask=np.concatenate([prompt_mask, completion_mask], -1))


def host_leaves(tree):
  import jax  # pylint: disable=import-outside-toplevel
  out = []
  for leaf in jax.tree.leaves(tree):
    if hasattr(leaf, "dtype") and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      leaf = jax.random.key_data(leaf)
    out.append(np.array(leaf, copy=True))
  return out


def train(worker, engine, payloads, *, ahead=0, hooks=None):
  """Trains STEPS x MICRO; `ahead` > 0 stages that many ahead and trains by key. Returns a
  snapshot after every fwd_bwd (grads, denominator) and update (model, whole train state)."""
  hooks = hooks or {}
  keys = [f"m-{n}" for n in range(len(payloads))]
  snapshots, reasons = [], []
  for n in range(min(ahead, len(payloads))):
    assert worker.stage_batch(payloads[n], key=keys[n]).metadata["staged"]
  for n, item in enumerate(payloads):
    if ahead and n + ahead < len(payloads):  # stage k+ahead before training k
      worker.stage_batch(payloads[n + ahead], key=keys[n + ahead])
    hooks.get(n, lambda: None)()
    if ahead:
      response = worker.fwd_bwd(payload=None, stage_key=keys[n])
      reasons.append(response.metadata["placement_fallback"])
    else:
      worker.fwd_bwd(item)
    snapshot_and_update(worker, engine, n, snapshots)
  return snapshots, reasons


def snapshot_and_update(worker, engine, n, snapshots):
  """After micro-batch n's fwd_bwd: snapshots the grads and denominator; at a step's last
  micro-batch, updates and snapshots the model and the whole train state."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  snapshots.append(host_leaves((engine._accumulated_grads, engine._accumulated_denominator)))
  if n % MICRO == MICRO - 1:
    worker.update()
    snapshots.append(host_leaves((nnx.state(engine.model), nnx.state(engine._state))))


def train_one(worker, engine, n, item, status, key, snapshots):
  """Trains micro-batch n by key when it was staged, else inline (the orchestrator's fallback),
  and snapshots as `train` does; returns why a staged one trained from its payload (None: from
  its placement, or inline)."""
  fallback = None
  if status == "staged":
    fallback = worker.fwd_bwd(payload=None, stage_key=key).metadata["placement_fallback"]
  else:
    worker.fwd_bwd(item)
  snapshot_and_update(worker, engine, n, snapshots)
  return fallback


def same_bits(a, b):
  return len(a) == len(b) and all(
      len(x) == len(y) and all(u.dtype == v.dtype and np.array_equal(u, v, equal_nan=True)
                               for u, v in zip(x, y)) for x, y in zip(a, b))


def check_equivalence(devices: int) -> None:
  """Inline vs staged 1 and 2 ahead, bitwise, on this process's devices (run in a subprocess)."""
  # pylint: disable=import-outside-toplevel
  import jax
  import maxtext
  from maxtext.configs import pyconfig
  from maxtext.training_engine import maxtext_engine as me
  from tunix.experimental.common import datatypes
  from tunix.experimental.worker import trainer_worker

  from tunix_stage_plugin.core import config as config_lib
  from tunix_stage_plugin.activation import manager

  assert len(jax.devices()) == devices, jax.devices()
  # Two ahead: k + 2 is staged while k and k + 1 are held, so three slots.
  cfg = config_lib.resolve({"mode": "stage", "max_device_batches": 3}, env={})
  for host in ("tunix", "maxtext"):
    assert manager.install(cfg, host=host, quiet=True).installed
  payloads = [payload(datatypes, n, b=2 * devices) for n in range(STEPS * MICRO)]
  runs = {}
  for ahead in (0, 1, 2):
    engine = tiny_engine(me, pyconfig, maxtext)
    worker = trainer_worker.TrainerWorker(lambda engine=engine: engine)
    worker.initialize()
    runs[ahead], reasons = train(worker, engine, payloads, ahead=ahead)
    assert all(r is None for r in reasons), reasons
    if ahead:
      leaf = jax.tree.leaves(worker_staged_example(worker, payloads[0]))[0]
      spec = jax.sharding.PartitionSpec("fsdp" if devices > 1 else None, None)
      assert leaf.committed and leaf.sharding.spec == spec, leaf.sharding
  assert same_bits(runs[0], runs[1]) and same_bits(runs[0], runs[2])
  print(json.dumps({"devices": devices, "snapshots": len(runs[0]), "identical": True}))


def worker_staged_example(worker, item):
  """Stages `item` once more and returns its placed dynamic half (then drops it)."""
  from tunix_stage_plugin.hosts.tunix.adapter import ADAPTER  # pylint: disable=import-outside-toplevel
  worker.stage_batch(item, key="probe-leaf")
  staged = ADAPTER.installation.trainer_side().staging_of(worker).store.take("probe-leaf")
  return staged.dynamic


# ---------------------------------------------------------------- a trainer node (subprocess)

def serve(kind: str) -> None:
  # pylint: disable=import-outside-toplevel
  import maxtext
  import portpicker
  from flax import nnx
  from maxtext.configs import pyconfig
  from maxtext.training_engine import maxtext_engine as me
  from tunix.experimental.worker import remote_execution, trainer_worker

  if kind == "plugin":
    from tunix_stage_plugin.activation import manager
    from tunix_stage_plugin.core import config as config_lib
    cfg = config_lib.resolve({"mode": "stage", "max_device_batches": 1}, env={})
    for host in ("tunix", "maxtext"):
      assert manager.install(cfg, host=host, quiet=True).installed

  class NodeWorker(trainer_worker.TrainerWorker):

    def parameters(self):
      return [leaf.tobytes() for leaf in host_leaves(nnx.state(self._trainer.model))]

  async def main():
    worker = NodeWorker(lambda: tiny_engine(me, pyconfig, maxtext), worker_id=kind)
    worker.initialize()
    port = portpicker.pick_unused_port()
    server = remote_execution.GrpcRemoteExecutionServer(worker)
    await server.start_serving_async(port)
    print(json.dumps({kind: port}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until stdin closes
    await server.stop_serving()
    print("stopped", flush=True)

  asyncio.run(main())


if __name__ == "__main__":
  if sys.argv[1:2] == ["check"]:
    check_equivalence(int(sys.argv[2]))
    sys.exit(0)
  if sys.argv[1:2] == ["serve"]:
    serve(sys.argv[2])
    sys.exit(0)

# ---------------------------------------------------------------- the tests

import pytest  # pylint: disable=wrong-import-position

pytest.importorskip("maxtext.training_engine.maxtext_engine",
                    reason="MaxText's training engine (maxtext 0.2.5) is not importable")
pytest.importorskip("tunix.experimental.worker.trainer_worker",
                    reason="tunix's experimental stack (google/tunix main) is not importable")

# pylint: disable=wrong-import-position,wrong-import-order
import jax
import maxtext
from maxtext.configs import pyconfig
from maxtext.training_engine import maxtext_engine as me
from tunix.experimental.common import datatypes
from tunix.experimental.orchestrator import distributed_rl_engine
from tunix.experimental.orchestrator import rl_program
from tunix.experimental.worker import remote_execution
from tunix.experimental.worker import trainer_worker

from tunix_stage_plugin.activation import manager
from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.core import codec as codec_lib
from tests.records import job_records
from tunix_stage_plugin.hosts.maxtext import placement as placement_lib
from tunix_stage_plugin.core import codec_spec
from tunix_stage_plugin.hosts.tunix.adapter import ADAPTER

pytestmark = pytest.mark.maxtext


def _env(devices: int) -> dict[str, str]:
  env = {k: v for k, v in os.environ.items() if not k.startswith("TUNIX_")}
  env.update(JAX_PLATFORMS="cpu", PYTHONWARNINGS="ignore",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  return env


@pytest.mark.parametrize("devices", [1, 4])
def test_staged_one_or_two_ahead_is_bitwise_inline(devices):
  result = subprocess.run([sys.executable, __file__, "check", str(devices)], env=_env(devices),
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
  line = json.loads(result.stdout.strip().splitlines()[-1])
  assert line == {"devices": devices, "snapshots": STEPS * MICRO + STEPS, "identical": True}


@pytest.fixture
def staging():
  # The host bound fixed: the tests set the store's bounds themselves (one sized each step, the
  # default, would set them again after each step).
  cfg = config_lib.resolve({"mode": "stage", "max_device_batches": 2, "max_host_batches": 1},
                           env={})
  for host in ("tunix", "maxtext"):
    manager.uninstall(host, quiet=True)
    assert manager.install(cfg, host=host, quiet=True).installed
  yield
  for host in ("maxtext", "tunix"):
    manager.uninstall(host, quiet=True)


def _pair(n_devices=1):
  payloads = [payload(datatypes, n, b=2 * n_devices) for n in range(STEPS * MICRO)]
  inline_engine = tiny_engine(me, pyconfig, maxtext)
  inline_worker = trainer_worker.TrainerWorker(lambda: inline_engine)
  inline_worker.initialize()
  reference, _ = train(inline_worker, inline_engine, payloads)
  engine = tiny_engine(me, pyconfig, maxtext)
  worker = trainer_worker.TrainerWorker(lambda: engine)
  worker.initialize()
  return payloads, reference, engine, worker


def test_a_refused_stage_trains_inline_to_the_same_bits(staging):
  payloads, reference, engine, worker = _pair()
  store = ADAPTER.installation.trainer_side().staging_of(worker).store
  store.set_bounds(1, 1)

  def stage(n):
    if n % 2:  # reset before its stage arrives: the trainer refuses it, as it does one over a bound
      worker.reset_staged(keys=[f"c-{n}"])
    return worker.stage_batch(payloads[n], key=f"c-{n}").metadata["outcome"]["status"]

  statuses, snapshots = {0: stage(0)}, []
  for n, item in enumerate(payloads):
    if n + 1 < len(payloads):  # while n holds the only device slot
      statuses[n + 1] = stage(n + 1)
    train_one(worker, engine, n, item, statuses[n], f"c-{n}", snapshots)
  assert same_bits(snapshots, reference)
  assert list(statuses.values()) == ["staged", "refused"] * 4 + ["staged"]


def test_a_failed_placement_falls_back_to_the_same_bits(staging, monkeypatch):
  payloads, reference, engine, worker = _pair()
  real, calls = placement_lib._place_leaf, []  # pylint: disable=protected-access

  def flaky(leaf, sharding):
    calls.append(1)
    if len(calls) == 3:
      raise RuntimeError("injected device_put failure")
    return real(leaf, sharding)

  monkeypatch.setattr(placement_lib, "_place_leaf", flaky)
  snapshots, statuses, fallbacks = [], [], []
  for n, item in enumerate(payloads):
    statuses.append(worker.stage_batch(item, key=f"f-{n}").metadata["outcome"]["status"])
    fallbacks.append(train_one(worker, engine, n, item, statuses[-1], f"f-{n}", snapshots))
  # Received at once; the placer's one failure is said by its train call, which trained that
  # micro-batch from its held payload.
  assert statuses == ["staged"] * len(payloads)
  failed = [reason for reason in fallbacks if reason is not None]
  assert len(failed) == 1 and "injected device_put failure" in failed[0], fallbacks
  assert len(ADAPTER.installation.trainer_side().staging_of(worker).store) == 0
  assert same_bits(snapshots, reference)


@pytest.mark.skipif(not codec_lib.installed(codec_lib.DEFAULT_CODEC),
                    reason=f"{codec_lib.DEFAULT_CODEC} is not installed ({codec_lib.EXTRA})")
def test_a_compressed_stage_is_decoded_and_trains_to_the_same_bits(staging, monkeypatch):
  """Every array leaf packed (the threshold lowered: these micro-batches are tiny), decoded on
  the staging lane, then placed by the MaxText placement as an uncompressed one would be."""
  monkeypatch.setattr(codec_lib, "MIN_PACK_BYTES", 1)
  payloads, reference, engine, worker = _pair()
  codec, snapshots = codec_lib.parse("on"), []
  for n, item in enumerate(payloads):
    packed = codec_lib.compress_payload(codec, item)
    # RLTrainerPayload is a dataclass, not a pytree: its fields were packed one by one.
    assert type(packed.tree) is type(item)
    fields = [getattr(packed.tree, f.name) for f in dataclasses.fields(packed.tree)]
    assert not any(isinstance(v, (np.ndarray, jax.Array)) for v in fields)  # all packed
    assert sum(isinstance(v, codec_lib.PackedArray) for v in fields) == 8
    outcome = worker.stage_batch(packed, key=f"z-{n}").metadata["outcome"]
    assert outcome["status"] == "staged", outcome
    train_one(worker, engine, n, item, "staged", f"z-{n}", snapshots)
  assert same_bits(snapshots, reference)
  stats = ADAPTER.installation.trainer_side().staging_of(worker).store.stats
  assert stats.failed == 0 and stats.consumed == len(payloads)  # each trained from its placement


def test_an_adapter_set_after_staging_trains_from_the_payload_to_the_same_bits(staging):
  payloads, reference, engine, worker = _pair()
  reset_adapter = {4: lambda: engine.with_gen_model_input_fn(me.router_replay_gen_model_input_fn)}
  snapshots, reasons = train(worker, engine, payloads, ahead=1, hooks=reset_adapter)
  assert same_bits(snapshots, reference)
  stale = [n for n, r in enumerate(reasons) if r is not None]
  # 4 was placed before the change: it trains from its payload through the new adapter. 5 was
  # received just before it, one ahead, but placed after it (4 held the one device slot until it
  # trained), so it trains as placed; 6 on were staged after it.
  assert stale == [4] and "gen_model_input_fn was set" in reasons[4]


def test_restore_and_close_drop_what_was_staged(staging):
  engine = tiny_engine(me, pyconfig, maxtext)
  worker = trainer_worker.TrainerWorker(lambda: engine)
  worker.initialize()
  store = ADAPTER.installation.trainer_side().staging_of(worker).store
  assert worker.stage_batch(payload(datatypes, 0, b=2), key="r-0").metadata["staged"]
  engine.close()
  assert len(store) == 0 and store.stats.dropped == 1


def test_a_maxtext_without_the_seam_gets_nothing_and_says_why(monkeypatch):
  manager.uninstall("maxtext", quiet=True)
  monkeypatch.delattr(me.MaxTextTrainingEngine, "_prepare_batch")
  activation = manager.install(config_lib.resolve({"mode": "stage"}, env={}), host="maxtext",
                               quiet=True)
  assert not activation.installed
  assert "MaxTextTrainingEngine._prepare_batch is missing" in activation.line
  assert "\n" not in activation.line


# ---------------------------------------------------------------- end to end over gRPC

def _start_node(kind):
  proc = subprocess.Popen([sys.executable, __file__, "serve", kind], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=_env(1))
  for line in proc.stdout:  # MaxText prints its own lines first
    if line.startswith("{"):
      return proc, json.loads(line)
  proc.wait(10)
  pytest.fail(f"trainer node did not start:\n{proc.stderr.read()[-3000:]}")


class OnePerItem:

  def pack(self, payloads):
    return list(payloads)


def _run_program(port, staged):
  reports = []

  async def main():
    handle = remote_execution.ActorHandle.from_address(f"grpc://127.0.0.1:{port}",
                                                       rpc_timeout_s=300)
    engine = distributed_rl_engine.DistributedRLEngine([], {datatypes.Role.ACTOR: handle})
    program = rl_program.StandardRLProgram(
        algo=types.SimpleNamespace(group_size=1, mini_batch_size=MICRO,
                                   requires_reference_kl=False),
        assembler=OnePerItem(), max_staleness=1, sync_weights=False,
        on_step_end=lambda step, result: reports.append(program.last_step_result))
    for n in range(STEPS * MICRO):
      item = datatypes.TrajectoryItem(pair_index=0, group_id=f"g{n}", start_step=0,
                                      traj=datatypes.Trajectory(reward=0.0))
      item.payload = payload(datatypes, n, b=2)
      await program.scored_q.put(item)
    await program.train_stage(engine, num_steps=STEPS)
    params = await handle.asubmit("parameters")
    await handle.close()
    return params

  manager.uninstall("tunix", quiet=True)
  if staged:
    manager.install(config_lib.resolve({"mode": "stage"}, env={}), quiet=True)
  try:
    return asyncio.run(main()), reports
  finally:
    manager.uninstall("tunix", quiet=True)


def test_end_to_end_staged_maxtext_trainer_matches_one_without_the_plugin():
  nodes = [_start_node(kind) for kind in ("plugin", "plain")]
  try:
    ports = {name: port for _, ports in nodes for name, port in ports.items()}
    staged_params, reports = _run_program(ports["plugin"], staged=True)
    plain_params, plain_reports = _run_program(ports["plain"], staged=False)
  finally:
    for proc, _ in nodes:
      proc.stdin.close()
  for proc, _ in nodes:
    out = proc.stdout.read()
    assert proc.wait(120) == 0 and "stopped" in out, proc.stderr.read()[-3000:]
  assert not hasattr(plain_reports[0], "stage_metrics")
  metrics = [r.stage_metrics for r in reports]
  assert sum(m["stage/staged"] for m in metrics) > 0, metrics
  assert all(m["stage/fallbacks"] == 0 for m in metrics), metrics
  assert staged_params == plain_params  # byte for byte


def test_the_stage_figures_sit_beside_the_loss_in_maxtext_s_tensorboard(staging):
  """MaxText's engine writing TensorBoard files (enable_tensorboard): staged, its files hold
  `train/stage/...` at the steps of its own `train/loss`, written by its own metrics logger."""
  from tests.hosts.tunix.test_observability import tensorboard_scalars  # pylint: disable=import-outside-toplevel
  payloads = [payload(datatypes, n, b=2) for n in range(STEPS * MICRO)]
  engine = tiny_engine(me, pyconfig, maxtext, enable_tensorboard=True)
  worker = trainer_worker.TrainerWorker(lambda: engine)
  worker.initialize()
  train(worker, engine, payloads, ahead=1)
  assert ADAPTER.installation.drain(60)
  engine.close()  # drains its queue: the last loss written, the writer flushed
  engine._metrics_logger._tb_writer.flush()  # pylint: disable=protected-access
  import pathlib  # pylint: disable=import-outside-toplevel
  found = tensorboard_scalars(pathlib.Path(engine._config.tensorboard_dir))  # pylint: disable=protected-access
  loss_steps = [step for step, _ in found["train/loss"]]
  assert loss_steps == list(range(STEPS)), found["train/loss"]
  stage = {tag: points for tag, points in found.items() if tag.startswith("train/stage/")}
  print(f"\nMaxText TensorBoard tags: {sorted(found)}")
  for name in ("compute_s", "input_wait_mid_step_s", "placed_staged", "bound_by_compute"):
    assert [step for step, _ in stage[f"train/stage/{name}"]] == loss_steps, (name, stage)
  assert sum(v for _, v in stage["train/stage/placed_staged"]) == STEPS * MICRO


def test_the_trainer_records_each_step_of_a_maxtext_engine(staging, tmp_path):
  """The job's telemetry on MaxText's engine behind tunix's worker: each step's record names
  the maxtext host, its micro-batches and their staged placements, and is written to the
  metrics folder; the staged training is still bitwise the inline one."""
  folder = tmp_path / "metrics"
  for host in ("tunix", "maxtext"):  # the same settings, now with a metrics folder
    manager.install(config_lib.resolve({"mode": "stage", "max_device_batches": 2,
                                        "metrics": str(folder), "log_every": 0}, env={}),
                    host=host, quiet=True)
  heard = []  # the engines have no TensorBoard writer: their figures go to jax.monitoring

  def listen(event, value, **kwargs):
    heard.append((event, kwargs.get("step")))

  jax.monitoring.register_scalar_listener(listen)
  try:
    payloads, reference, engine, worker = _pair()  # the reference trains inline: STEPS records
    snapshots, _ = train(worker, engine, payloads, ahead=1)
    installation = ADAPTER.installation
    assert installation.drain(60)
  finally:
    jax.monitoring.unregister_scalar_listener(listen)
  assert same_bits(snapshots, reference)
  records = list(installation.telemetry.history["trainer"])
  # At the step MaxText buffers each update's loss under: the count before the update.
  assert [step for event, step in heard if event == "train/stage/compute_s"] == \
      [r["host_step"] - 1 for r in records] == [*range(STEPS)] * 2
  assert [r["step"] for r in records] == list(range(2 * STEPS))
  assert {r["host"] for r in records} == {"maxtext"}
  assert all(r["microbatches"] == MICRO and r["compute_s"] > 0 for r in records)
  inline, staged = records[:STEPS], records[STEPS:]
  assert [r["place"]["inline"] for r in inline] == [MICRO] * STEPS
  assert sum(r["place"]["staged"] for r in staged) == STEPS * MICRO
  written = job_records(folder)["trainer"]
  assert [r["step"] for r in written] == [r["step"] for r in records]
  # What a user runs on the job's records: the per-step table of the maxtext host's steps,
  # the split overall and one recommendation.
  out = subprocess.run([sys.executable, "-m", "tunix_stage_plugin", "report", str(folder)],
                       capture_output=True, text=True, timeout=60, check=True).stdout
  assert f"(maxtext, {2 * STEPS} steps)" in out and "wait boundary" in out, out
  assert "staging hid" in out and out.splitlines()[-1].startswith("recommendation: "), out
