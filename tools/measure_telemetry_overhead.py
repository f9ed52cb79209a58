"""What the job's telemetry costs a staging process per step (docs/observability.md "Overhead").

Runs, in this process and with nothing else, exactly the work telemetry adds to one step of a
job of M micro-batches, on both sides, through the production classes (core.telemetry):

- trainer: each micro-batch's receive and placement recorded as live spans, each computation
  (M fwd_bwd and the update) handed to the watcher thread, whose wait returns at once (an output
  already ready: the wait itself costs the job nothing), the step's figures made, its record
  written and flushed to a file, its line formatted;
- orchestrator: each stage call and train call recorded as live spans in their own task, each
  send, the step's figures, record and line.

It times `STEPS` such steps (after `WARMUP`), and prints the median per step and per span, and
that median against the step lengths the bench measured at 16 MiB (the README's figures), as a
share. The per-step lines are formatted but not printed (printing one line to stderr is the
job's own cost of logging, the same as any log line).

    python tools/measure_telemetry_overhead.py [--microbatches 4,9] [--steps 300]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time

import numpy as np

from tunix_stage_plugin.core import tracks
from tunix_stage_plugin.core.telemetry import lines
from tunix_stage_plugin.core.telemetry import process
from tunix_stage_plugin.core.telemetry import recorder as recorder_lib

WARMUP = 20
# The 16 MiB step the bench measured on tunix's host (docs/bench.md "Hosts": depth2_prestage,
# M=4, median of 3 invocations): the step the overhead is a share of.
STEP_S = {"tunix's host, 16 MiB, M=4, depth2_prestage": 2.65}


class _Report:
  """A stand-in for core.pipeline.StepReport (the orchestrator's figures read these fields)."""

  def __init__(self, step: int, m: int) -> None:
    self.step, self.trained, self.staged, self.inline = step, m, m - 1, 1
    self.prestaged, self.peak_staged, self.fallbacks = 1, 2, 0
    self.fallback_reasons: list[str] = []


def trainer_steps(m: int, steps: int, folder: str) -> list[float]:
  tel = process.Telemetry(process.Settings(host="tunix", metrics_dir=folder, log_every=0))
  tel.trainer(lambda: (1, 1))
  watcher = recorder_lib.ComputeWatcher(tel.recorder, lambda output: None)
  ready = np.zeros(1)
  said = []
  times = []
  for step in range(WARMUP + steps):
    start = time.perf_counter()
    for i in range(m):
      with tel.recorder.span(tracks.TRAINER_RECEIVE, "stage_batch", transport="side",
                             bytes=16 << 20):
        pass
      with tel.recorder.span(tracks.TRAINER_H2D, "staged", lane="staging", bytes=16 << 20):
        pass
      now = time.perf_counter()
      watcher.dispatched("fwd_bwd", now, now, ready)
    now = time.perf_counter()
    watcher.dispatched("update", now, now, ready)
    watcher.drain()
    said.append(lines.trainer_line(tel.history["trainer"][-1]))
    times.append(time.perf_counter() - start)
  watcher.close()
  tel.close()
  return times[WARMUP:]


def orchestrator_steps(m: int, steps: int, folder: str) -> list[float]:
  tel = process.Telemetry(process.Settings(host="tunix", metrics_dir=folder, log_every=0))
  tel.orchestrator()

  async def call(track: str, step: int, index: int, **args) -> None:
    recorder_lib.CALL.set((step, index))
    with tel.recorder.span(track, f"s{step} m{index}", step=step, index=index, **args):
      with tel.recorder.span(tracks.ORCHESTRATOR_SEND, "stage_batch", transport="side",
                             bytes=16 << 20, step=step):
        pass

  async def run() -> list[float]:
    times = []
    for step in range(WARMUP + steps):
      start = time.perf_counter()
      await asyncio.gather(*(call(tracks.ORCHESTRATOR_STAGE, step, i, status="staged")
                             for i in range(m)))
      await asyncio.gather(*(call(tracks.ORCHESTRATOR_TRAIN, step, i, staged=True)
                             for i in range(m)))
      tel.orchestrator_step(_Report(step, m), 2)
      times.append(time.perf_counter() - start)
    return times[WARMUP:]

  times = asyncio.run(run())
  tel.close()
  return times


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
  parser.add_argument("--microbatches", default="4,9",
                      help="micro-batches per step, comma-separated (default 4,9)")
  parser.add_argument("--steps", type=int, default=300, help="timed steps (default 300)")
  args = parser.parse_args(argv)
  with tempfile.TemporaryDirectory() as folder:
    for m in (int(x) for x in args.microbatches.split(",")):
      trainer = statistics.median(trainer_steps(m, args.steps, folder))
      orchestrator = statistics.median(orchestrator_steps(m, args.steps, folder))
      spans = {"trainer": 3 * m + 1, "orchestrator": 3 * m}
      print(f"M={m}: trainer {trainer * 1e3:.3f} ms per step ({trainer / spans['trainer'] * 1e6:.1f} "
            f"us per span, {spans['trainer']} spans), orchestrator {orchestrator * 1e3:.3f} ms per "
            f"step ({orchestrator / spans['orchestrator'] * 1e6:.1f} us per span, "
            f"{spans['orchestrator']} spans); medians of {args.steps} steps")
      for name, step_s in STEP_S.items():
        print(f"  against a {step_s:.1f} s step ({name}): trainer {trainer / step_s:.4%}, "
              f"orchestrator {orchestrator / step_s:.4%}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
