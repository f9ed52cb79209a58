"""Runs the staging A/B on one bench host: the modes alternating in rounds, same data and seed.

One runner for every host (host.py), so every mode gets the same trainer, data, calibration and
machine, whichever host runs it. The rotating rounds, the warm-up step, the calibration judged
like a timed step and the re-runs of mode runs without a quiet step (bench.cpu): docs/bench.md
"What runs". Each position's bulk array is built once, before the first mode run
(data.BatchMaker: off the timed path; a 1 GiB one takes over a second of a core), and shared by
every step and mode; only a micro-batch's small per-step arrays are built when a host pulls it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import time
from typing import Callable

import numpy as np

from tunix_stage_plugin.transport import wire
from tunix_stage_plugin.lab.bench import cpu
from tunix_stage_plugin.lab.bench import host as host_lib
from tunix_stage_plugin.lab.bench import results
from tunix_stage_plugin.lab.embedded import data as data_lib

# Calibration is judged like a timed step: measured again (at most this many times in all) while
# other processes used more than cpu.QUIET_CORES during it; the quietest one is kept.
CALIBRATION_TRIES = 3


def payloads_held(options: results.BenchOptions) -> tuple[int, str]:
  """About how many payloads the two processes hold at once, and why (for the memory check)."""
  m = options.microbatches
  # On the trainer: a step's resident batches (calibration, resident), or what staging holds at
  # once: the device and host bounds, the batch computing and the one arriving (the pool gets
  # the last one placed back from JAX before it makes another, transport/listener.py).
  staged = options.max_device_batches + options.max_host_batches + 2
  on_trainer = max(m, staged)
  built = f"{m} built once on the orchestrator (one per position of a step)"
  if options.host == "tunix":  # two trainer nodes: resident and inline on one, staged on the other
    return m + m + staged, f"{built}, up to {m} and {staged} on the two trainer nodes"
  return m + on_trainer, f"{built}, up to {on_trainer} on the trainer"


def run_bench(options: results.BenchOptions, progress: Callable[[str], None] = lambda _: None, *,
              result: results.BenchResult | None = None) -> results.BenchResult:
  """Starts the host's trainer side, runs every round, stops it (its exit code in the result).

  `result` (a fresh one by default) is filled in place, so a caller interrupted by a signal
  (KeyboardInterrupt) still holds the runs that finished; the trainer side is stopped either way.
  """
  result = result if result is not None else results.BenchResult(options)
  start = time.monotonic()

  def say(text: str) -> None:
    progress(f"[{time.monotonic() - start:5.0f} s] {text}")

  host = host_lib.load(options)
  finished = False
  try:
    host.start(say)
    asyncio.run(_run(options, host, say, result))
    finished = True
  finally:
    try:
      result.trainer_exit_code = host.stop()
    except Exception:  # pylint: disable=broad-except
      if finished:
        raise  # otherwise the error already propagating is the one to report
    result.wall_s = time.monotonic() - start
  return result


async def _run(options: results.BenchOptions, host: host_lib.BenchHost,
               say: Callable[[str], None], result: results.BenchResult) -> None:
  await host.open()
  try:
    sizes = options.sizes()
    say(f"micro-batches of {sizes.payload_bytes / data_lib.MIB:.1f} MiB (seed {options.seed}): "
        f"building the {options.microbatches} bulk arrays every step shares")
    make = data_lib.BatchMaker(sizes, options.seed)
    await asyncio.to_thread(lambda: [make(0, i) for i in range(options.microbatches)])
    memcpy = await asyncio.to_thread(measure_memcpy, make(0, 0))
    calibration = result.calibration = dataclasses.replace(
        await _quiet_calibration(host, sizes, say),
        memcpy_fresh_bytes_per_s=memcpy[0], memcpy_warm_bytes_per_s=memcpy[1])
    say(f"calibrated: {calibrated_line(calibration)}; memcpy of a micro-batch "
        f"{memcpy[0] / GIB:.2f} GiB/s fresh, {memcpy[1] / GIB:.2f} warm")
    retries = options.retries
    total = options.rounds * len(options.modes)  # grows by one per re-run
    durations: list[float] = []
    for r in range(options.rounds):
      shift = r % len(options.modes)
      for mode in options.modes[shift:] + options.modes[:shift]:
        while True:
          began = time.monotonic()
          run = await host.run_mode(calibration, mode, r, make)
          durations.append(time.monotonic() - began)
          result.runs.append(run)
          say(f"{_progress_line(options, run)}; {time_left_line(durations, total)}")
          if any(run.step_quiet) or retries == 0:
            break
          retries -= 1
          total += 1
          say(f"re-running {mode}: other processes used more than {cpu.QUIET_CORES} cores in "
              f"every timed step ({retries} re-run(s) left)")
  finally:
    await host.close()


def calibrated_line(c: results.Calibration) -> str:
  """The calibration in one line: the compute, and the links (emulated, or the host's own)."""
  h2d = ("real (the trainer's own copies onto " + ", ".join(c.devices) + ")"
         if c.h2d_bytes_per_s is None else
         f"{c.h2d_bytes_per_s / 1e6:.1f} MB/s ({c.h2d_s:.3f} s) emulated")
  wire = ("the host's own links (nothing emulated)" if c.wire_bytes_per_s is None else
          f"wire {c.wire_bytes_per_s / 1e6:.1f} MB/s ({c.wire_s:.3f} s)")
  return (f"compute {c.compute_s:.3f} s/micro-batch, update {c.update_s:.3f} s -> {wire}, "
          f"H2D {h2d}, weight sync {c.sync_s:.3f} s")


GIB = 1 << 30


def measure_memcpy(batch: data_lib.Batch) -> tuple[float, float]:
  """Bytes per second of one copy of `batch`'s arrays into fresh memory, then into that memory
  again (its pages already faulted): the best a host path could do with one copy."""
  rates = []
  targets = [wire.aligned_empty(a.nbytes) for a in batch.arrays.values()]
  for _ in range(2):
    start = time.perf_counter()
    for target, array in zip(targets, batch.arrays.values()):
      np.copyto(target, array.reshape(-1).view(np.uint8))
    rates.append(batch.nbytes / max(time.perf_counter() - start, 1e-9))
  return rates[0], rates[1]


async def _quiet_calibration(host: host_lib.BenchHost, sizes: data_lib.Sizes,
                             say: Callable[[str], None]) -> results.Calibration:
  """The calibration measured with the fewest other processes' cores, after at most
  CALIBRATION_TRIES tries (one when the first is quiet); `noisy` when even that one was busy."""
  best: results.Calibration | None = None
  attempt = 0
  for attempt in range(1, CALIBRATION_TRIES + 1):
    c = await host.calibrate(sizes)
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
    sized = ("the links are sized for the compute measured then, which the modes may not see"
             if best.wire_bytes_per_s is not None else "the modes may measure another compute")
    say(f"calibration stayed noisy: other processes used {best.foreign_cores:.2f} cores at the "
        f"quietest of {attempt} tries; {sized} (the report compares them)")
  return dataclasses.replace(best, tries=attempt, noisy=noisy)


def _progress_line(options: results.BenchOptions, run: results.ModeRun) -> str:
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
