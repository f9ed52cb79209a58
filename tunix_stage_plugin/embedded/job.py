"""The orchestrator's training loop: steps of micro-batches, then a boundary (the weight sync).

Three kinds of run, same data and same seed, so they must end with the same parameters:

- inline: every micro-batch is sent with its train call; no pipeline, nothing staged.
- staged: core.pipeline.StagePipeline keeps up to `depth` micro-batches staged ahead; with
  `prestage`, the next step's first micro-batches start staging as soon as this step's last train
  call is sent (run_step's `after_final_dispatch`), so they cross the update and the weight sync.
- resident: every micro-batch is placed on the device before the first step (no wire, no
  host-to-device at train time): the ceiling a perfect staging could reach.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, AsyncIterator, Callable

from tunix_stage_plugin.core import pipeline as pipeline_lib
from tunix_stage_plugin.core import timeline as timeline_lib
from tunix_stage_plugin.embedded import data as data_lib
from tunix_stage_plugin.embedded import engine as engine_lib

KINDS = ("inline", "staged", "resident")
TRAIN_TRACK = "orchestrator/train"


@dataclasses.dataclass(frozen=True)
class JobPlan:
  steps: int
  microbatches: int
  kind: str = "inline"
  depth: int = 2  # staged only: TUNIX_MAX_STAGED_BATCHES
  prestage: bool = False  # staged only
  sync_s: float = 0.0  # the weight sync closing each step

  def __post_init__(self) -> None:
    if self.kind not in KINDS:
      raise ValueError(f"job kind {self.kind!r} is not one of {KINDS}")
    for name in ("steps", "microbatches", "depth"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"JobPlan.{name} must be an int >= 1; got {value!r}")
    if self.prestage and self.kind != "staged":
      raise ValueError("prestage needs kind='staged'")
    if not self.sync_s >= 0:
      raise ValueError(f"JobPlan.sync_s must be >= 0; got {self.sync_s!r}")


@dataclasses.dataclass
class StepOutcome:
  step: int
  seconds: float  # orchestrator wall time: the step's train calls plus its weight sync
  loss: float
  report: pipeline_lib.StepReport

  def summary(self) -> str:
    r = self.report
    return (f"step {self.step}: loss {self.loss:.4f}, {self.seconds:.2f} s, stage/staged "
            f"{r.staged} stage/inline {r.inline} stage/prestaged {r.prestaged} "
            f"stage/fallbacks {r.fallbacks}")


async def _source(batch_for: Callable[[int, int], data_lib.Batch], step: int, microbatches: int
                  ) -> AsyncIterator[pipeline_lib.MicroBatch]:
  for index in range(microbatches):
    yield pipeline_lib.MicroBatch(batch_for(step, index), closes_step=index == microbatches - 1)


async def run_job(engine: engine_lib.EmbeddedEngine, plan: JobPlan,
                  batch_for: Callable[[int, int], data_lib.Batch], *,
                  timeline: timeline_lib.Timeline | None = None,
                  on_step: Callable[[StepOutcome], None] | None = None) -> list[StepOutcome]:
  """Runs `plan`; `batch_for(step, index)` gives each micro-batch (called when it is pulled)."""
  timeline = timeline or timeline_lib.Timeline(enabled=False)
  if plan.kind == "resident":
    await engine.client.call("place_resident", [(s, i) for s in range(plan.steps)
                                                for i in range(plan.microbatches)])
  pipeline = (pipeline_lib.StagePipeline(engine, plan.depth, timeline=timeline)
              if plan.kind == "staged" else None)
  sources: dict[int, AsyncIterator[pipeline_lib.MicroBatch]] = {}

  def source(step: int) -> AsyncIterator[pipeline_lib.MicroBatch]:
    if step not in sources:
      sources[step] = _source(batch_for, step, plan.microbatches)
    return sources[step]

  outcomes: list[StepOutcome] = []
  prestage: pipeline_lib.Prestage | None = None
  try:
    for step in range(plan.steps):
      start = time.perf_counter()
      if pipeline is not None:
        adopted, prestage = prestage, None
        callback = None
        if plan.prestage and step + 1 < plan.steps:
          def callback(next_step: int = step + 1) -> None:
            nonlocal prestage
            prestage = pipeline.prestage(next_step, source(next_step))
        report = await pipeline.run_step(step, source(step), prestaged=adopted,
                                         after_final_dispatch=callback)
        result = report.result
      else:
        report, result = await _run_unstaged_step(engine, plan, step, source(step), timeline)
      if plan.sync_s > 0:
        await engine.weight_sync(plan.sync_s)
      outcome = StepOutcome(step, time.perf_counter() - start, float(result["loss"]), report)
      outcomes.append(outcome)
      if on_step is not None:
        on_step(outcome)
  finally:
    if prestage is not None:  # only after an error: a prestage is made for a step that follows
      await prestage.discard()
  return outcomes


async def _run_unstaged_step(
    engine: engine_lib.EmbeddedEngine, plan: JobPlan, step: int,
    source: AsyncIterator[pipeline_lib.MicroBatch], timeline: timeline_lib.Timeline,
) -> tuple[pipeline_lib.StepReport, Any]:
  report = pipeline_lib.StepReport(step)
  result = None
  async for mb in source:
    batch: data_lib.Batch = mb.payload
    with timeline.span(TRAIN_TRACK, f"train {batch.mb_id}", staged=False):
      if plan.kind == "resident":
        result = await engine.train_resident(batch.mb_id, apply_optimizer=mb.closes_step)
      else:
        result = await engine.train(batch, stage_key=None, apply_optimizer=mb.closes_step)
        report.inline += 1
    report.trained += 1
  report.result = result
  return report, result
