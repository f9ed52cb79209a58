"""The staged path over real gRPC: tunix's GrpcRemoteExecutionServer, TrainerWorker and PeftTrainer.

Trainer nodes run in subprocesses (each its own 2-device CPU mesh, set before JAX starts) and
serve TrainerWorkers on localhost; this process is the orchestrator and connects over 127.0.0.1.
One node has the plugin installed (PLUGIN_WORKERS), the other has not (PLAIN_WORKERS); each run
trains a worker of its own from the same initial parameters. Each worker wraps a PeftTrainer with
a tiny flax nnx language model and a non-idempotent `_prepare_inputs` (it shifts the tokens, so
preparing twice trains other numbers), bound to the mesh the way tunix's trainer node binds it (a
small wrapper of our own, which also adds an optional delay before fwd_bwd so a call can be kept
running, and a call that ends that delay early). Two workers' trainers (OWN_PREPARE) also override `_prepare_payload` itself,
non-idempotently (it shifts the tokens again before PeftTrainer's own). A micro-batch also carries routed-expert ids (int16, -1 past each sequence's length)
that weight the loss, so a compressed payload decoded wrongly trains other numbers. The node
without the plugin raises tunix's message cap (its private `_MAX_MESSAGE_BYTES`, as the
orchestrator does for its channel to it) only so it can train an over-the-cap micro-batch inline
as the reference; the plugin's node keeps the upstream cap. Micro-batches of 256 MiB (routed-expert
ids, every one over the cap) train through the bulk side channel, or, on the workers served
without it (STREAM_ONLY), the chunked stream on the trainer's own port, and stop with one line on
a node without the plugin. Run
`python tests/hosts/tunix/test_grpc.py serve plugin|plain` to start a node by hand.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import time
import types
import zlib

import numpy as np
import pytest

TOKENS, SEQ, BATCH = 64, 16, 8  # batch 8 splits over fsdp=2: staged arrays are sharded
STEPS, MICRO = 2, 4
PLUGIN_WORKERS = ("staged", "timing", "compressed", "corrupted", "over_cap", "no_prestage",
                  "own_depth", "own_prepare", "all_over_cap", "over_cap_fallback", "bulk",
                  "bulk_big")
PLAIN_WORKERS = ("plain", "plain_over_cap", "plain_own_prepare", "plain_all_over_cap",
                 "plain_no_stream", "plain_bulk")
# The plugin's workers served without the bulk side channel (as on a trainer whose side channel
# cannot be reached): their calls over the cap take the chunked stream.
STREAM_ONLY = ("over_cap", "all_over_cap", "over_cap_fallback")
OWN_PREPARE = ("own_prepare", "plain_own_prepare")  # workers whose trainer overrides _prepare_payload
LAYERS, TOP_K = 64, 8  # 128 KiB of routed-expert ids: packed by the codec (>= MIN_PACK_BYTES)
# 140 MiB of ids, over tunix's 128 MiB message cap; routed in the first 8 layers only, -1 past
# them, so it compresses far below the cap.
OVER_CAP_LAYERS, OVER_CAP_TOP_K, OVER_CAP_ROUTED = 1120, 512, 8
TEST_CAP = 512 << 20  # the reference node's raised cap
# 256 MiB of ids per micro-batch (8 x 16 x 2048 x 512 int16), twice tunix's cap; routed in the
# first 8 layers (different in every micro-batch, spread over all 256 MiB), -1 past them.
BIG_LAYERS, BIG_TOP_K, BIG_ROUTED = 2048, 512, 8
# The plugin node's TUNIX_STAGE_MAX_DEVICE_BATCHES (2 unless _start_node is told otherwise).
NODE_DEPTH = "STAGE_TEST_NODE_MAX_DEVICE_BATCHES"
# The observed node's metrics folder (TUNIX_STAGE_METRICS of its install).
NODE_METRICS = "STAGE_TEST_NODE_METRICS"
# Where the node's PeftTrainers' MetricsLogger writes TensorBoard files (unset: tunix's default,
# a MetricsLogger with no backend); test_observability.py.
NODE_TENSORBOARD = "STAGE_TEST_NODE_TENSORBOARD"


def batch(seed, layers=LAYERS, top_k=TOP_K, routed=None):
  rng = np.random.default_rng(seed)
  mask = np.ones((BATCH, SEQ), np.int32)
  mask[:, -rng.integers(1, 4):] = 0
  experts = np.full((BATCH, SEQ, layers, top_k), -1, np.int16)
  routed = layers if routed is None else routed
  experts[:, :, :routed] = rng.integers(0, 32, (BATCH, SEQ, routed, top_k), dtype=np.int16)
  experts[mask == 0] = -1
  return {"tokens": rng.integers(0, TOKENS, (BATCH, SEQ), dtype=np.int32), "mask": mask,
          "experts": experts}


def fingerprint(experts):
  """Which micro-batch this is (its routed ids at one position), staged or inline alike."""
  return zlib.crc32(np.asarray(experts[0, :, :2]).tobytes())


# ---------------------------------------------------------------- the trainer node (subprocess)

def serve(kind: str) -> None:
  # pylint: disable=import-outside-toplevel
  import threading

  import jax
  import jax.numpy as jnp
  import optax
  import portpicker
  from flax import nnx
  from jax.sharding import Mesh, NamedSharding, PartitionSpec
  from tunix.experimental.train import peft_trainer_v2
  from tunix.experimental.worker import remote_execution, trainer_worker

  import tunix_stage_plugin
  from tunix_stage_plugin.core import config as config_lib
  from tunix_stage_plugin.lab import rss
  from tunix_stage_plugin.hosts.tunix.adapter import ADAPTER

  if kind == "plugin":
    depth = int(os.environ.get(NODE_DEPTH, "2"))
    assert tunix_stage_plugin.install(
        config_lib.resolve({"mode": "stage", "max_device_batches": depth}, env={})).installed
  elif kind == "observed":  # the plugin with a metrics record (test_observability.py)
    host_bound = {k: v for k, v in os.environ.items() if k == "TUNIX_STAGE_MAX_HOST_BATCHES"}
    assert tunix_stage_plugin.install(config_lib.resolve(
        {"mode": "stage", "max_device_batches": 2, "metrics": os.environ[NODE_METRICS]},
        env=host_bound)).installed
  elif kind == "environment":  # a job's trainer: whatever its environment activated, as a job's
    from tunix_stage_plugin.activation import manager  # pylint: disable=import-outside-toplevel
    assert manager.is_installed("tunix")
  elif kind == "plain":
    remote_execution._MAX_MESSAGE_BYTES = TEST_CAP  # pylint: disable=protected-access
  # "bare": tunix alone, one worker, nothing of the plugin (test_observability.py).
  # "runtime": launched by tunix's runtime, whatever activated there (test_runtime.py).
  mesh = Mesh(np.array(jax.devices()).reshape(2, 1), ("fsdp", "tp"))

  class TinyLM(nnx.Module):

    def __init__(self, rngs):
      self.embed = nnx.Embed(TOKENS, 32, rngs=rngs)
      self.hidden = nnx.Linear(32, 32, rngs=rngs)
      self.out = nnx.Linear(32, TOKENS, rngs=rngs)

    def __call__(self, tokens):
      return self.out(jax.nn.gelu(self.hidden(self.embed(tokens))))

  def loss_fn(model, tokens, mask, experts):
    logp = jax.nn.log_softmax(model(tokens[:, :-1]))
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    # Each position weighted by its routed-expert ids.
    weights = mask[:, 1:] * (1.0 + 1e-2 * experts[:, 1:].astype(jnp.float32).mean(axis=(2, 3)))
    return (nll * weights).sum() / jnp.maximum(weights.sum(), 1.0)

  class MeshBound:
    """Enters the worker's mesh around compute calls; passes everything else through."""

    def __init__(self, trainer):
      self._trainer = trainer
      self.delay = 0.0
      self.delaying = threading.Event()  # a delayed fwd_bwd has started
      self.released = threading.Event()  # a delayed fwd_bwd may go on before its delay ends
      self.inputs = []
      self.trained = []  # each fwd_bwd's micro-batch, by fingerprint

    def __getattr__(self, name):
      return getattr(self._trainer, name)

    def fwd_bwd(self, payload, **kwargs):
      if self.delay:
        self.delaying.set()
        self.released.wait(self.delay)  # the whole delay, unless released first
      leaf = payload["tokens"]
      self.inputs.append(str(leaf.sharding.spec) if isinstance(leaf, jax.Array) else "host")
      self.trained.append(fingerprint(payload["experts"]))
      with mesh:
        self._trainer.fwd_bwd(payload, **kwargs)

    def update(self, **kwargs):
      with mesh:
        return self._trainer.update(**kwargs)

    def close(self):
      with mesh:
        self._trainer.close()

  class NodeWorker(trainer_worker.TrainerWorker):
    """TrainerWorker plus test-only calls (a delay knob, the inputs seen, the parameters)."""

    def set_fwd_bwd_delay(self, seconds):
      self._trainer.delaying.clear()
      self._trainer.released.clear()
      self._trainer.delay = seconds

    async def wait_delayed_fwd_bwd(self):
      """Answers once a delayed fwd_bwd is running (async: served on the loop, off the lanes)."""
      return await asyncio.to_thread(self._trainer.delaying.wait, 60)

    async def release_delayed_fwd_bwd(self):
      """Ends a delayed fwd_bwd's delay now, once the test has seen what the delay was for
      (async: served on the loop, not queued behind that fwd_bwd on the lanes)."""
      self._trainer.released.set()

    def inputs_seen(self):
      return list(self._trainer.inputs)

    def prepare_calls(self):
      return self._trainer.prepare_calls  # an OwnPreparingTrainer's count

    def trained(self):
      return list(self._trainer.trained)

    def chunked_calls(self):  # the plugin's node only: calls received through the stream
      return dict(ADAPTER.installation.trainer_side().chunked_calls)

    def bulk_calls(self):  # the plugin's node only: calls received through the side channel
      return dict(ADAPTER.installation.trainer_side().bulk_calls)

    def peak_rss(self):
      return rss.peak()

    def pool_stats(self):  # the plugin's node only: its chunked calls' receive buffers
      pool = ADAPTER.installation.trainer_side().pool
      return {"made": pool.made, "reused": pool.reused, "held": pool.held_bytes(),
              "bound": pool.bound, "bound_waits": pool.bound_waits, "over_bound": pool.over_bound}

    def reset_peak_rss(self):
      return rss.reset_peak()

    def store_stats(self):  # the plugin's node only: this worker's staged-batch store
      stats = ADAPTER.installation.trainer_side().staging_of(self).store.stats
      return {"peak": stats.peak, "peak_host": stats.peak_host}

    def perf_spans(self):
      """The observed node: the span names on its trainer's tunix PerfTracer (exported as tunix
      exports them), and a Perfetto file of them written by tunix's own writer."""
      from tunix.perf.experimental import trace_writer  # pylint: disable=import-outside-toplevel
      tracer = traced[0]
      tracer.synchronize()
      timelines = tracer.export()
      names = {span.name for timeline in timelines.values() for step in timeline.all_steps
               for span in step.values()}
      folder = os.environ[NODE_METRICS]
      trace_writer.PerfettoTraceWriter(folder).write_timelines(timelines)
      return sorted(names), sorted(os.listdir(folder))

    def close_trainer(self):
      """Closes the trainer (tunix writes its last loss and closes its MetricsLogger's backends)
      once the plugin (where installed) has told it every step."""
      if kind != "bare":
        assert ADAPTER.installation.drain(60)
      self._trainer.close()

    def parameters(self):
      state = nnx.state(self._trainer.model, nnx.Param)
      return {jax.tree_util.keystr(path): np.asarray(leaf).tobytes()
              for path, leaf in jax.tree_util.tree_leaves_with_path(state)}

  class ShiftingTrainer(peft_trainer_v2.PeftTrainer):
    """Non-idempotent input preparation (a real tunix extension point)."""

    def _prepare_inputs(self, input_data):
      return {**input_data, "tokens": (input_data["tokens"] + 1) % TOKENS}

  class OwnPreparingTrainer(ShiftingTrainer):
    """Overrides `_prepare_payload` (a tunix extension point), non-idempotently, and counts."""

    prepare_calls = 0

    def _prepare_payload(self, payload):
      self.prepare_calls += 1
      return super()._prepare_payload({**payload, "tokens": (payload["tokens"] + 2) % TOKENS})

  from tunix.perf.experimental import tracer as perf_tracer
  traced = []  # the observed node's PerfTracer, its spans exported by perf_spans()

  def make_trainer(trainer_cls=ShiftingTrainer):
    extra = {}
    if kind == "observed":
      traced.append(perf_tracer.PerfTracer(
          devices=jax.devices(), export_fn=lambda timelines: timelines))
      extra["perf_tracer_v2"] = traced[-1]
    logged = None if NODE_TENSORBOARD not in os.environ else (
        peft_trainer_v2.MetricsLoggerOptions(log_dir=os.environ[NODE_TENSORBOARD],
                                             flush_every_n_steps=1))
    with mesh:
      model = TinyLM(nnx.Rngs(0))
      nnx.update(model, jax.tree.map(
          lambda x: jax.device_put(x, NamedSharding(mesh, PartitionSpec())), nnx.state(model)))
      trainer = trainer_cls(
          model, optax.adamw(1e-2),
          peft_trainer_v2.TrainingConfig(
              eval_every_n_steps=1000, gradient_accumulation_steps=MICRO,
              data_sharding_axis=("fsdp",), pbar_description=None,
              metrics_logging_options=logged),
          **extra)
    trainer.with_loss_fn(loss_fn)
    return MeshBound(trainer)

  async def main():
    servers, ports = [], {}
    for name in {"plugin": PLUGIN_WORKERS, "plain": PLAIN_WORKERS, "runtime": ("runtime",),
                 "observed": ("observed",), "bare": ("bare",),
                 "environment": ("environment",)}[kind]:
      trainer_cls = OwnPreparingTrainer if name in OWN_PREPARE else ShiftingTrainer
      worker = NodeWorker(functools.partial(make_trainer, trainer_cls), worker_id=name)
      worker.initialize()
      port = portpicker.pick_unused_port()
      server = remote_execution.GrpcRemoteExecutionServer(worker)
      if kind == "plugin":
        ADAPTER.installation.serve_side_channel = name not in STREAM_ONLY
      if kind == "runtime":
        print(manager_line(), file=sys.stderr, flush=True)
      await server.start_serving_async(port)
      servers.append(server)
      ports[name] = port
    print(json.dumps(ports), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until stdin closes
    for server in servers:
      await server.stop_serving()
    print("stopped", flush=True)

  asyncio.run(main())


def manager_line() -> str:
  """What this process's plugin says of itself (for a node launched by tunix's runtime)."""
  # pylint: disable-next=import-outside-toplevel
  from tunix_stage_plugin.activation import manager
  return json.dumps({"installed": manager.is_installed("tunix"),
                     "hooks": manager.installed_hooks("tunix"),
                     "site": "site" in sys.modules})  # False: no .pth file ran (python -S)


def runtime_trainer_main(argv, context):
  """A tunix runtime process main (`--process_main=tests.hosts.tunix.test_grpc.runtime_trainer_
  main`): one trainer node; the plugin is whatever tunix's runtime activated."""
  del argv, context
  serve("runtime")


def runtime_orchestrator_main(argv, context):
  """A tunix runtime process main: trains the small job against `--port`, the plugin being
  whatever tunix's runtime activated; prints one JSON line (parameters' digest, staging metrics,
  what the plugin says of itself)."""
  del context
  import argparse  # pylint: disable=import-outside-toplevel
  parser = argparse.ArgumentParser()
  parser.add_argument("--port", type=int, required=True)
  port = parser.parse_args(argv).port
  params, inputs, reports = asyncio.run(train(port, [batch(n) for n in range(STEPS * MICRO)],
                                              STEPS, rl_program.StandardRLProgram))
  print(json.dumps({"params": digest(params), "inputs": inputs,
                    "metrics": [getattr(r, "stage_metrics", None) for r in reports],
                    "plugin": json.loads(manager_line())}), flush=True)


def digest(params):
  """The parameters' bytes as one hex digest (equal digests: bitwise equal parameters)."""
  h = hashlib.sha256()
  for name in sorted(params):
    h.update(name.encode())
    h.update(params[name])
  return h.hexdigest()


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
  serve(sys.argv[2])
  sys.exit(0)

# ---------------------------------------------------------------- the tests (orchestrator side)

pytest.importorskip("tunix.experimental.orchestrator.rl_program",
                    reason="tunix's experimental stack (google/tunix main) is not importable")

from tunix.experimental.common import datatypes  # pylint: disable=wrong-import-position
from tunix.experimental.orchestrator import distributed_rl_engine
from tunix.experimental.orchestrator import rl_program
from tunix.experimental.worker import remote_execution

import grpc  # pylint: disable=wrong-import-position
import jax

from tunix_stage_plugin.activation import manager
from tunix_stage_plugin.core import codec as codec_lib
from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.core import contract
from tunix_stage_plugin.core import codec_spec
from tunix_stage_plugin.hosts.tunix import orchestrator
from tunix_stage_plugin.hosts.tunix.adapter import ADAPTER

pytestmark = pytest.mark.tunix
ACTOR = datatypes.Role.ACTOR


def _start_node(kind, max_device_batches=2, **extra_env):
  env = {k: v for k, v in os.environ.items() if not k.startswith("TUNIX_")}
  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2",
             PYTHONWARNINGS="ignore", **extra_env)
  env[NODE_DEPTH] = str(max_device_batches)
  proc = subprocess.Popen([sys.executable, __file__, "serve", kind], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
  line = proc.stdout.readline()
  if not line:
    proc.wait(10)
    pytest.fail(f"trainer node did not start:\n{proc.stderr.read()[-3000:]}")
  return proc, json.loads(line)


def _stop_node(proc):
  proc.stdin.close()
  out = proc.stdout.read()
  assert proc.wait(120) == 0 and "stopped" in out, proc.stderr.read()[-3000:]


@pytest.fixture(scope="module")
def node():
  """Both nodes (with and without the plugin), started together so their JAX start-ups overlap."""
  procs = [_start_node(kind) for kind in ("plugin", "plain")]
  yield {name: port for _, ports in procs for name, port in ports.items()}
  for proc, _ in procs:
    _stop_node(proc)


def connect(port):
  return remote_execution.ActorHandle.from_address(f"grpc://127.0.0.1:{port}", rpc_timeout_s=120)


def test_stage_completes_while_fwd_bwd_is_still_running(node):
  async def scenario():
    trainer = connect(node["timing"])
    await trainer.asubmit("fwd_bwd", payload=batch(100))  # compile first, outside the timing
    await trainer.asubmit("set_fwd_bwd_delay", 1.5)
    start = time.perf_counter()
    fwd_bwd = asyncio.create_task(trainer.asubmit("fwd_bwd", payload=batch(101)))
    assert await trainer.asubmit("wait_delayed_fwd_bwd")  # the trainer is inside that fwd_bwd
    staged = await trainer.asubmit("stage_batch", payload=batch(102), key="t-1")
    stage_done, running_then = time.perf_counter() - start, not fwd_bwd.done()
    health = await trainer.asubmit("heartbeat")
    await fwd_bwd
    fwd_done = time.perf_counter() - start
    await trainer.asubmit("set_fwd_bwd_delay", 0.0)
    await trainer.asubmit("fwd_bwd", payload=None, stage_key="t-1")
    inputs = await trainer.asubmit("inputs_seen")
    await trainer.close()
    return staged, stage_done, running_then, health, fwd_done, inputs

  staged, stage_done, running_then, health, fwd_done, inputs = asyncio.run(scenario())
  assert staged.metadata["staged"] is True, staged.metadata
  assert running_then and stage_done < 1.2 < fwd_done, (stage_done, fwd_done)
  assert health.state == datatypes.WorkerState.READY
  # Inline calls arrive as host arrays; the staged one arrives placed and sharded over fsdp.
  assert inputs == ["host", "host", "P('fsdp',)"]


class OnePerItem:

  def pack(self, payloads):
    return list(payloads)


def run_program(port, staged, *, codec="off", payloads=None, steps=STEPS, cap=None,
                program_cls=rl_program.StandardRLProgram, settings=None, env=None):
  """Trains `payloads` (default: STEPS x MICRO small micro-batches) through a real
  StandardRLProgram (or `program_cls`, a subclass) and engine; `cap` raises this process's
  message cap for the run; `settings` adds to the orchestrator's staging settings; `env`, where
  given, is the environment they are read from alone (as a job's process reads its own)."""
  payloads = [batch(n) for n in range(steps * MICRO)] if payloads is None else payloads
  manager.uninstall("tunix", quiet=True)
  if staged and env is not None:
    manager.install(config_lib.resolve(env=env), quiet=True)
  elif staged:
    manager.install(config_lib.resolve({"mode": "stage", "codec": codec, **(settings or {})},
                                       env={}), quiet=True)
  upstream_cap = remote_execution._MAX_MESSAGE_BYTES  # pylint: disable=protected-access
  remote_execution._MAX_MESSAGE_BYTES = cap or upstream_cap  # pylint: disable=protected-access
  try:
    return asyncio.run(train(port, payloads, steps, program_cls))
  finally:
    remote_execution._MAX_MESSAGE_BYTES = upstream_cap  # pylint: disable=protected-access
    manager.uninstall("tunix", quiet=True)


async def train(port, payloads, steps, program_cls):
  """The job: `payloads` through a StandardRLProgram (or `program_cls`) and a real engine against
  the worker at `port`; answers the trainer's parameters, the inputs it saw and each step's
  result, whatever the plugin is doing in this process."""
  assert len(payloads) == steps * MICRO
  reports = []
  handle = connect(port)
  engine = distributed_rl_engine.DistributedRLEngine([], {ACTOR: handle})
  program = program_cls(
      algo=types.SimpleNamespace(group_size=2, mini_batch_size=MICRO // 2,
                                 requires_reference_kl=False),
      assembler=OnePerItem(), max_staleness=1, sync_weights=False,
      on_step_end=lambda step, result: reports.append(program.last_step_result))
  for n, payload in enumerate(payloads):
    item = datatypes.TrajectoryItem(pair_index=n % 2, group_id=f"g{n // 2}", start_step=0,
                                    traj=datatypes.Trajectory(reward=0.0))
    item.payload = payload
    await program.scored_q.put(item)
  await program.train_stage(engine, num_steps=steps)
  params, inputs = await handle.asubmit("parameters"), await handle.asubmit("inputs_seen")
  await handle.close()
  return params, inputs, reports


@pytest.fixture(scope="module")
def inline(node):
  """The reference: the small micro-batches trained by the host's own loop, no plugin anywhere."""
  params, inputs, reports = run_program(node["plain"], staged=False)
  assert inputs == ["host"] * (STEPS * MICRO)  # the host's own loop, untouched
  assert not hasattr(reports[0], "stage_metrics")
  return params


@pytest.mark.loop_way
def test_staged_training_is_bit_identical_to_a_trainer_without_the_plugin(node, inline):
  staged_params, staged_inputs, reports = run_program(node["staged"], staged=True)
  # The trainer's own count of staged fwd_bwd calls (arrived placed and sharded) is the
  # orchestrator's stage/staged, and most micro-batches were staged.
  staged_count = sum(r.stage_metrics["stage/staged"] for r in reports)
  assert staged_inputs.count("P('fsdp',)") == staged_count >= STEPS * MICRO // 2, staged_inputs
  assert [r.stage_metrics["stage/fallbacks"] for r in reports] == [0] * STEPS
  assert staged_params.keys() == inline.keys() and len(staged_params) == 5
  assert staged_params == inline  # byte for byte

  async def untrained():  # the timing worker never ran update: its parameters are the initial ones
    handle = connect(node["timing"])
    params = await handle.asubmit("parameters")
    await handle.close()
    return params

  assert all(staged_params[k] != v for k, v in asyncio.run(untrained()).items())  # it trained


class NoPrestageProgram(rl_program.StandardRLProgram):
  """Overrides the upstream change's seam to skip the prestage at every step boundary."""

  def _prestage_across_boundary(self, next_step):
    return False


class OwnDepthProgram(rl_program.StandardRLProgram):
  """Overrides the upstream change's seam: one micro-batch ahead in step 0, none in step 1."""

  def _stage_ahead_while_pending(self, step, max_staged_batches):
    return 1 if step == 0 else 0


@pytest.mark.loop_way
def test_a_program_subclass_skipping_the_prestage_trains_the_same_parameters(node, inline):
  params, inputs, reports = run_program(node["no_prestage"], staged=True,
                                        program_cls=NoPrestageProgram)
  assert [r.stage_metrics["stage/prestaged"] for r in reports] == [0] * STEPS
  assert inputs[MICRO] == "host"  # step 1's head: nothing was staged for it during the boundary
  staged_count = sum(r.stage_metrics["stage/staged"] for r in reports)
  assert inputs.count("P('fsdp',)") == staged_count >= STEPS, inputs  # staging within the steps
  assert params == inline  # byte for byte


@pytest.mark.loop_way
def test_a_program_subclass_with_its_own_depth_trains_the_same_parameters(node, inline):
  params, inputs, reports = run_program(node["own_depth"], staged=True,
                                        program_cls=OwnDepthProgram)
  assert reports[0].stage_metrics["stage/peak_staged"] == 1
  assert inputs.count("P('fsdp',)") == reports[0].stage_metrics["stage/staged"] >= 1, inputs
  assert inputs[MICRO:] == ["host"] * MICRO  # step 1 trained inline, nothing staged for it
  assert reports[1].stage_metrics["stage/staged"] == 0
  assert params == inline  # byte for byte


def test_a_trainer_overriding_prepare_payload_stages_once_to_the_same_parameters(node, inline):
  reference, ref_inputs, _ = run_program(node["plain_own_prepare"], staged=False)
  params, inputs, reports = run_program(node["own_prepare"], staged=True)
  staged_count = sum(r.stage_metrics["stage/staged"] for r in reports)
  assert inputs.count("P('fsdp',)") == staged_count >= STEPS * MICRO // 2, inputs
  assert [r.stage_metrics["stage/fallbacks"] for r in reports] == [0] * STEPS
  assert params == reference  # byte for byte
  assert params != inline  # the override's own preparation trained other numbers

  async def prepare_calls(port):
    handle = connect(port)
    calls = await handle.asubmit("prepare_calls")
    await handle.close()
    return calls

  # The override ran exactly once per micro-batch on both nodes (staged ones at stage time).
  assert asyncio.run(prepare_calls(node["own_prepare"])) == STEPS * MICRO
  assert asyncio.run(prepare_calls(node["plain_own_prepare"])) == STEPS * MICRO


needs_codec = pytest.mark.skipif(not codec_lib.installed(codec_lib.DEFAULT_CODEC),
                                 reason=f"{codec_lib.DEFAULT_CODEC} is not installed "
                                 f"({codec_lib.EXTRA})")


@needs_codec
def test_compressed_staging_is_bit_identical_and_sends_fewer_bytes(node, inline, capsys):
  params, inputs, reports = run_program(node["compressed"], staged=True, codec="on")
  staged_count = sum(r.stage_metrics["stage/staged"] for r in reports)
  assert inputs.count("P('fsdp',)") == staged_count >= STEPS * MICRO // 2, inputs
  assert [r.stage_metrics["stage/fallbacks"] for r in reports] == [0] * STEPS
  assert params == inline  # byte for byte, decoded on the trainer's staging lane
  lines = capsys.readouterr().err  # the per-step line says what the codec saved
  ratios = [float(m) for m in re.findall(r"\(ratio ([0-9.]+)\)", lines)]
  assert len(ratios) == STEPS and all(r > 2 for r in ratios), lines


@needs_codec
def test_a_damaged_compressed_payload_is_trained_inline_and_counted(node, inline, monkeypatch,
                                                                    caplog):
  """The 2nd and 5th compressed payloads get one byte flipped in each chunk after packing, as a
  bad link would (loopback gRPC cannot be made to flip a bit): the trainer's decode fails its
  crc32, it trains nothing by that key, and the pipeline sends that micro-batch inline."""
  calls, compress = [], codec_lib.compress_payload

  def damaging(codec, payload):
    packed = compress(codec, payload)
    calls.append(payload)
    if len(calls) in (2, 5):
      for leaf in jax.tree.leaves(packed.tree):
        if isinstance(leaf, codec_lib.PackedArray):
          leaf.chunks = [c.copy() for c in leaf.chunks]
          for chunk in leaf.chunks:
            chunk[chunk.size // 2] ^= 0x5A
    return packed

  monkeypatch.setattr(codec_lib, "compress_payload", damaging)
  caplog.set_level(logging.INFO, logger="tunix_stage_plugin")
  params, _, reports = run_program(node["corrupted"], staged=True, codec="on")
  assert len(calls) >= 5
  assert sum(r.stage_metrics["stage/fallbacks"] for r in reports) == 2
  unreadable = re.findall(r"staged payload unreadable: staged batch '\S+' did not decode",
                          caplog.text)
  assert len(unreadable) == 2, caplog.text
  assert params == inline


def chunked_calls(port):
  """The plugin node's count of calls received through the chunked stream, per method."""
  async def ask():
    handle = connect(port)
    calls = await handle.asubmit("chunked_calls")
    await handle.close()
    return calls
  return collections.Counter(asyncio.run(ask()))


@needs_codec
def test_a_micro_batch_over_tunix_message_cap_stages_raw_in_chunks_and_compressed_unary(node):
  """Micro-batch 1 of the step carries 140 MiB (tunix refuses messages over 128 MiB); the
  others are small. Raw, its stage goes through the chunked stream; compressed it stages in one
  unary message; either way it trains by key to the parameters the raised-cap reference node
  trains it to inline."""
  over = batch(1, OVER_CAP_LAYERS, OVER_CAP_TOP_K, OVER_CAP_ROUTED)
  cap = remote_execution._MAX_MESSAGE_BYTES  # pylint: disable=protected-access
  assert over["experts"].nbytes > cap

  async def stage_raw():
    handle = connect(node["over_cap"])
    engine = distributed_rl_engine.DistributedRLEngine([], {ACTOR: handle})
    try:
      outcome = await engine.stage_train_batch(over, key="over-raw")
      dropped = await engine.reset_staged_batches(["over-raw"])
    finally:
      await ADAPTER.installation.orchestrator_side().close_connections()
      await handle.close()
    return outcome, dropped

  before = chunked_calls(node["over_cap"])
  manager.install(config_lib.resolve({"mode": "stage"}, env={}), quiet=True)
  try:
    outcome, dropped = asyncio.run(stage_raw())
  finally:
    manager.uninstall("tunix", quiet=True)
  assert outcome.staged and dropped == ["over-raw"], outcome
  assert chunked_calls(node["over_cap"]) - before == collections.Counter(stage_batch=1)

  payloads = [batch(0), over, batch(2), batch(3)]
  params, inputs, reports = run_program(node["over_cap"], staged=True, codec="on",
                                        payloads=payloads, steps=1)
  assert inputs[1] == "P('fsdp',)", inputs  # the over-cap micro-batch arrived placed
  assert reports[0].stage_metrics["stage/fallbacks"] == 0
  # Compressed, it travelled unary: no chunked call.
  assert chunked_calls(node["over_cap"]) - before == collections.Counter(stage_batch=1)
  reference, ref_inputs, _ = run_program(node["plain_over_cap"], staged=False,
                                         payloads=payloads, steps=1, cap=TEST_CAP)
  assert ref_inputs == ["host"] * MICRO
  assert params == reference


# ---------------------------------------------------------------- every micro-batch over the cap

@pytest.fixture(scope="module")
def big_payloads():
  """STEPS x MICRO micro-batches of 256 MiB each (2 GiB in this process, made once)."""
  payloads = [batch(n, BIG_LAYERS, BIG_TOP_K, BIG_ROUTED) for n in range(STEPS * MICRO)]
  assert all(p["experts"].nbytes == 256 << 20 for p in payloads)
  assert len({fingerprint(p["experts"]) for p in payloads}) == len(payloads)
  return payloads


def ask_node(port, method):
  """Calls one of the test node's own methods over tunix's client."""
  async def ask():
    handle = connect(port)
    try:
      return await handle.asubmit(method)
    finally:
      await handle.close()
  return asyncio.run(ask())


def trained(port):
  """What the trainer trained (fingerprints, in order) and its node's peak RSS since the reset."""
  return ask_node(port, "trained"), ask_node(port, "peak_rss")


def pool_stats(port):
  """The plugin node's receive-buffer pool: buffers made, reused, bytes held."""
  return ask_node(port, "pool_stats")


def reset_peak_rss(port):
  """Starts the trainer node's peak RSS again; answers its RSS now."""
  return ask_node(port, "reset_peak_rss")


def gib(nbytes):
  return f"{nbytes / (1 << 30):.2f} GiB" if nbytes is not None else "n/a"


@pytest.fixture(scope="module")
def big_reference(node, big_payloads):
  """The 256 MiB job trained by tunix's own loop inline, with tunix's cap raised in both
  processes (the plain node raises it at start, this process for the run)."""
  baseline = reset_peak_rss(node["plain_all_over_cap"])
  start = time.perf_counter()
  params, inputs, _ = run_program(node["plain_all_over_cap"], staged=False,
                                  payloads=big_payloads, cap=TEST_CAP)
  wall = time.perf_counter() - start
  assert inputs == ["host"] * (STEPS * MICRO)
  print(f"\n256 MiB x {STEPS * MICRO} micro-batches inline, tunix's loop with the cap raised: "
        f"{wall:.1f} s, trainer node peak RSS {gib(trained(node['plain_all_over_cap'])[1])} "
        f"(from {gib(baseline)})")
  return params


def run_big_job(port, payloads, reference):
  """The 256 MiB job on `port`, staged: each micro-batch trained once, in order, to `reference`
  byte for byte, no fallback; returns (staged, inline, wall s, peak RSS, baseline RSS)."""
  baseline = reset_peak_rss(port)
  start = time.perf_counter()
  params, inputs, reports = run_program(port, staged=True, payloads=payloads)
  wall = time.perf_counter() - start
  seen, peak = trained(port)
  assert seen == [fingerprint(p["experts"]) for p in payloads]  # once each, in order
  assert params == reference  # byte for byte
  metrics = [r.stage_metrics for r in reports]
  assert [m["stage/fallbacks"] for m in metrics] == [0] * STEPS
  staged = sum(m["stage/staged"] for m in metrics)
  inline = sum(m["stage/inline"] for m in metrics)
  assert staged + inline == STEPS * MICRO and staged >= STEPS * MICRO // 2, metrics
  assert inputs.count("P('fsdp',)") == staged
  return staged, inline, wall, peak, baseline


def test_every_micro_batch_over_the_cap_trains_through_the_stream(node, big_payloads,
                                                                  big_reference, capsys):
  """Every micro-batch is 256 MiB, twice tunix's cap, and the cap is the upstream one in both
  processes: each stage and each inline train call (the step's first, not staged) goes through
  the chunked stream; each micro-batch trains exactly once, in order, to the parameters of the
  raised-cap inline job."""
  port = node["all_over_cap"]
  before, pool_before = chunked_calls(port), pool_stats(port)
  staged, inline, wall, peak, baseline = run_big_job(port, big_payloads, big_reference)
  # Every micro-batch reached the trainer through the stream: staged ones by stage_batch, the
  # inline ones by fwd_bwd (update and the resets stayed unary).
  assert chunked_calls(port) - before == collections.Counter(stage_batch=staged,
                                                             fwd_bwd=inline)
  # Each step's line says what the stream carried: every micro-batch of the job.
  lines = capsys.readouterr().err
  sent = re.findall(r"(\d+) x 256\.0 MiB by chunked stream", lines)
  assert len(sent) == STEPS and sum(int(n) for n in sent) == STEPS * MICRO, lines
  # Each call's 256 MiB went into a pooled buffer (its small arrays are not pooled), and buffers
  # nothing referenced any more were reused.
  pool = {k: v - pool_before[k] for k, v in pool_stats(port).items()}
  assert pool["made"] + pool["reused"] == STEPS * MICRO and pool["reused"] >= 1, pool
  print(f"\n256 MiB x {STEPS * MICRO} micro-batches staged, through the stream: {wall:.1f} s, "
        f"trainer node peak RSS {gib(peak)} (from {gib(baseline)}); {staged} staged, {inline} "
        f"inline; receive buffers: {pool['made']} made, {pool['reused']} reused")


def test_a_fresh_trainers_receive_buffers_stay_within_its_staging_bounds(big_payloads,
                                                                      big_reference):
  """The 256 MiB job over the side channel on a fresh trainer node whose one worker stages:
  tunix's fwd_bwd answers once the work is queued, so micro-batches still computing hold their
  receive buffers (on CPU the placement is the buffer); the pool counts them, and the trainer
  keeps at most TUNIX_STAGE_MAX_DEVICE_BATCHES + TUNIX_STAGE_MAX_HOST_BATCHES (2 + 1) of them.
  Without the bound it made 4 (docs/tunix.md, "Where the trainer's memory goes")."""
  proc, ports = _start_node("plugin")
  try:
    port = ports["bulk_big"]
    run_big_job(port, big_payloads, big_reference)
    pool = pool_stats(port)
    assert pool["bound"] == 3, pool
    # A transfer that found no buffer back within the bound's wait made one more (counted).
    assert pool["made"] <= 3 + pool["over_bound"], pool
    assert pool["made"] + pool["reused"] == STEPS * MICRO, pool
  finally:
    _stop_node(proc)


def test_an_over_cap_fallback_trains_inline_through_the_stream(node, big_payloads,
                                                               big_reference, monkeypatch):
  """The 2nd and 5th stages are answered refused and failed by the orchestrator's StagingCalls
  itself, without sending (a real refusal needs the trainer's 30 s slot wait; a real failure,
  a broken trainer): the pipeline trains each of those micro-batches inline, and that inline
  call, 256 MiB, goes through the chunked stream like any other."""
  stage, calls = orchestrator.StagingCalls.stage, []

  async def stage_or_fall_back(self, payload, *, key):
    calls.append(key)
    if len(calls) == 2:
      return contract.refused(key, "injected refusal")
    if len(calls) == 5:
      return contract.failed(key, "injected failure")
    return await stage(self, payload, key=key)

  monkeypatch.setattr(orchestrator.StagingCalls, "stage", stage_or_fall_back)
  port = node["over_cap_fallback"]
  before = chunked_calls(port)
  params, _, reports = run_program(port, staged=True, payloads=big_payloads)
  seen, _ = trained(port)
  assert seen == [fingerprint(p["experts"]) for p in big_payloads]
  assert params == big_reference
  assert sum(r.stage_metrics["stage/fallbacks"] for r in reports) == 2
  inline = sum(r.stage_metrics["stage/inline"] for r in reports)
  staged = sum(r.stage_metrics["stage/staged"] for r in reports)
  assert chunked_calls(port) - before == collections.Counter(stage_batch=staged,
                                                             fwd_bwd=inline)
  assert inline >= 3  # step 0's first and the two fallbacks, each sent once, in chunks


def test_over_the_cap_with_no_stream_on_the_trainer_stops_with_one_line(node, big_payloads):
  """The node without the plugin has no chunked stream (UNIMPLEMENTED): the job stops at its
  first train call, having trained nothing, with one line naming the cap, the size and the
  setting. With staging off on the orchestrator the plugin is not installed: tunix's own
  RESOURCE_EXHAUSTED."""
  port = node["plain_no_stream"]
  payloads = big_payloads[:MICRO]
  with pytest.raises(orchestrator.PayloadOverCap) as stopped:
    run_program(port, staged=True, payloads=payloads, steps=1)
  line = str(stopped.value)
  assert "\n" not in line and stopped.value.__cause__ is None, line
  assert re.fullmatch(
      r"tunix-stage: a fwd_bwd call carrying 256\.0 MiB is over tunix's 128 MiB message cap "
      r"\(remote_execution\._MAX_MESSAGE_BYTES\) and the trainer at 127\.0\.0\.1:\d+ cannot take "
      r"it in chunks \(tunix-stage-plugin is not installed there, or staging is off there\); set "
      r"TUNIX_STAGE_BATCH=stage on both the orchestrator and the trainer", line), line
  with pytest.raises(grpc.aio.AioRpcError) as off:
    run_program(port, staged=False, payloads=payloads, steps=1)
  assert off.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
  assert trained(port)[0] == []  # nothing was trained either way


# ---------------------------------------------------------------- the bulk side channel


def bulk_calls(port):
  """The plugin node's count of calls received through the side channel, per method."""
  return collections.Counter(ask_node(port, "bulk_calls"))


def test_micro_batches_of_8_and_64_mib_travel_the_side_channel_to_the_same_parameters(node):
  """Micro-batches of 8 and 64 MiB (under tunix's cap: tunix's own path would be its unary call):
  every stage and every inline train call travels the side channel, and the job trains to the
  parameters of tunix's own loop on the node without the plugin, byte for byte."""
  payloads = [batch(n, 64 if n % 2 else 512, 512, 8) for n in range(STEPS * MICRO)]
  assert {p["experts"].nbytes >> 20 for p in payloads} == {8, 64}
  port = node["bulk"]
  before, chunked_before = bulk_calls(port), chunked_calls(port)
  params, inputs, reports = run_program(port, staged=True, payloads=payloads)
  assert trained(port)[0] == [fingerprint(p["experts"]) for p in payloads]
  metrics = [r.stage_metrics for r in reports]
  staged = sum(m["stage/staged"] for m in metrics)
  inline = sum(m["stage/inline"] for m in metrics)
  assert [m["stage/fallbacks"] for m in metrics] == [0] * STEPS and staged >= MICRO, metrics
  assert inputs.count("P('fsdp',)") == staged
  assert bulk_calls(port) - before == collections.Counter(stage_batch=staged, fwd_bwd=inline)
  assert chunked_calls(port) == chunked_before
  reference, ref_inputs, _ = run_program(node["plain_bulk"], staged=False, payloads=payloads)
  assert ref_inputs == ["host"] * (STEPS * MICRO)
  assert params == reference


def test_every_256_mib_micro_batch_trains_through_the_side_channel(node, big_payloads,
                                                                  big_reference, caplog):
  """The 256 MiB job of the stream's test, on a worker with the side channel: each stage and each
  inline train call goes over it (none through the stream), each micro-batch trains once, in
  order, to the parameters of the raised-cap inline job."""
  caplog.set_level(logging.INFO, logger="tunix_stage_plugin")
  port = node["bulk_big"]
  before, chunked_before, pool_before = bulk_calls(port), chunked_calls(port), pool_stats(port)
  staged, inline, wall, peak, baseline = run_big_job(port, big_payloads, big_reference)
  assert bulk_calls(port) - before == collections.Counter(stage_batch=staged, fwd_bwd=inline)
  assert chunked_calls(port) == chunked_before
  # Each call's 256 MiB went into a pooled buffer, and buffers nothing referenced were reused.
  pool = {k: v - pool_before[k] for k, v in pool_stats(port).items()}
  assert pool["made"] + pool["reused"] == STEPS * MICRO and pool["reused"] >= 1, pool
  assert re.search(r"tunix-stage: bulk side channel to 127\.0\.0\.1:\d+ for micro-batch calls "
                   r">= 1 MiB", caplog.text), caplog.text
  print(f"\n256 MiB x {STEPS * MICRO} micro-batches staged, over the side channel: {wall:.1f} s, "
        f"trainer node peak RSS {gib(peak)} (from {gib(baseline)}); {staged} staged, {inline} "
        f"inline; receive buffers: {pool['made']} made, {pool['reused']} reused")
