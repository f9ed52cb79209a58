"""Runs the staging A/B: one trainer process, the modes alternating in rounds, same data and seed.

One runner, so every mode gets the same trainer, data, calibration and machine. The modes, the
links calibrated from the measured compute time c, the warm-up step, the rotating rounds and the
re-runs of mode runs without a quiet step (bench.cpu): docs/bench.md "What runs"
and docs/performance.md. Each position's bulk array is built once, before the
first mode run (data.BatchMaker: off the timed path; a 1 GiB one takes over a second of a core),
and shared by every step and mode; only a micro-batch's small per-step arrays are built when the
pipeline pulls it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import os
import statistics
import time
from typing import Callable

import numpy as np

from tunix_stage_plugin.lab.bench import cpu
from tunix_stage_plugin.lab.bench import metrics
from tunix_stage_plugin.lab.bench import modes as modes_lib
from tunix_stage_plugin.core import buffers as buffers_lib
from tunix_stage_plugin.core import codec as codec_lib
from tunix_stage_plugin.lab import rss
from tunix_stage_plugin.core import timeline as timeline_lib
from tunix_stage_plugin.core import tracks
from tunix_stage_plugin.lab.embedded import client as client_lib
from tunix_stage_plugin.lab.embedded import data as data_lib
from tunix_stage_plugin.lab.embedded import engine as engine_lib
from tunix_stage_plugin.lab.embedded import job as job_lib
from tunix_stage_plugin.lab.embedded import process as process_lib

MODE_TABLE, MODES, SCENARIOS = modes_lib.MODE_TABLE, modes_lib.MODES, modes_lib.SCENARIOS
BY_NAME = modes_lib.BY_NAME
BURSTY_HEAD, BURSTY_HEAD_SLOWDOWN = 1 / 3, 1.6  # the first third of a step's transfers
BURSTY_SPIKE_P, BURSTY_SPIKE_SLOWDOWN = 0.2, 2.0  # and a fifth of all, at random
CALIBRATION_STEPS = 3  # the first compiles; the medians and the compute's memory use the others
# Calibration is judged like a timed step: measured again (at most this many times in all) while
# other processes used more than cpu.QUIET_CORES during it; the quietest one is kept.
CALIBRATION_TRIES = 3
WARMUP_STEPS = 1


def mode_codec(stage_codec: str, mode: str) -> codec_lib.Codec | None:
  """The codec of a mode's stages: --stage_codec, or `on` for a codec mode when that is off.
  Raises codec.CodecUnavailable when its library is not installed."""
  if modes_lib.BY_NAME[mode].codec and stage_codec == codec_lib.OFF:
    stage_codec = codec_lib.ON
  return codec_lib.parse(stage_codec)


def plan_for(mode: str, steps: int, microbatches: int, sync_s: float) -> job_lib.JobPlan:
  kinds = {m.name: m.plan for m in MODE_TABLE}
  if mode not in kinds:
    raise ValueError(f"unknown mode {mode!r}; accepted: {', '.join(MODES)}")
  return job_lib.JobPlan(steps, microbatches, sync_s=sync_s, **kinds[mode])


def transfer_slowdown(scenario: str, seed: int, microbatches: int
                      ) -> Callable[[data_lib.Batch], float] | None:
  """How much slower each micro-batch's wire transfer is than the calibrated link (None: never).

  bursty: seeded; the first third of each step's micro-batches 1.6x (the front-loaded contention
  of the upstream change's measured step) and, independently, a fifth of all 2x (spikes). The
  same micro-batch is as slow in every mode, whichever call carries it (a stage or an inline
  train), so the modes still compare like for like.
  """
  if scenario == "steady":
    return None

  def slowdown(batch: data_lib.Batch) -> float:
    factor = BURSTY_HEAD_SLOWDOWN if batch.index < BURSTY_HEAD * microbatches else 1.0
    spike = np.random.default_rng([seed, 7919, batch.step, batch.index]).random()
    return factor * (BURSTY_SPIKE_SLOWDOWN if spike < BURSTY_SPIKE_P else 1.0)

  return slowdown


@dataclasses.dataclass(frozen=True)
class BenchOptions:
  """One bench run's options, as `tunix-stage bench` checked them (lab/bench/command.py: every
  option is checked there, once, before anything starts)."""

  rounds: int = 3
  steps: int = 2  # timed steps per mode run, after WARMUP_STEPS
  microbatches: int = 4
  payload_mib: float = 16.0
  wire_ratio: float = 0.8
  h2d_ratio: float = 0.4
  sync_ratio: float = 0.5
  max_device_batches: int = 1
  max_host_batches: int = 1
  scenario: str = "steady"
  modes: tuple[str, ...] = modes_lib.DEFAULT_MODES
  seed: int = 0
  tiny: bool = False
  retries: int = 3  # re-runs of mode runs with no quiet step, for the whole benchmark
  payload: str = "dense"  # data.PAYLOADS
  codec: str = "off"  # TUNIX_STAGE_CODEC's values: staged payloads compressed (core.codec)
  h2d: str = "auto"  # modes.H2D

  def codec_for(self, mode: str) -> codec_lib.Codec | None:
    return mode_codec(self.codec, mode)

  @property
  def total_steps(self) -> int:
    return WARMUP_STEPS + self.steps

  def sizes(self) -> data_lib.Sizes:
    base = data_lib.TINY_SIZES if self.tiny else data_lib.DEFAULT_SIZES
    return base.with_payload(self.payload).with_payload_mib(self.payload_mib)


@dataclasses.dataclass(frozen=True)
class Calibration:
  compute_s: float  # median fwd_bwd of one micro-batch on the device
  update_s: float
  payload_bytes: int
  wire_bytes_per_s: float
  h2d_bytes_per_s: float | None  # None: --h2d real, the trainer's own copies (measured per run)
  sync_s: float
  clock_offset_s: float  # trainer perf_counter + offset = orchestrator perf_counter
  clock_uncertainty_s: float
  # One payload-sized copy on this machine, in this run: into fresh memory (its page faults
  # included) and into the same memory again (warm): the host path's physical limit.
  memcpy_fresh_bytes_per_s: float | None = None
  memcpy_warm_bytes_per_s: float | None = None
  # The trainer's compute working set (activations, XLA's buffers): its peak during the resident
  # calibration steps above its baseline and the resident payloads (None where not measured).
  compute_memory_bytes: int | None = None
  h2d: str = "emulated"  # what --h2d resolved to: real or emulated
  platform: str = "cpu"  # the trainer's JAX backend
  devices: tuple[str, ...] = ()  # the trainer's devices, as JAX names them
  # Other processes' cores while the compute was measured (None: unknown), how many tries the
  # calibration took, and whether even the quietest one was busier than cpu.QUIET_CORES.
  foreign_cores: float | None = None
  tries: int = 1
  noisy: bool = False

  @property
  def wire_s(self) -> float:
    return self.payload_bytes / self.wire_bytes_per_s

  @property
  def h2d_s(self) -> float | None:
    """The emulated host-to-device time of one micro-batch (None when the copies are real)."""
    return None if self.h2d_bytes_per_s is None else self.payload_bytes / self.h2d_bytes_per_s


@dataclasses.dataclass
class ModeRun:
  mode: str
  round: int
  timings: list[metrics.StepTiming]
  fwd_bwd_s: list[list[float]]  # per timed step, each micro-batch's device time (contention)
  update_s: list[float]  # per timed step, the update's device time
  stage_call_s: list[float]  # every engine.stage call of the run, orchestrator side
  fallbacks: int
  fallback_reasons: list[str]
  peak_device_batches: int
  peak_host_batches: int
  max_device_batches: int
  trained_order: list[str]
  param_digest: str
  step_foreign_cores: list[float | None]  # other processes' CPU during each timed step
  spans: list[timeline_lib.Span]  # orchestrator and trainer spans, on the orchestrator's clock
  origin: float  # orchestrator time the run started
  # engine.WireStats.as_dict() of the run: micro-batch bytes as arrays and as sent (all steps)
  wire: dict = dataclasses.field(default_factory=dict)
  # Each process's resident bytes when the run started and its peak during the run (None where
  # /proc cannot tell), and metrics.host_path of the trainer's spans.
  trainer_rss: dict = dataclasses.field(default_factory=dict)
  orchestrator_rss: dict = dataclasses.field(default_factory=dict)
  host_path: dict = dataclasses.field(default_factory=dict)
  # The trainer's device memory (worker.finish: baseline, sampled_peak, allocator_peak; None each
  # on CPU), its placements' median seconds after the warm-up, and the share of the staging
  # lane's placement time that ran while the device computed.
  device_memory: dict = dataclasses.field(default_factory=dict)
  h2d_s: float | None = None
  h2d_overlap: float | None = None

  @property
  def step_quiet(self) -> list[bool]:
    return [f is None or f <= cpu.QUIET_CORES for f in self.step_foreign_cores]


@dataclasses.dataclass
class BenchResult:
  """Filled in as the benchmark goes, so an interrupted one still has the runs that finished."""

  options: BenchOptions
  calibration: Calibration | None = None  # None: interrupted before calibrating
  runs: list[ModeRun] = dataclasses.field(default_factory=list)
  wall_s: float = 0.0
  trainer_exit_code: int | None = None
  interrupted: str | None = None  # the signal's name when a signal stopped the benchmark early


def payloads_held(options: BenchOptions) -> tuple[int, str]:
  """About how many payloads the two processes hold at once, and why (for the memory check)."""
  m = options.microbatches
  # On the trainer: a step's resident batches (calibration, resident), or what staging holds at
  # once: the device and host bounds, the batch computing and the one arriving (the pool gets
  # the last one placed back from JAX before it makes another, core/buffers.py).
  staged = options.max_device_batches + options.max_host_batches + 2
  on_trainer = max(m, staged)
  return m + on_trainer, (f"{m} built once on the orchestrator (one per position of a step), "
                          f"up to {on_trainer} on the trainer")


def run_bench(options: BenchOptions, progress: Callable[[str], None] = lambda _: None, *,
              result: BenchResult | None = None) -> BenchResult:
  """Starts a trainer process, runs every round, stops the trainer (checking it exits 0).

  `result` (a fresh one by default) is filled in place, so a caller interrupted by a signal
  (KeyboardInterrupt) still holds the runs that finished; the trainer is stopped either way.
  """
  result = result if result is not None else BenchResult(options)
  start = time.monotonic()

  def say(text: str) -> None:
    progress(f"[{time.monotonic() - start:5.0f} s] {text}")

  trainer = None
  try:
    say("starting the trainer process (JAX, 2-device CPU mesh, gRPC on 127.0.0.1)")
    # '' lets JAX choose: an accelerator when there is one (--h2d auto and real).
    trainer = process_lib.TrainerProcess(
        max_device_batches=options.max_device_batches, max_host_batches=options.max_host_batches,
        jax_platforms="cpu" if options.h2d == "emulated" else "")
    with trainer:
      asyncio.run(_run(options, trainer, say, result))
  finally:
    if trainer is not None:
      trainer.stop()  # idempotent: a signal may have cut the `with`'s own stop short
      result.trainer_exit_code = trainer.proc.returncode
    result.wall_s = time.monotonic() - start
  return result


async def _run(options: BenchOptions, trainer: process_lib.TrainerProcess,
               say: Callable[[str], None], result: BenchResult) -> None:
  async with client_lib.WorkerClient(trainer.address) as client:
    await client.wait_ready()
    engine = engine_lib.EmbeddedEngine(client, transfer_slowdown=transfer_slowdown(
        options.scenario, options.seed, options.microbatches))
    sizes = options.sizes()
    say(f"micro-batches of {sizes.payload_bytes / data_lib.MIB:.1f} MiB (seed {options.seed}): "
        f"building the {options.microbatches} bulk arrays every step shares")
    make = data_lib.BatchMaker(sizes, options.seed)
    await asyncio.to_thread(lambda: [make(0, i) for i in range(options.microbatches)])
    memcpy = await asyncio.to_thread(measure_memcpy, make(0, 0))
    calibration = result.calibration = dataclasses.replace(
        await _quiet_calibration(client, engine, options, sizes, trainer.pid, say),
        memcpy_fresh_bytes_per_s=memcpy[0], memcpy_warm_bytes_per_s=memcpy[1])
    c = calibration
    h2d = ("real (the trainer's own copies onto " + ", ".join(c.devices) + ")"
           if c.h2d_bytes_per_s is None else
           f"{c.h2d_bytes_per_s / 1e6:.1f} MB/s ({c.h2d_s:.3f} s) emulated")
    say(f"calibrated: compute {c.compute_s:.3f} s/micro-batch, update {c.update_s:.3f} s -> wire "
        f"{c.wire_bytes_per_s / 1e6:.1f} MB/s ({c.wire_s:.3f} s), H2D {h2d}, "
        f"weight sync {c.sync_s:.3f} s; "
        f"memcpy of a micro-batch {memcpy[0] / GIB:.2f} GiB/s fresh, {memcpy[1] / GIB:.2f} warm")
    client.pacer.set_rate(c.wire_bytes_per_s)
    retries = options.retries
    total = options.rounds * len(options.modes)  # grows by one per re-run
    durations: list[float] = []
    for r in range(options.rounds):
      shift = r % len(options.modes)
      for mode in options.modes[shift:] + options.modes[:shift]:
        while True:
          began = time.monotonic()
          run = await _run_mode(client, engine, options, calibration, mode, r, trainer.pid, make)
          durations.append(time.monotonic() - began)
          result.runs.append(run)
          say(f"{_progress_line(options, run)}; {time_left_line(durations, total)}")
          if any(run.step_quiet) or retries == 0:
            break
          retries -= 1
          total += 1
          say(f"re-running {mode}: other processes used more than {cpu.QUIET_CORES} cores in "
              f"every timed step ({retries} re-run(s) left)")


GIB = 1 << 30


def measure_memcpy(batch: data_lib.Batch) -> tuple[float, float]:
  """Bytes per second of one copy of `batch`'s arrays into fresh memory, then into that memory
  again (its pages already faulted): the best a host path could do with one copy."""
  rates = []
  targets = [buffers_lib.aligned_empty(a.nbytes) for a in batch.arrays.values()]
  for _ in range(2):
    start = time.perf_counter()
    for target, array in zip(targets, batch.arrays.values()):
      np.copyto(target, array.reshape(-1).view(np.uint8))
    rates.append(batch.nbytes / max(time.perf_counter() - start, 1e-9))
  return rates[0], rates[1]


async def _quiet_calibration(client: client_lib.WorkerClient, engine: engine_lib.EmbeddedEngine,
                             options: BenchOptions, sizes: data_lib.Sizes, trainer_pid: int,
                             say: Callable[[str], None]) -> Calibration:
  """The calibration measured with the fewest other processes' cores, after at most
  CALIBRATION_TRIES tries (one when the first is quiet); `noisy` when even that one was busy."""
  best: Calibration | None = None
  attempt = 0
  for attempt in range(1, CALIBRATION_TRIES + 1):
    c = await _calibrate(client, engine, options, sizes, trainer_pid)
    if best is None or (c.foreign_cores or 0.0) < (best.foreign_cores or 0.0):
      best = c
    if c.foreign_cores is None or c.foreign_cores <= cpu.QUIET_CORES:
      break
    if attempt < CALIBRATION_TRIES:
      say(f"calibrating again: other processes used {c.foreign_cores:.2f} cores while the "
          f"compute was measured (more than {cpu.QUIET_CORES}); try {attempt + 1} of "
          f"{CALIBRATION_TRIES}")
  assert best is not None
  noisy = best.foreign_cores is not None and best.foreign_cores > cpu.QUIET_CORES
  if noisy:
    say(f"calibration stayed noisy: other processes used {best.foreign_cores:.2f} cores at the "
        f"quietest of {attempt} tries; the links are sized for the compute measured then, which "
        "the modes may not see (the report compares them)")
  return dataclasses.replace(best, tries=attempt, noisy=noisy)


async def _calibrate(client: client_lib.WorkerClient, engine: engine_lib.EmbeddedEngine,
                     options: BenchOptions, sizes: data_lib.Sizes,
                     trainer_pid: int) -> Calibration:
  """Compiles (one resident step), then measures compute and its memory on resident data over
  the other steps (a fresh setup in between: compiled functions are kept, the peak restarts),
  and the other processes' cores meanwhile."""
  offset, uncertainty = await client.clock_offset()
  load = cpu.ForeignLoad([os.getpid(), trainer_pid])
  for steps in (1, CALIBRATION_STEPS - 1):
    await client.call("setup", sizes=sizes.as_dict(), seed=options.seed)
    plan = job_lib.JobPlan(steps, options.microbatches, kind="resident")
    load.start()
    await job_lib.run_job(engine, plan, lambda s, i: data_lib.Batch(s, i, {}))
  foreign = load.lap()  # over the measured steps only
  memory = (await client.call("finish"))["rss"]
  spans = await client.call("timeline")
  warm = range(CALIBRATION_STEPS - 1)
  compute = statistics.median(d for step in warm for d in metrics.fwd_bwd_durations(spans, step))
  update = statistics.median(s.duration for s in spans if s.track == tracks.DEVICE_COMPUTE
                             and dict(s.args)["kind"] == "update")
  payload = sizes.payload_bytes
  info = await client.call("info")
  real = options.h2d == "real" or (options.h2d == "auto" and info["platform"] != "cpu")
  return Calibration(
      compute_s=compute, update_s=update, payload_bytes=payload,
      wire_bytes_per_s=payload / (options.wire_ratio * compute),
      h2d_bytes_per_s=None if real else payload / (options.h2d_ratio * compute),
      h2d="real" if real else "emulated", platform=info["platform"],
      devices=tuple(info["devices"]),
      sync_s=options.sync_ratio * compute, clock_offset_s=offset,
      clock_uncertainty_s=uncertainty, foreign_cores=foreign,
      compute_memory_bytes=None if memory["peak"] is None or memory["baseline"] is None else max(
          0, memory["peak"] - memory["baseline"] - options.microbatches * payload))


def receive_buffers(options: BenchOptions, mode: str) -> int:
  """The receive buffers a mode's steady state reuses (measured): inline the one arriving (the
  pool gets the last one back from JAX, core/buffers.py); staged also the device and host bounds'
  batches; resident none."""
  kind = BY_NAME[mode].plan["kind"]
  if kind == "resident":
    return 0
  return 1 + (options.max_device_batches + options.max_host_batches if kind == "staged" else 0)


async def _run_mode(client: client_lib.WorkerClient, engine: engine_lib.EmbeddedEngine,
                    options: BenchOptions, calibration: Calibration, mode: str, round_: int,
                    trainer_pid: int, make: data_lib.BatchMaker) -> ModeRun:
  await client.call("setup", sizes=options.sizes().as_dict(), seed=options.seed,
                    h2d_mbps=(None if calibration.h2d_bytes_per_s is None
                              else calibration.h2d_bytes_per_s / 1e6),
                    receive_buffers=receive_buffers(options, mode))
  plan = plan_for(mode, options.total_steps, options.microbatches, calibration.sync_s)
  recorder = timeline_lib.Timeline()
  load = cpu.ForeignLoad([os.getpid(), trainer_pid])
  step_loads: list[float | None] = []
  if mode == "resident":  # the trainer built these itself; only their ids travel
    batch_for: Callable[[int, int], data_lib.Batch] = lambda s, i: data_lib.Batch(s, i, {})
  else:
    batch_for = make
  engine.wire = engine_lib.WireStats()
  engine.codec = options.codec_for(mode)
  gc.collect()  # the previous run's garbage is not this run's memory
  orchestrator_baseline = rss.reset_peak()
  origin = time.perf_counter()
  load.start()
  outcomes = await job_lib.run_job(engine, plan, batch_for, timeline=recorder,
                                   on_step=lambda _: step_loads.append(load.lap()))
  finish = await client.call("finish")
  trainer_spans = await client.call("timeline")
  timings = metrics.step_timings(trainer_spans, range(WARMUP_STEPS, options.total_steps))
  spans = recorder.spans() + timeline_lib.shifted(trainer_spans, calibration.clock_offset_s)
  fwd_bwd = [metrics.fwd_bwd_durations(trainer_spans, t.step) for t in timings]
  return ModeRun(
      mode=mode, round=round_, timings=timings, fwd_bwd_s=fwd_bwd,
      update_s=[metrics.update_duration(trainer_spans, t.step) for t in timings],
      stage_call_s=[s.duration for s in recorder.spans(tracks.ORCHESTRATOR_STAGE)],
      fallbacks=sum(o.report.fallbacks for o in outcomes),
      fallback_reasons=[r for o in outcomes for r in o.report.fallback_reasons],
      peak_device_batches=finish["store"]["peak"],
      max_device_batches=finish["max_device_batches"],
      peak_host_batches=finish["store"]["peak_host"],
      trained_order=finish["trained_order"], param_digest=finish["param_digest"],
      step_foreign_cores=step_loads[WARMUP_STEPS:], spans=spans, origin=origin,
      wire=engine.wire.as_dict(), trainer_rss=finish["rss"],
      orchestrator_rss={"baseline": orchestrator_baseline, "peak": rss.peak()},
      host_path=metrics.host_path(trainer_spans, since=_warmed_up(trainer_spans)),
      device_memory=finish["device_memory"],
      h2d_s=metrics.median([s.duration for s in trainer_spans if s.track == tracks.TRAINER_H2D
                            and dict(s.args)["step"] >= WARMUP_STEPS]),
      h2d_overlap=metrics.placement_overlap(trainer_spans, since=_warmed_up(trainer_spans)))


def _warmed_up(spans: list[timeline_lib.Span]) -> float:
  """When the warm-up steps ended (their last update): the receive buffers are faulted by then."""
  return max(s.end for s in spans if s.track == tracks.DEVICE_COMPUTE
             and dict(s.args)["step"] == WARMUP_STEPS - 1)


def _progress_line(options: BenchOptions, run: ModeRun) -> str:
  steps = " ".join(f"{t.seconds:.2f}" for t in run.timings)
  foreign = " ".join("n/a" if f is None else f"{f:.2f}" for f in run.step_foreign_cores)
  width = max(len(m) for m in options.modes)
  return (f"round {run.round + 1}/{options.rounds} {run.mode:<{width}} steps {steps} s, "
          f"fallbacks {run.fallbacks}, peak {run.peak_device_batches}/{run.max_device_batches}, "
          f"digest {run.param_digest[:8]}, other processes {foreign} cores")


def _duration(seconds: float) -> str:
  seconds = round(seconds)
  if seconds < 60:
    return f"{seconds} s"
  minutes, seconds = divmod(seconds, 60)
  if minutes < 60:
    return f"{minutes} min {seconds:02d} s"
  hours, minutes = divmod(minutes, 60)
  return f"{hours} h {minutes:02d} min"


def time_left_line(durations: list[float], total: int) -> str:
  """"run k of N, about T left": T is the mean of the finished runs' times x the runs left."""
  done = len(durations)
  left = max(0, total - done)
  if not left:
    return f"run {done} of {total}, the last"
  return (f"run {done} of {total}, about {_duration(statistics.fmean(durations) * left)} left "
          f"({left} run(s) of {statistics.fmean(durations):.1f} s on average)")


def runs_of_round(result: BenchResult, round_: int | None = None) -> dict[str, ModeRun]:
  """The runs of one round (the last by default), by mode, in the options' mode order."""
  round_ = result.options.rounds - 1 if round_ is None else round_
  runs = {r.mode: r for r in result.runs if r.round == round_}
  return {m: runs[m] for m in result.options.modes if m in runs}

