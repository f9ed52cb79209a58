"""A small tunix job for tunix's distributed runtime: its two process mains, so that
`recipes/local_launcher.sh --host tunix` runs a real job on one machine, on CPU, with no model to
download. Each runs as tunix runs a process:

    python -m tunix.experimental.distributed.runtime.main --discovery_id=orch --discovery_port=P \
        --process_main=tunix_stage_plugin.lab.tunix.job.orchestrator_main --steps N
    python -m tunix.experimental.distributed.runtime.main --discovery_addrs=orch:P \
        --process_main=tunix_stage_plugin.lab.tunix.job.trainer_main --microbatches M [--tiny]

- trainer_main: tunix's GrpcRemoteExecutionServer serving a TrainerWorker around tunix's
  PeftTrainer (the bench's decoder LM, node.py; `--tiny`: a tiny one), bound to a mesh of JAX's
  devices (on CPU two) as tunix's trainer node binds its trainer; it registers its port, model
  and micro-batches per step with the orchestrator's discovery service (the runtime's context)
  and serves until SIGTERM/SIGINT.
- orchestrator_main: waits for that registration, brings the worker up through tunix's
  ClusterOrchestrator (initialize, compile, start) and runs `--steps` steps of tunix's
  StandardRLProgram train loop on its DistributedRLEngine. There is no rollout model: the driver
  fills the program's scored queue with each step's micro-batches (lab/embedded/data.py), as the
  bench does, and no weight sync runs. Its last line is the job's summary.

Neither installs the plugin: as in any tunix process, `TUNIX_STAGE_BATCH=stage` in a process's
environment activates it there (the per-step line, TUNIX_STAGE_METRICS's record); off, both are
tunix's classes alone. docs/launching.md "A tunix job on this machine".
"""

from __future__ import annotations

import os

# JAX reads these when it starts its backends: a 2-device CPU mesh unless the caller chose.
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
if _DEVICE_COUNT_FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICE_COUNT_FLAG}=2".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# pylint: disable=wrong-import-position
import argparse
import asyncio
import concurrent.futures
import dataclasses
import json
import signal
import sys
import threading
import types
from typing import Any

import grpc
import jax
import numpy as np
import optax
import portpicker
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from flax import nnx
from tunix.experimental.common import datatypes
from tunix.experimental.orchestrator import orchestrator
from tunix.experimental.orchestrator import rl_program
from tunix.experimental.train import peft_trainer_v2
from tunix.experimental.worker import remote_execution
from tunix.experimental.worker import trainer_worker

from tunix_stage_plugin.activation import manager
from tunix_stage_plugin.lab import inputs
from tunix_stage_plugin.lab.embedded import data as data_lib
from tunix_stage_plugin.lab.tunix import node as node_lib

PROG = "tunix_job"
ACTOR = datatypes.Role.ACTOR
_count = inputs.argparse_type(inputs.count)
_seed = inputs.argparse_type(inputs.seed)
_port = inputs.argparse_type(inputs.port)
_seconds = inputs.argparse_type(inputs.positive)


class Failed(Exception):
  """The job cannot go on: one line, exit 1."""


@dataclasses.dataclass(frozen=True)
class Registration:
  """What the trainer tells the orchestrator's discovery service: where it serves and the job's
  shape (its model's micro-batch, how many per step). Built and read here only."""

  SERVICE = "tunix-stage-job-trainer"

  port: int
  worker_id: str
  sizes: data_lib.Sizes
  microbatches: int

  def encode(self) -> bytes:
    return json.dumps({"service": self.SERVICE, "port": self.port, "worker_id": self.worker_id,
                       "sizes": self.sizes.as_dict(), "microbatches": self.microbatches}).encode()

  @classmethod
  def decode(cls, metadata: bytes) -> "Registration | None":
    """The registration of one of this job's trainers; None for anything else registering."""
    try:
      said = json.loads(metadata)
      if said["service"] != cls.SERVICE:
        return None
      return cls(int(said["port"]), str(said["worker_id"]),
                 data_lib.sizes_from_dict(said["sizes"]), int(said["microbatches"]))
    except (ValueError, TypeError, KeyError):
      return None


def _check_context(context: Any, main: str) -> None:
  """Both mains talk through the runtime's discovery service: refuse to run without it."""
  if context is None:
    print(f"{PROG}: error: {main} is a process main of tunix's runtime: run it with python -m "
          f"tunix.experimental.distributed.runtime.main --process_main={__name__}.{main}",
          file=sys.stderr, flush=True)
    raise SystemExit(2)


# ---------------------------------------------------------------- the trainer


class _MeshBound:
  """The PeftTrainer's compute inside its mesh (the mesh context is the calling thread's), as
  tunix's trainer node binds its trainer; everything else reaches the trainer itself."""

  def __init__(self, trainer: peft_trainer_v2.PeftTrainer, mesh: Mesh) -> None:
    self._trainer = trainer
    self._mesh = mesh

  def __getattr__(self, name: str) -> Any:
    return getattr(self._trainer, name)

  def fwd_bwd(self, payload: Any, **kwargs: Any) -> Any:
    with self._mesh:
      return self._trainer.fwd_bwd(payload, **kwargs)

  def update(self, **kwargs: Any) -> Any:
    with self._mesh:
      return self._trainer.update(**kwargs)

  def close(self) -> None:
    with self._mesh:
      self._trainer.close()


def _make_trainer(sizes: data_lib.Sizes, microbatches: int, seed: int) -> _MeshBound:
  """tunix's PeftTrainer of the bench's model, its parameters replicated over every device."""
  devices = np.array(jax.devices())
  mesh = Mesh(devices.reshape(len(devices), 1), ("fsdp", "tp"))
  with mesh:
    model = node_lib.BenchLM(sizes, seed)
    replicated = NamedSharding(mesh, PartitionSpec())
    nnx.update(model, jax.tree.map(lambda x: jax.device_put(x, replicated), nnx.state(model)))
    trainer = peft_trainer_v2.PeftTrainer(
        model, optax.adamw(node_lib.LEARNING_RATE), peft_trainer_v2.TrainingConfig(
            eval_every_n_steps=10**9, gradient_accumulation_steps=microbatches,
            data_sharding_axis=node_lib.AXES, pbar_description=None))
  trainer.with_loss_fn(node_lib.LOSSES[sizes.payload])
  return _MeshBound(trainer, mesh)


def _trainer_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog=f"{PROG} trainer_main",
                                   description="A tunix trainer node of the small job.")
  parser.add_argument("--port", type=_port, default=0,
                      help="the gRPC server's port (default 0: a free one)")
  parser.add_argument("--worker_id", default="trainer-0", help="the TrainerWorker's id")
  parser.add_argument("--microbatches", type=_count, default=4, metavar="M",
                      help="micro-batches per step, its gradient accumulation (default 4)")
  parser.add_argument("--tiny", action="store_true", help="a tiny model (tests, smoke runs)")
  parser.add_argument("--seed", type=_seed, default=0, help="the initial parameters' seed")
  return parser


def trainer_main(argv: list[str], context: Any) -> None:
  """tunix runtime process main: serves the job's TrainerWorker until SIGTERM/SIGINT."""
  _check_context(context, "trainer_main")
  args = _trainer_parser().parse_args(argv)
  sizes = data_lib.TINY_SIZES if args.tiny else data_lib.DEFAULT_SIZES
  worker = trainer_worker.TrainerWorker(
      lambda: _make_trainer(sizes, args.microbatches, args.seed), worker_id=args.worker_id)
  port = args.port or portpicker.pick_unused_port()
  metadata = Registration(port, args.worker_id, sizes, args.microbatches).encode()

  async def serve() -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
      loop.add_signal_handler(signum, stop.set)
    server = remote_execution.GrpcRemoteExecutionServer(worker)
    await server.start_serving_async(port)
    print(f"{PROG}: trainer {args.worker_id} serving on port {port}", flush=True)
    # tunix's register retries until the orchestrator's discovery service answers: on a thread
    # of its own, so a signal stops this process meanwhile.
    threading.Thread(target=context.ipc.discovery.register, args=(metadata,), daemon=True,
                     name="register").start()
    await stop.wait()
    await server.stop_serving()
    print(f"{PROG}: trainer {args.worker_id} stopped", flush=True)

  asyncio.run(serve())


# ---------------------------------------------------------------- the orchestrator


class _Items:
  """tunix's assembler contract: each scored item's payload is one micro-batch."""

  def pack(self, payloads: list[Any]) -> list[Any]:
    return list(payloads)


def _orchestrator_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog=f"{PROG} orchestrator_main",
                                   description="The small job's orchestrator: tunix's train loop.")
  parser.add_argument("--steps", type=_count, default=3, metavar="N",
                      help="training steps (default 3)")
  parser.add_argument("--seed", type=_seed, default=0, help="the micro-batches' seed")
  parser.add_argument("--connect_timeout_s", type=_seconds, default=300.0, metavar="S",
                      help="how long to wait for the trainer to register (default 300)")
  parser.add_argument("--rpc_timeout_s", type=_seconds, default=600.0, metavar="S",
                      help="each call's deadline (default 600)")
  return parser


def _wait_for_trainer(context: Any, timeout_s: float) -> tuple[str, Registration]:
  """The first trainer that registers with this process's discovery service: its address and
  its registration."""
  found: concurrent.futures.Future = concurrent.futures.Future()

  def on_register(hostname: str, port: int, metadata: bytes) -> None:
    del port  # the registering process's own discovery port (0: it serves none)
    trainer = Registration.decode(metadata)
    if trainer is not None and not found.done():
      found.set_result((f"{hostname}:{trainer.port}", trainer))

  context.ipc.discovery.on_register(on_register)
  try:
    return found.result(timeout_s)
  except concurrent.futures.TimeoutError:
    raise Failed(f"no trainer registered within {timeout_s:g}s (--connect_timeout_s; "
                 "local_launcher.sh's --startup_timeout); is the trainer_main process running "
                 "with --discovery_addrs naming this one?") from None


async def _train(engine: Any, steps: int, microbatches: int, make: data_lib.BatchMaker
                 ) -> list[Any]:
  """`steps` steps of tunix's train loop; each step's result as the program recorded it (with
  the plugin, its stage/* metrics on it). The scored queue holds the current step's and the next
  step's micro-batches (what a prestage across the boundary takes), so memory does not grow with
  `steps`."""
  results: list[Any] = []
  ended = asyncio.Event()

  def step_end(step: int, result: Any) -> None:
    del step, result
    results.append(program.last_step_result)
    ended.set()

  program = rl_program.StandardRLProgram(
      algo=types.SimpleNamespace(group_size=1, mini_batch_size=microbatches,
                                 requires_reference_kl=False),
      assembler=_Items(), max_staleness=1, sync_weights=False, on_step_end=step_end)

  async def feed() -> None:
    for step in range(steps):
      while step > len(results) + 1:
        ended.clear()
        await ended.wait()
      for index in range(microbatches):
        item = datatypes.TrajectoryItem(pair_index=0, group_id=f"g{step}-{index}", start_step=0,
                                        traj=datatypes.Trajectory(reward=0.0))
        item.payload = {**make(step, index).arrays,
                        node_lib.MB: np.array([step, index], np.int32)}
        await program.scored_q.put(item)

  feeder = asyncio.create_task(feed())
  train = asyncio.create_task(program.train_stage(engine, num_steps=steps))
  try:
    # A feeder that fails would leave the loop waiting for micro-batches: whichever fails first.
    await asyncio.wait({feeder, train}, return_when=asyncio.FIRST_EXCEPTION)
    if feeder.done():
      feeder.result()
    await train
  finally:
    for task in (feeder, train):
      task.cancel()
  return results


def _staging_said(results: list[Any]) -> str:
  """What the summary says of staging: the plugin's per-step counts, or tunix alone."""
  if not manager.is_installed("tunix"):
    return "staging off (tunix's own train loop)"
  # pylint: disable-next=import-outside-toplevel
  from tunix_stage_plugin.hosts.tunix import run as run_lib
  metrics = [r.stage_metrics for r in results if isinstance(r, run_lib.StagedRLStepResult)]
  return ("staging on: " + ", ".join(
      f"stage/{name} per step {[m[f'stage/{name}'] for m in metrics]}"
      for name in ("staged", "inline", "fallbacks")))


def orchestrator_main(argv: list[str], context: Any) -> None:
  """tunix runtime process main: the job, then its summary line; exit 1 with one line when it
  cannot run."""
  _check_context(context, "orchestrator_main")
  args = _orchestrator_parser().parse_args(argv)
  try:
    address, trainer = _wait_for_trainer(context, args.connect_timeout_s)
    sizes, microbatches = trainer.sizes, trainer.microbatches
    print(f"{PROG}: trainer {trainer.worker_id} registered at {address} ({microbatches} "
          f"micro-batches per step, {sizes.payload_bytes / (1 << 20):.2f} MiB each)", flush=True)
    handle = remote_execution.ActorHandle.from_address(f"grpc://{address}",
                                                       rpc_timeout_s=args.rpc_timeout_s)
    cluster = orchestrator.ClusterOrchestrator()
    cluster.register_worker_handle(worker_id=trainer.worker_id, roles=[ACTOR], handle=handle,
                                   resources={"address": address})
    cluster.bring_up_workers()  # tunix's lifecycle: initialize, compile, start
    try:
      results = asyncio.run(_train(cluster.engine, args.steps, microbatches,
                                   data_lib.BatchMaker(sizes, args.seed)))
    finally:
      cluster.shutdown()  # stops the worker; its process serves until it is stopped
  except (Failed, RuntimeError, grpc.RpcError) as e:
    first = str(e).strip().split("\n", 1)[0] or type(e).__name__
    print(f"{PROG}: FAILED: {first}", file=sys.stderr, flush=True)
    raise SystemExit(1) from None
  steps = f"{len(results)} step{'' if len(results) == 1 else 's'}"
  print(f"{PROG}: OK: {steps} x {microbatches} micro-batches on tunix's "
        f"TrainerWorker {trainer.worker_id} at {address}, {_staging_said(results)}",
        flush=True)
