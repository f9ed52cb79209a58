"""The tunix host as a bench host (lab/bench/host.py): two trainer node processes (node.py), one
without the plugin and one with it, driven from this process by tunix's DistributedRLEngine and
StandardRLProgram train loop, its scored queue fed by the bench (no rollout model).

- inline: the node without the plugin, and nothing of the plugin in this process (tunix byte for
  byte); a micro-batch over tunix's message cap cannot travel that way, so then inline runs on the
  plugin's node with the plugin installed here staging nothing (depth 0): every call inline, over
  the plugin's large-payload path;
- depth1, depth2, depth2_prestage (and _codec): the plugin's node, the plugin installed here at
  that depth (a program subclass skips the prestage where the mode does);
- resident: the node without the plugin, each micro-batch placed there before the first step and
  only its id sent (the ceiling).

The links are tunix's own on 127.0.0.1: nothing is emulated, no weight sync runs (no rollout
model). docs/bench.md "Hosts".
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import gc
import json
import os
import selectors
import subprocess
import sys
import threading
import time
import types
from typing import Any, Callable, Iterator

import grpc
import numpy as np
from tunix.experimental.common import datatypes
from tunix.experimental.orchestrator import distributed_rl_engine
from tunix.experimental.orchestrator import rl_program
from tunix.experimental.worker import remote_execution

from tunix_stage_plugin.activation import manager
from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.core import tracks
from tunix_stage_plugin.core.telemetry import record as record_lib
from tunix_stage_plugin.core.telemetry import recorder as recorder_lib
from tunix_stage_plugin.core import contract
from tunix_stage_plugin.lab import rss
from tunix_stage_plugin.lab.bench import cpu
from tunix_stage_plugin.lab.bench import host as host_lib
from tunix_stage_plugin.lab.bench import metrics
from tunix_stage_plugin.lab.bench import modes as modes_lib
from tunix_stage_plugin.lab.bench import results
from tunix_stage_plugin.lab.bench import trace as trace_lib
from tunix_stage_plugin.lab.embedded import data as data_lib
from tunix_stage_plugin.lab.tunix import node as node_lib
from tunix_stage_plugin.transport import wire

ACTOR = datatypes.Role.ACTOR
PLAIN, PLUGIN = "plain", "plugin"  # the two trainer nodes
CLOCK_SAMPLES = 7
RPC_TIMEOUT_S = 600.0  # a call's deadline: a 1 GiB micro-batch's first call pays its buffers
START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0
EXIT_WAIT_S = 2.0  # after a failed call: how long a node's exit may take to be seen


class _Items:
  """tunix's assembler contract: each scored item's payload is one micro-batch."""

  def pack(self, payloads: list[Any]) -> list[Any]:
    return list(payloads)


class _NoPrestage(rl_program.StandardRLProgram):
  """depth1 and depth2: no staging across the step boundary (the plugin's seam)."""

  def _prestage_across_boundary(self, next_step: int) -> bool:
    del next_step
    return False


class _Unstaged(_NoPrestage):
  """Inline over tunix's cap: the plugin installed, staging nothing (depth 0)."""

  def _stage_ahead_while_pending(self, step: int, max_staged_batches: int) -> int:
    del step, max_staged_batches
    return 0


class _Drain:
  """A node's stderr read as it comes, its last lines kept: a pipe nobody reads fills (its
  per-step lines, tunix's log) and then blocks the node's next write."""

  LINES = 20

  def __init__(self, pipe: Any) -> None:
    self.lines: collections.deque[str] = collections.deque(maxlen=self.LINES)
    self._thread = threading.Thread(target=self._read, args=(pipe,), daemon=True,
                                    name="tunix-node-stderr")
    self._thread.start()

  def _read(self, pipe: Any) -> None:
    with contextlib.suppress(OSError, ValueError):  # the pipe closed under it: nothing to keep
      for line in pipe:
        if line.strip():
          self.lines.append(line.rstrip("\n"))

  def last(self, timeout_s: float) -> str | None:
    """The last line, once the node's stderr has ended (or `timeout_s` passed)."""
    self._thread.join(timeout_s)
    return self.lines[-1] if self.lines else None


@dataclasses.dataclass
class _Node:
  proc: subprocess.Popen
  port: int
  stderr: _Drain
  handle: Any = None
  offset: float = 0.0  # node perf_counter + offset = this process's perf_counter
  uncertainty: float = 0.0


class BenchHost:
  """host.BenchHost on tunix's host."""

  def __init__(self, options: results.BenchOptions) -> None:
    self.options = options
    self.nodes: dict[str, _Node] = {}
    self.info: dict[str, Any] = {}

  @property
  def pids(self) -> tuple[int, ...]:
    return tuple(n.proc.pid for n in self.nodes.values())

  def over_cap(self, sizes: data_lib.Sizes) -> bool:
    """Whether a micro-batch is over tunix's message cap (its unary call would refuse it)."""
    cap = remote_execution._MAX_MESSAGE_BYTES  # pylint: disable=protected-access
    return sizes.payload_bytes > cap - wire.CAP_MARGIN

  def start(self, say: host_lib.Say) -> None:
    say("starting two tunix trainer nodes (GrpcRemoteExecutionServer, TrainerWorker, PeftTrainer "
        "on a mesh of JAX's devices; on CPU two): one without the plugin, one with it")
    o = self.options
    env = {k: v for k, v in os.environ.items() if not k.startswith("TUNIX_")}
    # JAX_PLATFORMS as given here ('' lets JAX choose an accelerator); on CPU, two devices.
    env.update(JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", ""),
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "")
                          + " --xla_force_host_platform_device_count=2").strip(),
               PYTHONWARNINGS="ignore")
    procs = {}
    for kind in (PLAIN, PLUGIN):  # both start before either is waited for: JAX starts overlap
      spec = {"plugin": kind == PLUGIN, "sizes": o.sizes().as_dict(), "seed": o.seed,
              "microbatches": o.microbatches, "max_device_batches": o.max_device_batches,
              "max_host_batches": o.max_host_batches, "codec": o.codec}
      procs[kind] = subprocess.Popen(
          [sys.executable, "-m", "tunix_stage_plugin.lab.tunix.node", "--spec", json.dumps(spec)],
          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
          env=env)
      self.nodes[kind] = _Node(procs[kind], 0, _Drain(procs[kind].stderr))
    for kind, proc in procs.items():
      line = _first_line(proc, START_TIMEOUT_S)
      if line is None:
        raise host_lib.HostError(
            f"the tunix trainer node ({kind}) did not start: {_stderr_tail(self.nodes[kind])}")
      self.nodes[kind].port = json.loads(line)["port"]

  def stop(self) -> int | None:
    if not self.nodes:
      return None
    codes = []
    for node in self.nodes.values():
      proc = node.proc
      if proc.poll() is None:
        with contextlib.suppress(OSError):
          proc.stdin.close()  # the node serves until its stdin closes
        try:
          proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
          proc.kill()
          proc.wait()
      node.stderr.last(EXIT_WAIT_S)  # its reader has seen the end before the pipe closes
      for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
          pipe.close()
      codes.append(proc.returncode)
    return next((c for c in codes if c), 0)

  async def open(self) -> None:
    for kind, node in self.nodes.items():
      node.handle = remote_execution.ActorHandle.from_address(
          f"grpc://127.0.0.1:{node.port}", rpc_timeout_s=RPC_TIMEOUT_S)
      self.info[kind] = await node.handle.asubmit("bench_info")
      node.offset, node.uncertainty = await trace_lib.clock_offset(
          functools.partial(node.handle.asubmit, "bench_clock"), CLOCK_SAMPLES)
    if self.info[PLAIN]["plugin"] or not self.info[PLUGIN]["plugin"]:
      raise host_lib.HostError(f"the plain node must run without the plugin and the plugin's "
                               f"node with it; they report {self.info}")

  async def close(self) -> None:
    for node in self.nodes.values():
      handle, node.handle = node.handle, None
      if handle is not None:
        await handle.close()

  @contextlib.contextmanager
  def _failures(self, what: str) -> Iterator[None]:
    """A failed call to a node (tunix's remote-error envelope, gRPC's own errors) as one line
    naming what ran and, for a node that exited, its exit code and last stderr line."""
    try:
      yield
    except (RuntimeError, grpc.aio.AioRpcError) as e:
      # A node killed mid-call closes its socket a moment before its exit can be reaped.
      deadline = time.monotonic() + EXIT_WAIT_S
      gone = [f"the {kind} node exited with code {n.proc.returncode}: {_stderr_tail(n)}"
              for kind, n in self.nodes.items() if _exited(n.proc, deadline)]
      remote = contract.RemoteError.of(e)  # tunix's envelope of a node's exception
      if isinstance(e, grpc.aio.AioRpcError):
        first = f"{e.code().name}: {e.details()}"
      elif remote is not None:
        first = f"{remote.type_name}: {remote.message}"
      elif gone:
        first = str(e).split("\n", 1)[0]
      else:
        raise  # not a node's failure: this process's own, with its traceback
      raise host_lib.HostError(f"{what} on tunix's host failed: {first}"
                               + "".join(f"; {g}" for g in gone)) from e

  async def calibrate(self, sizes: data_lib.Sizes) -> results.Calibration:
    with self._failures("the calibration"):
      return await self._calibrate(sizes)

  async def run_mode(self, calibration: results.Calibration, mode: str, round_: int,
                     make: data_lib.BatchMaker) -> results.ModeRun:
    with self._failures(f"the {mode} run"):
      return await self._run_mode(calibration, mode, round_, make)

  async def _calibrate(self, sizes: data_lib.Sizes) -> results.Calibration:
    """Compiles (one resident step on each node, so no mode run's memory holds a compilation),
    then measures compute and its memory on resident data over the other steps, on the node
    without the plugin, and the other processes' cores meanwhile."""
    o, node = self.options, self.nodes[PLAIN]
    plugin = self.nodes[PLUGIN]
    await plugin.handle.asubmit("bench_setup")
    await self._job(plugin, "resident", 1, None)
    load = cpu.ForeignLoad([os.getpid(), *self.pids])
    for steps in (1, results.CALIBRATION_STEPS - 1):
      await node.handle.asubmit("bench_setup")
      load.start()
      await self._job(node, "resident", steps, None)
    foreign = load.lap()
    finish = await node.handle.asubmit("bench_finish")
    spans = await node.handle.asubmit("bench_timeline")
    compute, update = metrics.calibrated(spans, range(results.CALIBRATION_STEPS - 1))
    memory, payload = finish["rss"], sizes.payload_bytes
    info = self.info[PLAIN]
    return results.Calibration(
        compute_s=compute, update_s=update, payload_bytes=payload, wire_bytes_per_s=None,
        h2d_bytes_per_s=None, h2d="real", platform=info["platform"],
        devices=tuple(info["devices"]), sync_s=0.0, clock_offset_s=node.offset,
        clock_uncertainty_s=node.uncertainty, foreign_cores=foreign,
        compute_memory_bytes=metrics.compute_memory(memory, o.microbatches * payload))

  def node_for(self, mode: str) -> str:
    kind = modes_lib.BY_NAME[mode].plan["kind"]
    if kind == "staged" or (kind == "inline" and self.over_cap(self.options.sizes())):
      return PLUGIN
    return PLAIN

  async def _run_mode(self, calibration: results.Calibration, mode: str, round_: int,
                      make: data_lib.BatchMaker) -> results.ModeRun:
    o = self.options
    node_name = self.node_for(mode)
    node = self.nodes[node_name]
    # The plugin's node sizes its host bound in an auto run where the setting is auto (from its
    # start), and holds the fixed one in every other run.
    sized = o.size_host_bound and bool(modes_lib.BY_NAME[mode].plan.get("auto"))
    await node.handle.asubmit("bench_setup", **({} if node_name != PLUGIN else {
        "max_host_batches": config_lib.AUTO if sized else o.max_host_batches}))
    recorder = trace_lib.Kept()
    choices: list[dict] = []
    load = cpu.ForeignLoad([os.getpid(), *self.pids])
    step_loads: list[float | None] = []
    gc.collect()  # the previous run's garbage is not this run's memory
    orchestrator_baseline = rss.reset_peak()
    origin = time.perf_counter()
    load.start()
    reports = await self._job(node, mode, o.total_steps, make, recorder=recorder,
                              on_step=lambda: step_loads.append(load.lap()), choices=choices)
    finish = await node.handle.asubmit("bench_finish")
    trainer_spans = await node.handle.asubmit("bench_timeline")
    records = await node.handle.asubmit("bench_records")
    timings = metrics.step_timings(trainer_spans, range(results.WARMUP_STEPS, o.total_steps))
    warm = metrics.warmed_up(trainer_spans, results.WARMUP_STEPS)
    stage_calls = recorder.spans(tracks.ORCHESTRATOR_STAGE)
    stage_waits = pool_waits(trainer_spans, stage_calls, offset=node.offset)
    return results.ModeRun(
        mode=mode, round=round_, timings=timings,
        fwd_bwd_s=[metrics.fwd_bwd_durations(trainer_spans, t.step) for t in timings],
        update_s=[metrics.update_duration(trainer_spans, t.step) for t in timings],
        stage_call_s=[s.duration for s in stage_calls],
        stage_wait_s=stage_waits,
        fallbacks=sum(r.get("stage/fallbacks", 0) for r in reports), fallback_reasons=[],
        peak_device_batches=finish["store"]["peak"],
        max_device_batches=finish["max_device_batches"] or o.max_device_batches,
        peak_host_batches=finish["store"]["peak_host"],
        trained_order=finish["trained_order"], param_digest=finish["param_digest"],
        step_foreign_cores=step_loads[results.WARMUP_STEPS:],
        spans=recorder.spans() + trace_lib.shifted(trainer_spans, node.offset), origin=origin,
        trainer_rss=finish["rss"],
        orchestrator_rss={"baseline": orchestrator_baseline, "peak": rss.peak()},
        host_path=host_path(trainer_spans, stage_calls, stage_waits, since=warm,
                            offset=node.offset),
        device_memory=finish["device_memory"],
        h2d_s=metrics.median([s.duration for s in trainer_spans if s.track == tracks.TRAINER_H2D
                              and dict(s.args)["step"] >= results.WARMUP_STEPS]),
        h2d_overlap=metrics.placement_overlap(trainer_spans, since=warm),
        job_side=records[results.WARMUP_STEPS:] if node_name == PLUGIN else None,
        choices=metrics.choices(choices, records) if choices else [])

  async def _job(self, node: _Node, mode: str, steps: int, make: data_lib.BatchMaker | None, *,
                 recorder: trace_lib.Kept | None = None,
                 on_step: Callable[[], None] = lambda: None,
                 choices: list[dict] | None = None) -> list[dict[str, int]]:
    """`steps` steps of tunix's train loop on `node`, as `mode` runs it; each step's staging
    metrics (empty where the plugin is not installed here). An auto run's orchestrator records
    (its depth each step, and why) go in `choices`."""
    o = self.options
    plan = modes_lib.BY_NAME[mode].plan
    if plan["kind"] == "resident":
      await node.handle.asubmit("bench_place_resident",
                                [(s, i) for s in range(steps) for i in range(o.microbatches)])
    engine = distributed_rl_engine.DistributedRLEngine([], {ACTOR: node.handle})
    program_cls = rl_program.StandardRLProgram
    # The plugin here too, for a run on its node (resident runs tunix's own calls anywhere).
    staged = node is self.nodes[PLUGIN] and plan["kind"] != "resident"
    if staged:
      program_cls = (_Unstaged if plan["kind"] == "inline" else
                     rl_program.StandardRLProgram if plan.get("prestage") else _NoPrestage)
      manager.install(config_lib.resolve(
          {"mode": "stage",
           "max_staged_batches": config_lib.AUTO if plan.get("auto") else plan.get("depth", 1),
           "memory_budget": o.memory_budget, "codec": str(o.codec_for(mode) or "off"),
           "log_every": o.log_every}, env={}),
          quiet=True)
      if recorder is not None:
        _record_calls(engine, recorder)
    reports: list[dict[str, int]] = []

    def step_end(step: int, result: Any) -> None:
      del step, result
      reports.append(dict(getattr(program.last_step_result, "stage_metrics", {})))
      on_step()

    try:
      program = program_cls(
          algo=types.SimpleNamespace(group_size=1, mini_batch_size=o.microbatches,
                                     requires_reference_kl=False),
          assembler=_Items(), max_staleness=1, sync_weights=False, on_step_end=step_end)
      for step in range(steps):
        for index in range(o.microbatches):
          item = datatypes.TrajectoryItem(pair_index=0, group_id=f"g{step}-{index}",
                                          start_step=0, traj=datatypes.Trajectory(reward=0.0))
          item.payload = _payload(make, step, index, resident=plan["kind"] == "resident")
          await program.scored_q.put(item)
      await program.train_stage(engine, num_steps=steps)
      if staged and plan.get("auto") and choices is not None:
        from tunix_stage_plugin.hosts.tunix import adapter  # pylint: disable=import-outside-toplevel
        choices.extend(adapter.ADAPTER.installation.telemetry.history[record_lib.ORCHESTRATOR])
    finally:
      if staged:
        manager.uninstall("tunix", quiet=True)
    return reports


def _payload(make: data_lib.BatchMaker | None, step: int, index: int, *,
             resident: bool) -> dict[str, np.ndarray]:
  mb = np.array([step, index], np.int32)
  if resident or make is None:
    return {node_lib.RESIDENT: mb}
  return {**make(step, index).arrays, node_lib.MB: mb}


def _record_calls(engine: Any, recorder: trace_lib.Kept) -> None:
  """Each stage_train_batch call of this engine (the plugin's), as this process sees it."""
  stage = engine.stage_train_batch

  async def timed(payload: Any, **kwargs: Any) -> Any:
    with recorder.span(tracks.ORCHESTRATOR_STAGE, f"stage {kwargs['key']}"):
      return await stage(payload, **kwargs)

  engine.stage_train_batch = timed


def pool_waits(spans: list[recorder_lib.Span], stage_calls: list[recorder_lib.Span], *,
               offset: float) -> list[float]:
  """Each stage call's seconds (this process's spans) during which its bytes waited for the
  trainer's bounded receive pool (the node's TRAINER_POOL_WAIT spans, `offset` onto this clock)."""
  waits = trace_lib.shifted([s for s in spans if s.track == tracks.TRAINER_POOL_WAIT], offset)
  return [recorder_lib.busy_time(waits, c.start, c.end) for c in stage_calls]


def host_path(spans: list[recorder_lib.Span], stage_calls: list[recorder_lib.Span],
              stage_waits: list[float], *, since: float, offset: float
              ) -> dict[str, dict[str, float | int | None]]:
  """metrics.host_path's figures over tunix's real links, after `since` (the node's clock; its
  `offset` to this process's): a staged micro-batch's receive is its stage call (this process's
  span; the trainer answers once the payload is received and places it next on its staging
  lane); an inline one's is the wait from the answer to the fwd_bwd before it (tunix's loop sends
  the next one only then) to its placement starting (a step's first micro-batch, after the
  update, is left out). Neither counts the time its bytes waited for the trainer's bounded
  receive pool (`stage_waits`, pool_waits of each stage call): memory held back on purpose, not
  the host path."""
  spans = [s for s in spans if s.end >= since]
  calls = [c.duration - w for c, w in zip(stage_calls, stage_waits) if c.end >= since + offset]
  held = [s for s in spans if s.track == tracks.TRAINER_POOL_WAIT]
  computations = sorted((dict(s.args) for s in spans if s.track == tracks.DEVICE_COMPUTE),
                        key=lambda args: args["answered"])
  out = {}
  for path, lane in (("staged", "staging"), ("inline", "inline")):
    places = [s for s in spans if s.track == tracks.TRAINER_H2D and dict(s.args)["lane"] == lane]
    if path == "staged":
      receive_s = metrics.median(calls) if places else None
    else:
      waits = []
      for s in places:
        before = [c for c in computations if c["answered"] <= s.start]
        if before and before[-1]["kind"] == tracks.FWD_BWD:
          answered = before[-1]["answered"]
          waits.append(s.start - answered - recorder_lib.busy_time(held, answered, s.start))
      receive_s = metrics.median(waits)
    out[path] = metrics.path_figures(receive_s, places)
  return out


def _exited(proc: subprocess.Popen, deadline: float) -> bool:
  """Whether `proc` has exited, waiting for it until `deadline` (time.monotonic) at most."""
  try:
    proc.wait(max(0.0, deadline - time.monotonic()))
  except subprocess.TimeoutExpired:
    return False
  return True


def _first_line(proc: subprocess.Popen, timeout_s: float) -> str | None:
  """The node's first stdout line (its port), or None when it exits or stays silent that long."""
  with selectors.DefaultSelector() as selector:
    selector.register(proc.stdout, selectors.EVENT_READ)
    if not selector.select(timeout_s):
      proc.kill()
      proc.wait()
      return None
  line = proc.stdout.readline()
  return line or None


def _stderr_tail(node: _Node) -> str:
  proc = node.proc
  if proc.poll() is None:
    proc.kill()
  proc.wait()
  return node.stderr.last(EXIT_WAIT_S) or f"exit code {proc.returncode}, nothing on stderr"