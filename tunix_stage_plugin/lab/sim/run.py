"""Runs the real core StagePipeline against the virtual-time trainer, once per mode.

The event loop's clock is looptime's (a well-kept asyncio virtual clock): every sleep of the model
completes at once in wall time, so an hour of steps simulates in well under a second, while the
pipeline's own code (its races, its depth, its prestage) runs exactly as on a trainer.
"""

from __future__ import annotations

import dataclasses
import re
from typing import AsyncIterator

import looptime

from tunix_stage_plugin.core import inputs
from tunix_stage_plugin.core import contract
from tunix_stage_plugin.core import sizing
from tunix_stage_plugin.lab.bench import metrics
from tunix_stage_plugin.lab.bench import modes as modes_lib
from tunix_stage_plugin.core import pipeline as pipeline_lib
from tunix_stage_plugin.core.telemetry import recorder as recorder_lib
from tunix_stage_plugin.lab.sim import model
from tunix_stage_plugin.lab.sim import trace as trace_lib

_DEPTH_MODE = re.compile(r"depth(?P<depth>[1-9][0-9]?)(?P<prestage>_prestage)?")
_AUTO_MODE = re.compile(r"auto(?P<budget>[1-9][0-9]?)?")
AUTO_BUDGET = 4  # `auto`'s memory budget, in micro-batches (autoN: N)
HOST = "simulate"  # the host its step figures say they came from (the sizer's)


@dataclasses.dataclass(frozen=True)
class Plan:
  """How a mode runs: inline, staged at a depth (with or without prestage), resident, or auto
(staged and prestaged, the depth chosen each step by core.sizing within a budget of `depth`
micro-batches)."""

  kind: str  # inline | staged | resident | auto
  depth: int = 1
  prestage: bool = False


MODES_ACCEPTED = (f"{', '.join(modes_lib.DEFAULT_MODES)}, depthN / depthN_prestage with N from "
                  f"1 to 99, or auto / autoN (the depth sized each step within N micro-batches, "
                  f"default {AUTO_BUDGET})")


def plan_of(mode: str) -> Plan:
  """How `mode` runs; inputs.Refused (a ValueError) naming the accepted modes otherwise."""
  if mode in modes_lib.BY_NAME and modes_lib.BY_NAME[mode].codec:
    raise inputs.Refused("an uncompressed mode with --what_if wire=Fx for the compressed wire "
                         "time", f"mode {mode!r} compresses, and the simulator does not model a "
                         "codec")
  auto = _AUTO_MODE.fullmatch(mode)  # (the bench's auto mode too: its budget in bytes here)
  if auto is not None:
    return Plan("auto", int(auto["budget"] or AUTO_BUDGET), True)
  table = {m.name: m.plan for m in modes_lib.MODE_TABLE}
  if mode in table:
    return Plan(**table[mode])
  match = _DEPTH_MODE.fullmatch(mode)
  if match is None:
    raise inputs.Refused(MODES_ACCEPTED, f"unknown mode {inputs.echo(mode)}")
  return Plan("staged", int(match["depth"]), bool(match["prestage"]))


@dataclasses.dataclass
class ModeResult:
  mode: str
  step_s: list[float]  # every step after the first (the first fills the pipeline)
  mid_step_idle_s: list[float]
  boundary_idle_s: list[float]
  total_s: float  # the whole trace, start to the last update's end
  fallbacks: int
  spans: list[recorder_lib.Span]
  peak_staged: int = 0  # the most micro-batches staged or staging at once, over the steps
  depths: list[int] = dataclasses.field(default_factory=list)  # each step's depth
  choices: list[str] = dataclasses.field(default_factory=list)  # auto: each step's and why

  @property
  def mean_step_s(self) -> float | None:
    return sum(self.step_s) / len(self.step_s) if self.step_s else None

  @property
  def median_step_s(self) -> float | None:
    return metrics.median(self.step_s)

  @property
  def timings(self) -> list[metrics.StepTiming]:  # for the timeline picture
    return [metrics.StepTiming(i + 1, s, m, b, s - m - b) for i, (s, m, b) in
            enumerate(zip(self.step_s, self.mid_step_idle_s, self.boundary_idle_s))]


async def _source(trace: trace_lib.Trace, step: int
                  ) -> AsyncIterator[pipeline_lib.MicroBatch]:
  times = trace.steps[step]
  last = len(times.microbatches) - 1
  for index, mb in enumerate(times.microbatches):
    yield pipeline_lib.MicroBatch(model.SimMicroBatch(step, index, mb, times.update_s),
                                  closes_step=index == last)


class _Answering:
  """The virtual-time trainer as auto's sizer sees it: each stage answer brings the trainer's
  newest closed step (as a trainer with the plugin answers), its steps as its telemetry makes
  them."""

  def __init__(self, trainer: model.SimTrainer, sizer: sizing.Sizer, bounds: tuple[int, int]
               ) -> None:
    self.trainer, self.sizer, self.bounds = trainer, sizer, bounds
    self.newest: contract.TrainerStep | None = None
    trainer.timeline.add_sink(recorder_lib.TrainerSteps(self._closed))

  def _closed(self, figures: dict) -> None:
    self.newest = contract.TrainerStep.of(
        figures, run=HOST, max_device_batches=self.bounds[0], max_host_batches=self.bounds[1],
        host_sized=False)

  async def stage(self, payload: model.SimMicroBatch, *, key: str
                  ) -> contract.StageOutcome:
    answer = (await self.trainer.stage(payload, key=key)).carrying(self.newest)
    if answer.trainer is not None:
      self.sizer.trainer(answer.trainer)
    return answer

  async def train(self, payload: model.SimMicroBatch | None, *, stage_key: str | None,
                  apply_optimizer: bool) -> contract.Trained:
    return await self.trainer.train(payload, stage_key=stage_key,
                                    apply_optimizer=apply_optimizer)

  async def reset(self, keys: list[str]) -> None:
    await self.trainer.reset(keys)


async def _run(trace: trace_lib.Trace, mode: str, max_device_batches: int,
               max_host_batches: int) -> ModeResult:
  plan = plan_of(mode)
  auto = plan.kind == "auto"
  if auto:  # the budget's micro-batches may all sit on the device
    max_device_batches = max(max_device_batches, plan.depth)
  trainer = model.SimTrainer(max_device_batches=max_device_batches,
                             max_host_batches=max_host_batches, resident=plan.kind == "resident")
  sizer = sizing.Sizer(budget_bytes=plan.depth, microbatch_bytes=1) if auto else None
  pipeline = pipeline_lib.StagePipeline(
      trainer if sizer is None else _Answering(trainer, sizer, (max_device_batches, max_host_batches)),
      1 if auto else plan.depth,
      recorder=trainer.timeline, staging=plan.kind in ("staged", "auto"),
      depth_for=None if sizer is None else sizer.depth_for)
  fallbacks, peak, depths, choices = 0, 0, [], []

  async def after_step(step: int, report: pipeline_lib.StepReport) -> None:
    nonlocal fallbacks, peak
    fallbacks += report.fallbacks
    peak = max(peak, report.peak_staged)
    depth = plan.depth
    if sizer is not None:
      choice = sizer.held(step)
      depth = choice.depth
      choices.append(choice.reason)
      sizer.orchestrator(sizing.OrchestratorStep.of(report, depth))
    depths.append(depth)
    await trainer.boundary(step, trace.steps[step].boundary_s)

  await pipeline.run_steps(lambda step: _source(trace, step), steps=len(trace.steps),
                           prestage=plan.prestage, after_step=after_step)
  spans = trainer.timeline.spans()
  timings = metrics.step_timings(spans, range(1, len(trace.steps)))
  ends = [s.end for s in spans if s.track == model.COMPUTE]
  return ModeResult(mode, [t.seconds for t in timings], [t.mid_step_idle for t in timings],
                    [t.boundary_idle for t in timings], max(ends), fallbacks, spans, peak, depths,
                    choices)


def simulate(trace: trace_lib.Trace, mode: str, *, max_device_batches: int = 1,
             max_host_batches: int = 1) -> ModeResult:
  """One mode over the whole trace, in virtual time (a fresh event loop each run)."""
  if len(trace.steps) < 2:
    raise trace_lib.TraceError(f"{trace.source}: {len(trace.steps)} step; accepted: at least 2 "
                               "(the first fills the pipeline, as a long run's steady state)")
  loop = looptime.new_event_loop(start=0.0, _enabled=True)
  try:
    return loop.run_until_complete(_run(trace, mode, max_device_batches, max_host_batches))
  finally:
    loop.run_until_complete(loop.shutdown_asyncgens())  # the steps' sources, left open
    loop.close()


def hidden_fractions(results: dict[str, ModeResult]) -> dict[str, float | None]:
  t_inline, t_resident = (results[m].median_step_s if m in results else None
                          for m in ("inline", "resident"))
  return {m: metrics.hidden_fraction(t_inline, r.median_step_s, t_resident)
          for m, r in results.items()}
