"""The COPY way of the staged loop, for tunix c7d8950, which has no seam: the plugin's copy of its
StandardRLProgram.train_stage, which replaces it (hooks.py).

It reproduces tunix's loop and bookkeeping (probes.py pins the body by its fingerprint, with
tunix's defaults where it reads one) and differs from it in two ways only: the next step's first
groups leave the scored queue during this step's boundary, before `on_step_end(step)` and
`on_step_begin(step + 1)` run (not at all with `max_staleness=0`); and a step with no
optimizer-applying micro-batch (the scored queue cleared, `mini_batch_size` 0, a last group that
packs into nothing) raises where tunix's loop ends the step without an update (micro-batches
pulled ahead stay untrained, staged ones are released). Loaded where a program first trains
staged: a process that never orchestrates (a trainer) never loads the loop. docs/tunix.md "The
train loop, two ways".
"""

from __future__ import annotations

import dataclasses
from typing import Any, AsyncIterator

import numpy as np
from tunix.experimental.common import datatypes
from tunix.experimental.orchestrator import rl_program

from tunix_stage_plugin.core import pipeline as pipeline_lib
from tunix_stage_plugin.hosts.tunix import run as run_lib

ACTOR = datatypes.Role.ACTOR


@dataclasses.dataclass
class _StepFeed:
  """One step's micro-batch source and what it pulled (a prestaged step keeps its own feed)."""

  source: AsyncIterator[pipeline_lib.MicroBatch] | None = None
  groups: list[list[Any]] = dataclasses.field(default_factory=list)
  rewards: list[float] = dataclasses.field(default_factory=list)
  num_microbatches: int = 0


async def _microbatches(program: Any, engine: Any, feed: _StepFeed
                        ) -> AsyncIterator[pipeline_lib.MicroBatch]:
  for group_idx in range(program.mini_batch_size):
    items = await program.scored_q.get_batch(num_groups=1)
    if not items:
      raise RuntimeError(
          f"the scored queue returned no group ({group_idx} of {program.mini_batch_size} pulled "
          "this step: it was cleared); tunix's loop would end the step without an update, the "
          "staged loop cannot (docs/tunix.md)")
    feed.groups.append(items)
    # tunix's loop reads these three with defaults (a dict traj has no .reward; an item or an
    # algorithm may lack the attribute): the same defaults here.
    feed.rewards.extend(float(getattr(item.traj, "reward", 0.0)) for item in items)
    batches = program.assembler.pack([getattr(item, "payload", None) for item in items])
    if getattr(program.algo, "requires_reference_kl", False):
      # The whole group's, before any of it trains (tunix's order: a micro-batch that cannot take
      # them stops the group before any of its micro-batches is trained).
      batches = [await _with_reference_logps(engine, batch) for batch in batches]
    feed.num_microbatches += len(batches)
    closing_group = group_idx == program.mini_batch_size - 1
    for i, batch in enumerate(batches):
      yield pipeline_lib.MicroBatch(batch, closes_step=closing_group and i == len(batches) - 1)


async def _with_reference_logps(engine: Any, batch: Any) -> Any:
  # pylint: disable=import-outside-toplevel  (tunix's modules the copy of its loop reads)
  from tunix.experimental.orchestrator import batch_assembly
  from tunix.rl import common as rl_common
  if not isinstance(batch, rl_common.TrainExample):
    raise TypeError("Reference KL requires an assembler that returns rl_common.TrainExample "
                    f"microbatches; got {type(batch).__name__}.")
  # The engine's hook sends it over the side channel or the stream when the call is large.
  logps = await engine.per_token_logps(datatypes.Role.REFERENCE, items=batch)
  return batch_assembly.with_ref_per_token_logps(batch, logps)


async def train_stage(run: run_lib.Run) -> None:
  """c7d8950's train_stage over `run`'s pipeline: the same steps and bookkeeping, staged."""
  program, engine = run.program, run.engine
  feeds: dict[int, _StepFeed] = {}  # a prestaged step keeps its own feed

  def source_for(step: int) -> AsyncIterator[pipeline_lib.MicroBatch]:
    feed = feeds[step] = _StepFeed()
    feed.source = _microbatches(program, engine, feed)  # it records into its own feed
    return feed.source

  def before_step(step: int) -> None:
    if program.on_step_begin:
      program.on_step_begin(program.step)

  async def after_step(step: int, report: pipeline_lib.StepReport) -> None:
    # From here on, the host's own step bookkeeping.
    feed = feeds.pop(step)
    if program.sync_weights:
      new_version = await engine.sync_weights(role=ACTOR)
      program.policy_version = new_version if new_version else program.step + 1
    else:
      program.policy_version = program.step + 1
    program.scored_q.commit(step, groups=feed.groups)
    program.last_step_result = run.step_result(rl_program.RLStepResult(
        step=step,
        policy_version=program.policy_version,
        num_rollouts=sum(len(g) for g in feed.groups),
        num_microbatches=feed.num_microbatches,
        reward_mean=float(np.mean(feed.rewards)) if feed.rewards else 0.0,
        reward_std=float(np.std(feed.rewards)) if feed.rewards else 0.0,
        train_result=report.result,
    ), report)
    if program.on_step_end:
      program.on_step_end(program.step, report.result)

  await run.pipeline.run_steps(source_for, steps=run.num_steps,
                               prestage_next=program._prestage_across_boundary,  # pylint: disable=protected-access
                               before_step=before_step, after_step=after_step)
