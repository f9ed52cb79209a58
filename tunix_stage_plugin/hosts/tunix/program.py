"""StandardRLProgram: a staged train loop, used only when staging is on and the engine can stage.

`train_stage` keeps the host's loop for every engine that is not really a DistributedRLEngine
(tests use spec'd MagicMocks, which pass isinstance but are not engines). Otherwise each step is
fed to the foundation's StagePipeline from the program's scored queue, in the host's order: one
group at a time, `assembler.pack`, optional reference log-probs per micro-batch, and the step's
last micro-batch applies the optimizer. The step's bookkeeping (callbacks, weight sync, policy
version, commit, RLStepResult) is the host's, plus `stage/*` metrics on the step result.

- `_stage_ahead_while_pending`: trains one step's micro-batches in order, each exactly once, with
  up to TUNIX_MAX_STAGED_BATCHES staged ahead of the pending train call.
- `_prestage_across_boundary`: once a step's optimizer-applying call is sent, starts the next
  step's first micro-batches staging, so their transfer overlaps update and weight sync. Refused
  where it cannot help or would be wrong: after the last step; for a micro-batch that would close
  its own step (the pipeline never prestages one); and with max_staleness=0, where the next step's
  rollouts are not even dispatched before the weight sync (logged once). The host at c7d8950 has
  no checkpoint or eval boundary inside its loop, so there is no such boundary to refuse at.

A prestaged step pulled its first groups from the queue before its on_step_begin callback ran;
its rollout count, rewards and commit list are still its own.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, AsyncIterator

import numpy as np
from tunix.experimental.common import datatypes
from tunix.experimental.orchestrator import batch_assembly
from tunix.experimental.orchestrator import rl_program
from tunix.rl import common as rl_common

from tunix_stage_plugin.activation import manager
from tunix_stage_plugin.activation import registry as registry_lib
from tunix_stage_plugin.core import pipeline as pipeline_lib

log = logging.getLogger("tunix_stage_plugin")
ACTOR = datatypes.Role.ACTOR


@dataclasses.dataclass(kw_only=True)
class StagedRLStepResult(rl_program.RLStepResult):
  """The host's step result plus the step's staging metrics (stage/fallbacks, ...)."""

  stage_metrics: dict[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _StepFeed:
  """One step's micro-batch source and what it pulled (a prestaged step keeps its own feed)."""

  source: AsyncIterator[pipeline_lib.MicroBatch] | None = None
  groups: list[list[Any]] = dataclasses.field(default_factory=list)
  rewards: list[float] = dataclasses.field(default_factory=list)
  num_microbatches: int = 0
  prestage: pipeline_lib.Prestage | None = None


class _EngineStages:
  """The pipeline's engine protocol over DistributedRLEngine; inline calls are the host's calls."""

  def __init__(self, engine: Any) -> None:
    self._engine = engine

  async def stage(self, payload: Any, *, key: str) -> str | None:
    return await self._engine.stage_train_batch(payload, key=key, role=ACTOR)

  async def train(self, payload: Any, *, stage_key: str | None, apply_optimizer: bool) -> Any:
    if stage_key is None:  # byte-for-byte the host's own train_step call
      return await self._engine.train_step(payload, role=ACTOR, accumulate_gradients=True,
                                           apply_optimizer=apply_optimizer)
    return await self._engine.train_step(None, role=ACTOR, accumulate_gradients=True,
                                         apply_optimizer=apply_optimizer, stage_key=stage_key)

  async def reset(self, keys: list[str]) -> None:
    await self._engine.reset_staged_batches(keys, role=ACTOR)


async def _microbatches(program: Any, engine: Any, feed: _StepFeed
                        ) -> AsyncIterator[pipeline_lib.MicroBatch]:
  for group_idx in range(program.mini_batch_size):
    items = await program.scored_q.get_batch(num_groups=1)
    if not items:
      raise RuntimeError(f"the scored queue returned no group ({group_idx} of "
                         f"{program.mini_batch_size} pulled this step): it was aborted or cleared")
    feed.groups.append(items)
    feed.rewards.extend(float(item.traj.reward) for item in items)
    batches = program.assembler.pack([item.payload for item in items])
    feed.num_microbatches += len(batches)
    closing_group = group_idx == program.mini_batch_size - 1
    for i, batch in enumerate(batches):
      # The host treats requires_reference_kl as optional on an algorithm adapter.
      if getattr(program.algo, "requires_reference_kl", False):
        batch = await _with_reference_logps(engine, batch)
      yield pipeline_lib.MicroBatch(batch, closes_step=closing_group and i == len(batches) - 1)


def _new_feed(program: Any, engine: Any) -> _StepFeed:
  feed = _StepFeed()
  feed.source = _microbatches(program, engine, feed)  # the source records into its own feed
  return feed


async def _with_reference_logps(engine: Any, batch: Any) -> Any:
  if not isinstance(batch, rl_common.TrainExample):
    raise TypeError("Reference KL requires an assembler that returns rl_common.TrainExample "
                    f"microbatches; got {type(batch).__name__}.")
  logps = await engine.per_token_logps(datatypes.Role.REFERENCE, items=batch)
  return batch_assembly.with_ref_per_token_logps(batch, logps)


_logged_staleness = False


async def _stage_ahead_while_pending(self: Any, pipeline: pipeline_lib.StagePipeline, step: int,
                                     feed: _StepFeed, on_final_dispatch: Any
                                     ) -> pipeline_lib.StepReport:
  """Trains step `step` from `feed`, keeping micro-batches staged ahead of the pending one."""
  return await pipeline.run_step(step, feed.source, prestaged=feed.prestage,
                                 after_final_dispatch=on_final_dispatch)


def _prestage_across_boundary(self: Any, pipeline: pipeline_lib.StagePipeline, engine: Any,
                              next_step: int, num_steps: int | None) -> _StepFeed | None:
  """Starts step `next_step` staging during this step's boundary; None where refused."""
  global _logged_staleness
  if num_steps is not None and next_step >= num_steps:
    return None
  if self.max_staleness == 0:
    if not _logged_staleness:
      _logged_staleness = True
      log.info("tunix-stage: no cross-step prestage: max_staleness=0 holds the next step's "
               "rollouts until the weight sync ends; it needs max_staleness >= 1 (or None)")
    return None
  feed = _new_feed(self, engine)
  feed.prestage = pipeline.prestage(next_step, feed.source)
  return feed


async def _staged_train_stage(program: Any, engine: Any, num_steps: int | None) -> None:
  pipeline = pipeline_lib.StagePipeline(
      _EngineStages(engine), manager.current_config("tunix").max_staged_batches)
  next_feed: _StepFeed | None = None
  step = 0
  try:
    while num_steps is None or step < num_steps:
      if program.on_step_begin:
        program.on_step_begin(program.step)
      feed, next_feed = next_feed or _new_feed(program, engine), None

      def on_final_dispatch(step: int = step) -> None:
        nonlocal next_feed
        next_feed = program._prestage_across_boundary(pipeline, engine, step + 1, num_steps)  # pylint: disable=protected-access

      report = await program._stage_ahead_while_pending(pipeline, step, feed, on_final_dispatch)  # pylint: disable=protected-access
      # From here on, the host's own step bookkeeping.
      if program.sync_weights:
        new_version = await engine.sync_weights(role=ACTOR)
        program.policy_version = new_version if new_version else program.step + 1
      else:
        program.policy_version = program.step + 1
      program.scored_q.commit(step, groups=feed.groups)
      metrics = report.metrics()
      program.last_step_result = StagedRLStepResult(
          step=step,
          policy_version=program.policy_version,
          num_rollouts=sum(len(g) for g in feed.groups),
          num_microbatches=feed.num_microbatches,
          reward_mean=float(np.mean(feed.rewards)) if feed.rewards else 0.0,
          reward_std=float(np.std(feed.rewards)) if feed.rewards else 0.0,
          train_result=report.result,
          stage_metrics=metrics,
      )
      log.info("tunix-stage: step %d %s", step, metrics)
      if program.on_step_end:
        program.on_step_end(program.step, report.result)
      step += 1
  finally:
    if next_feed is not None and next_feed.prestage is not None:
      await next_feed.prestage.discard()  # training ended or failed with a prestage in flight


def apply(registry: registry_lib.PatchRegistry, program_cls: type, engine_cls: type) -> None:
  original_train_stage = program_cls.__dict__["train_stage"]

  @functools.wraps(original_train_stage)
  async def train_stage(self: Any, engine: Any, num_steps: int | None = None) -> None:
    # The real type: a MagicMock(spec=DistributedRLEngine) passes isinstance, and would answer
    # stage_train_batch with a mock; the host's loop is the right one for it.
    if not issubclass(type(engine), engine_cls):
      return await original_train_stage(self, engine, num_steps)
    return await _staged_train_stage(self, engine, num_steps)

  registry.set(program_cls, "train_stage", train_stage)
  registry.set(program_cls, "_stage_ahead_while_pending", _stage_ahead_while_pending)
  registry.set(program_cls, "_prestage_across_boundary", _prestage_across_boundary)
