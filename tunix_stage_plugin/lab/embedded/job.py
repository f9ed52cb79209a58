"""The orchestrator's training loop: steps of micro-batches, then a boundary (the weight sync).

Three kinds of run, same data and same seed, so they must end with the same parameters:

- inline: every micro-batch is sent with its train call; no pipeline, nothing staged.
- staged: core.pipeline.StagePipeline keeps up to `depth` micro-batches staged ahead (with
  `auto`, a depth sized each step by core.sizing from both processes' figures); with
  `prestage`, the next step's first micro-batches start staging as soon as this step's last train
  call is sent (run_step's `after_final_dispatch`), so they cross the update and the weight sync.
- resident: every micro-batch is placed on the device before the first step (no wire, no
  host-to-device at train time): the ceiling a perfect staging could reach.
"""

from __future__ import annotations

import dataclasses
import time
from typing import AsyncIterator, Callable

from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.core import pipeline as pipeline_lib
from tunix_stage_plugin.core import sizing
from tunix_stage_plugin.lab.bench import trace as trace_lib
from tunix_stage_plugin.core.telemetry import process as telemetry_lib
from tunix_stage_plugin.core.telemetry import recorder as recorder_lib
from tunix_stage_plugin.lab.embedded import data as data_lib
from tunix_stage_plugin.lab.embedded import client as client_lib

KINDS = ("inline", "staged", "resident")


@dataclasses.dataclass(frozen=True)
class JobPlan:
  steps: int
  microbatches: int
  kind: str = "inline"
  depth: int = 2  # staged only: TUNIX_MAX_STAGED_BATCHES
  prestage: bool = False  # staged only
  sync_s: float = 0.0  # the weight sync closing each step
  # staged only: the depth sized each step (TUNIX_MAX_STAGED_BATCHES=auto) within this budget
  # (TUNIX_STAGE_MEMORY_BUDGET); `depth` is then the default it falls back to.
  auto: bool = False
  budget_bytes: int = config_lib.SETTINGS_BY_FIELD["memory_budget"].default

  def __post_init__(self) -> None:
    if self.kind not in KINDS:
      raise ValueError(f"job kind {self.kind!r} is not one of {KINDS}")
    for name in ("steps", "microbatches", "depth"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"JobPlan.{name} must be an int >= 1; got {value!r}")
    if self.prestage and self.kind != "staged":
      raise ValueError("prestage needs kind='staged'")
    if self.auto and self.kind != "staged":
      raise ValueError("auto needs kind='staged'")
    if not self.sync_s >= 0:
      raise ValueError(f"JobPlan.sync_s must be >= 0; got {self.sync_s!r}")


@dataclasses.dataclass
class StepOutcome:
  step: int
  seconds: float  # orchestrator wall time: the step's train calls plus its weight sync
  loss: float
  report: pipeline_lib.StepReport
  depth: int = 0  # staged: the step's stage-ahead depth (sized at auto)

  def summary(self) -> str:
    r = self.report
    return (f"step {self.step}: loss {self.loss:.4f}, {self.seconds:.2f} s, stage/staged "
            f"{r.staged} stage/inline {r.inline} stage/prestaged {r.prestaged} "
            f"stage/fallbacks {r.fallbacks}")


async def _source(batch_for: Callable[[int, int], data_lib.Batch], step: int, microbatches: int
                  ) -> AsyncIterator[pipeline_lib.MicroBatch]:
  for index in range(microbatches):
    yield pipeline_lib.MicroBatch(batch_for(step, index), closes_step=index == microbatches - 1)


async def run_job(engine: client_lib.EmbeddedEngine, plan: JobPlan,
                  batch_for: Callable[[int, int], data_lib.Batch], *,
                  timeline: trace_lib.Kept | None = None,
                  telemetry: telemetry_lib.Telemetry | None = None,
                  on_step: Callable[[StepOutcome], None] | None = None) -> list[StepOutcome]:
  """Runs `plan`; `batch_for(step, index)` gives each micro-batch (called when it is pulled).
  With `telemetry` (staging on), each step's figures are recorded and said, as in a tunix job."""
  train_engine: pipeline_lib.StageEngine = engine
  if plan.kind == "resident":
    await engine.client.call("place_resident", [(s, i) for s in range(plan.steps)
                                                for i in range(plan.microbatches)])
    train_engine = engine.resident()
  recorder: recorder_lib.Recorder = timeline or recorder_lib.Recorder()
  sends = engine.recorder  # the engine's own, given back after the job
  if telemetry is None and plan.auto:  # the sizer hears the sends and says its choices: no record
    telemetry = telemetry_lib.Telemetry(telemetry_lib.Settings(host="embedded", log_every=0))
  if telemetry is not None:
    telemetry.orchestrator()  # this process orchestrates: its step figures listen
    if timeline is not None:
      telemetry.recorder.add_sink(timeline)
    recorder = engine.recorder = telemetry.recorder
  auto = engine.auto = sizing.AutoDepth(plan.budget_bytes, telemetry) if plan.auto else None
  pipeline = pipeline_lib.StagePipeline(train_engine, plan.depth, recorder=recorder,
                                        staging=plan.kind == "staged",
                                        depth_for=None if auto is None else auto.depth_for,
                                        room=None if auto is None else auto.room)
  outcomes: list[StepOutcome] = []
  started: dict[int, float] = {}

  def before_step(step: int) -> None:
    started[step] = time.perf_counter()

  async def after_step(step: int, report: pipeline_lib.StepReport) -> None:
    if plan.sync_s > 0:
      await engine.weight_sync(plan.sync_s)
    depth = plan.depth if auto is None else auto.step_ended(report)
    if telemetry is not None:
      telemetry.orchestrator_step(report, depth)
    outcome = StepOutcome(step, time.perf_counter() - started.pop(step),
                          float(report.result["loss"]), report, depth)
    outcomes.append(outcome)
    if on_step is not None:
      on_step(outcome)

  try:
    await pipeline.run_steps(lambda step: _source(batch_for, step, plan.microbatches),
                             steps=plan.steps, prestage=plan.prestage, before_step=before_step,
                             after_step=after_step)
  finally:
    engine.recorder = sends
    if auto is not None:
      engine.auto = None
      auto.close()
  return outcomes
