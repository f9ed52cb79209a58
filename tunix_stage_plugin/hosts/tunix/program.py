"""StandardRLProgram: a staged train loop, used only when staging is on and the engine can stage.

`train_stage` keeps the host's loop for every engine that is not really a DistributedRLEngine
(tests use spec'd MagicMocks, which pass isinstance but are not engines). Otherwise the core step
loop (StagePipeline.run_steps) is fed from the program's scored queue in the host's order (one
group at a time, `assembler.pack`, the group's reference log-probs before any of its micro-batches
trains; the step's last micro-batch applies the optimizer), and the step's bookkeeping (callbacks,
weight sync, policy version, commit, RLStepResult) is the host's, plus `stage/*` metrics.

It reproduces StandardRLProgram.train_stage of tunix c7d8950, the body probes.py pins by its
fingerprint (a tunix whose loop changed is refused unless TUNIX_STAGE_ACCEPT_TRAIN_STAGE accepts
it), with tunix's defaults where it reads one (an item's `traj.reward`, 0.0; its `payload`, None;
the algorithm's `requires_reference_kl`, False). It differs in two ways:
- the point of it: the next step's first groups leave the scored queue during this step's
  boundary (its update and weight sync), before `on_step_end(step)` and `on_step_begin(step + 1)`
  run (not at all with `max_staleness=0`, see `_may_prestage`);
- a step with no optimizer-applying micro-batch raises. tunix's loop ends such a step without an
  update (accumulated gradients carry over) and still syncs, commits and counts it: when the
  scored queue returns no group (cleared, e.g. `prepare_clear()`; tunix's own `run_async` aborts
  it with the exception, which `get_batch` raises), when `mini_batch_size` is 0, or when the last
  group packs into no micro-batch. The core step loop trains every step up to its
  optimizer-applying micro-batch and has no step without one, so the staged loop raises there
  (micro-batches pulled ahead stay untrained, staged ones are released) where tunix's goes on.

The loop asks the program at the upstream change's two seams, methods this module adds to
StandardRLProgram (removed exactly on uninstall) so that a subclass can override them:
`_stage_ahead_while_pending(step, max_staged_batches)`, how many micro-batches to keep staged
while a train call is pending (the pipeline's `depth_for`), and `_prestage_across_boundary(
next_step)`, whether to stage the next step's first micro-batches during the boundary (its
`prestage_next`). Prestage rules and the seams: docs/tunix.md.

Every call that carries a micro-batch (a stage, an inline train call, a fallback, the reference
log-probs request) of at least side.MIN_BYTES goes over the worker's bulk side channel (side.py),
else, over tunix's message cap, through its chunked stream (stream.py); any other call is the
host's own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from typing import Any, AsyncIterator

import numpy as np
from tunix.experimental.common import datatypes
from tunix.experimental.orchestrator import batch_assembly
from tunix.experimental.orchestrator import rl_program
from tunix.rl import common as rl_common

from tunix_stage_plugin.core import codec as codec_lib
from tunix_stage_plugin.core import patching
from tunix_stage_plugin.core import outcome as outcome_lib
from tunix_stage_plugin.core import pipeline as pipeline_lib
from tunix_stage_plugin.hosts import probing
from tunix_stage_plugin.hosts.tunix import chunked
from tunix_stage_plugin.hosts.tunix import compression
from tunix_stage_plugin.hosts.tunix import engine as engine_lib
from tunix_stage_plugin.hosts.tunix import installation as installation_lib
from tunix_stage_plugin.hosts.tunix import probes
from tunix_stage_plugin.hosts.tunix import sessions
from tunix_stage_plugin.hosts.tunix import stream
from tunix_stage_plugin.hosts.tunix import worker

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


class StageEngine:
  """core.pipeline.StageEngine over a DistributedRLEngine; inline calls are the host's calls.

  With a codec (TUNIX_STAGE_CODEC) a stage's payload is compressed on a worker thread, never on
  the event loop; `raw_bytes` / `sent_bytes` count its array bytes before and after. A call over
  tunix's message cap travels on `streams` (the engine's chunked streams, stream.py).
  """

  def __init__(self, engine: Any, streams: stream.Streams,
               codec: codec_lib.Codec | None = None) -> None:
    self._engine = engine
    self.streams = streams
    self.codec = codec
    self.raw_bytes = self.sent_bytes = 0

  async def stage(self, payload: Any, *, key: str) -> outcome_lib.StageOutcome:
    if self.codec is not None:
      payload = await asyncio.to_thread(compression.compress, self.codec, payload)
      self.raw_bytes += payload.nbytes
      self.sent_bytes += payload.wire_bytes
    return await self._engine.stage_train_batch(payload, key=key, role=ACTOR)

  async def train(self, payload: Any, *, stage_key: str | None, apply_optimizer: bool
                  ) -> outcome_lib.Trained:
    if stage_key is None:  # the host's own train_step call, unless over tunix's message cap
      return outcome_lib.Trained(await stream.train_step(
          self._engine, self.streams, payload, role=ACTOR, accumulate_gradients=True,
          apply_optimizer=apply_optimizer))
    try:
      result = await self._engine.train_step(None, role=ACTOR, accumulate_gradients=True,
                                             apply_optimizer=apply_optimizer, stage_key=stage_key)
    except RuntimeError as e:  # the host's remote-error envelope
      if probes.remote_error_type(e) == outcome_lib.StagedPayloadUnreadable.__name__:
        raise outcome_lib.StagedPayloadUnreadable(probes.remote_error_message(e)) from e
      raise
    # train_step answers fwd_bwd's response, or {"fwd_bwd": response, ...} after an update.
    response = result["fwd_bwd"] if apply_optimizer else result
    return outcome_lib.Trained(result, fallback=response.metadata.get(worker.PLACEMENT_FALLBACK))

  async def reset(self, keys: list[str]) -> None:
    # Cleanup, often after a failed call: bounded by a short deadline of its own, never another
    # whole call deadline on a stopped trainer (a failed reset is kept and retried).
    await self._engine.reset_staged_batches(keys, role=ACTOR,
                                            timeout_s=engine_lib.RESET_TIMEOUT_S)


async def _microbatches(program: Any, engine: Any, streams: stream.Streams, feed: _StepFeed
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
      batches = [await _with_reference_logps(engine, streams, batch) for batch in batches]
    feed.num_microbatches += len(batches)
    closing_group = group_idx == program.mini_batch_size - 1
    for i, batch in enumerate(batches):
      yield pipeline_lib.MicroBatch(batch, closes_step=closing_group and i == len(batches) - 1)


def _new_feed(program: Any, engine: Any, streams: stream.Streams) -> _StepFeed:
  feed = _StepFeed()
  feed.source = _microbatches(program, engine, streams, feed)  # it records into its own feed
  return feed


async def _with_reference_logps(engine: Any, streams: stream.Streams, batch: Any) -> Any:
  if not isinstance(batch, rl_common.TrainExample):
    raise TypeError("Reference KL requires an assembler that returns rl_common.TrainExample "
                    f"microbatches; got {type(batch).__name__}.")
  # The host's call, or the chunked stream when the micro-batch is over tunix's message cap.
  logps = await stream.per_token_logps(engine, streams, datatypes.Role.REFERENCE, batch)
  return batch_assembly.with_ref_per_token_logps(batch, logps)


_logged_staleness = False


def _may_prestage(program: Any) -> bool:
  """Cross-step prestage needs the next step's rollouts before the weight sync ends."""
  global _logged_staleness
  if program.max_staleness == 0:
    if not _logged_staleness:
      _logged_staleness = True
      log.info("tunix-stage: no cross-step prestage: max_staleness=0 holds the next step's "
               "rollouts until the weight sync ends; it needs max_staleness >= 1 (or None)")
    return False
  return True


def _codec_note(engine: StageEngine) -> str:
  """The compressed stages so far, for the step's log line ("" without a codec)."""
  if engine.codec is None or not engine.sent_bytes:
    return ""
  mib = 1 << 20
  return (f"; codec {engine.codec}: staged arrays {engine.raw_bytes / mib:.1f} MiB sent as "
          f"{engine.sent_bytes / mib:.1f} MiB (ratio {engine.raw_bytes / engine.sent_bytes:.2f})")


def _stream_note(engine: StageEngine) -> str:
  """The calls sent over the side channel and in chunks so far, for the step's log line ("" when
  none was)."""
  streams, note = engine.streams, ""
  if streams.bulk_calls:
    note += (f"; over the side channel: {streams.bulk_calls} calls, "
             f"{streams.bulk_bytes / chunked.MIB:.1f} MiB")
  if streams.calls:
    note += (f"; over the {stream.message_cap() / chunked.MIB:.0f} MiB message cap: "
             f"{streams.calls} calls, {streams.bytes / chunked.MIB:.1f} MiB sent in "
             f"{chunked.CHUNK_BYTES // chunked.MIB} MiB chunks")
  return note


async def _staged_train_stage(program: Any, engine: Any, num_steps: int | None,
                              config: Any, streams: stream.Streams) -> None:
  stage_engine = StageEngine(engine, streams, codec_lib.parse(config.codec))
  # The program's seams (its subclass's overrides included) decide depth and prestage.
  pipeline = pipeline_lib.StagePipeline(stage_engine, config.max_staged_batches,
                                        key_prefix=sessions.key_prefix(),  # this process's session
                                        depth_for=program._stage_ahead_while_pending)  # pylint: disable=protected-access
  feeds: dict[int, _StepFeed] = {}  # a prestaged step keeps its own feed

  def source_for(step: int) -> AsyncIterator[pipeline_lib.MicroBatch]:
    feeds[step] = _new_feed(program, engine, streams)
    return feeds[step].source

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
    log.info("tunix-stage: step %d %s%s%s", step, metrics, _codec_note(stage_engine),
             _stream_note(stage_engine))
    if program.on_step_end:
      program.on_step_end(program.step, report.result)

  await pipeline.run_steps(source_for, steps=num_steps,
                           prestage_next=program._prestage_across_boundary,  # pylint: disable=protected-access
                           before_step=before_step, after_step=after_step)


def _stage_ahead_while_pending(self: Any, step: int, max_staged_batches: int) -> int:
  """How many of step `step`'s micro-batches to keep staged ahead while a train call is pending.

  Added by tunix-stage-plugin while staging is installed (the upstream change's name). Default:
  `max_staged_batches` (TUNIX_MAX_STAGED_BATCHES / --max_staged_batches). Asked once per step, when
  its staging starts (at the step's start, or at the previous boundary when it is prestaged). 0
  stages none of the step (it trains inline); more than the trainer's device bound is refused
  there and trained inline. Override in a subclass, e.g. a smaller depth while it evaluates.
  """
  del self, step
  return max_staged_batches


def _prestage_across_boundary(self: Any, next_step: int) -> bool:
  """Whether to stage step `next_step`'s first micro-batches while this step's boundary (update,
  weight sync) runs.

  Added by tunix-stage-plugin while staging is installed (the upstream change's name). Default:
  yes, unless `max_staleness=0` (the next step's rollouts then wait for the weight sync). Asked
  once per step boundary that has a next step. Override in a subclass, e.g. to skip the prestage
  at its own checkpoint boundaries.
  """
  del next_step
  return _may_prestage(self)


def apply(registry: patching.PatchRegistry, inst: installation_lib.Installation,
          program_cls: type, engine_cls: type) -> None:
  original_train_stage = program_cls.__dict__["train_stage"]
  found = probing.fingerprint(original_train_stage)
  if found != probes.TRAIN_STAGE_FINGERPRINT:  # passed the probe: the setting accepts it
    log.warning("tunix-stage: the staged loop replaces a StandardRLProgram.train_stage whose body "
                "(fingerprint %s) is not tunix %s's (%s): accepted by %s", found,
                probes.TRAIN_STAGE_COMMIT, probes.TRAIN_STAGE_FINGERPRINT, probes.ACCEPT.env)

  @functools.wraps(original_train_stage)
  async def train_stage(self: Any, engine: Any, num_steps: int | None = None) -> None:
    # The real type: a MagicMock(spec=DistributedRLEngine) passes isinstance, and would answer
    # stage_train_batch with a mock; the host's loop is the right one for it.
    if not issubclass(type(engine), engine_cls):
      return await original_train_stage(self, engine, num_steps)
    streams = stream.streams_of(engine)
    try:
      return await _staged_train_stage(self, engine, num_steps, inst.live.config, streams)
    finally:
      await streams.close()  # the stream channels belong to this loop

  registry.set(program_cls, "train_stage", train_stage)
  registry.set(program_cls, "_stage_ahead_while_pending", _stage_ahead_while_pending)
  registry.set(program_cls, "_prestage_across_boundary", _prestage_across_boundary)
