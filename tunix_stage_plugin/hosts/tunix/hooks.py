"""Every hook tunix's classes get while staging is installed, each thin.

A hook hands its call to its role's side (installation.py), made on that role's first call, so
every process gets every hook and loads only the role it plays. Which hooks and why: docs/tunix.md
"What it hooks".

Traps: grpc takes handlers only before start, so the stream's method is added when tunix assigns
`_server` inside `start_serving_async` (a property for that one moment). `stop_serving` stops the
side channel, then tunix's server, then drops the worker's staged batches and joins its lanes. An
engine whose type is not DistributedRLEngine (tunix's tests use spec'd MagicMocks) keeps tunix's
loop.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
from typing import Any

from tunix.experimental.common import datatypes

from tunix_stage_plugin.core import patching
from tunix_stage_plugin.hosts import probing
from tunix_stage_plugin.core import contract
from tunix_stage_plugin.hosts.tunix import installation as installation_lib
from tunix_stage_plugin.hosts.tunix import probes

log = logging.getLogger("tunix_stage_plugin")
ACTOR = datatypes.Role.ACTOR


def apply(registry: patching.PatchRegistry, inst: installation_lib.Installation) -> None:
  m = inst.modules
  _server_hooks(registry, inst, m.remote_execution.RemoteExecutionServer,
                m.remote_execution.GrpcRemoteExecutionServer)
  _worker_hooks(registry, inst, m.trainer_worker.TrainerWorker)
  _engine_hooks(registry, inst, m.engine.DistributedRLEngine)
  _program_hooks(registry, inst, m.program.StandardRLProgram, m.engine.DistributedRLEngine)


# ---------------------------------------------------------------- the trainer's


def _trainer(inst: installation_lib.Installation) -> Any:
  return inst.trainer or inst.trainer_side()


# The server whose start_serving_async is running in this context (its grpc server gets the
# stream's handler when tunix assigns it).
_starting: contextvars.ContextVar[Any] = contextvars.ContextVar("tunix_stage_starting_server",
                                                                default=None)


def _server_hooks(registry: patching.PatchRegistry, inst: installation_lib.Installation,
                  server_cls: type, grpc_server_cls: type) -> None:
  """Every received call enters the trainer's side; the side channel and the chunked stream start
  and stop with tunix's server."""
  inst.host_execute = server_cls.__dict__["execute_request"]  # for calls off the lanes
  original_start = grpc_server_cls.__dict__["start_serving_async"]
  original_stop = grpc_server_cls.__dict__["stop_serving"]

  @functools.wraps(inst.host_execute)
  async def execute_request(self: Any, request: Any) -> Any:
    return await _trainer(inst).execute(self, request)

  def get_server(self: Any) -> Any:
    return self.__dict__.get("_server")

  def set_server(self: Any, value: Any) -> None:
    self.__dict__["_server"] = value
    if value is not None and _starting.get() is self:  # tunix made it and has not started it yet
      value.add_generic_rpc_handlers((_trainer(inst).stream_handler(self),))

  @functools.wraps(original_start)
  async def start_serving_async(self: Any, *args: Any, **kwargs: Any) -> Any:
    token = _starting.set(self)
    try:
      result = await original_start(self, *args, **kwargs)
    finally:
      _starting.reset(token)
    side = _trainer(inst)
    if self in side.streaming_servers and inst.serve_side_channel:
      side.listen(self)  # started with tunix's server; stop_serving closes it
    return result

  @functools.wraps(original_stop)
  async def stop_serving(self: Any, *args: Any, **kwargs: Any) -> Any:
    side = _trainer(inst)
    # No new bytes (its threads joined off the loop); calls already received run on their lanes.
    await asyncio.to_thread(side.stop_listening, self)
    result = await original_stop(self, *args, **kwargs)
    await side.stopped(self)
    return result

  registry.set(server_cls, "execute_request", execute_request)
  registry.set(grpc_server_cls, "_server", property(get_server, set_server))
  registry.set(grpc_server_cls, "start_serving_async", start_serving_async)
  registry.set(grpc_server_cls, "stop_serving", stop_serving)


def _worker_hooks(registry: patching.PatchRegistry, inst: installation_lib.Installation,
                  worker_cls: type) -> None:
  """TrainerWorker: stage_batch (its answer carrying the trainer's newest closed step) /
  reset_staged, and fwd_bwd consuming a staged key exactly once; fwd_bwd and update observed."""
  original_fwd_bwd = vars(worker_cls)[contract.FWD_BWD]
  original_update = vars(worker_cls)[contract.UPDATE]

  def stage_batch(self: Any, payload: Any, key: str) -> Any:
    """Stages `payload` under `key` for a later fwd_bwd(stage_key=key); answers a StageOutcome."""
    outcome = _trainer(inst).stage(self, payload, key)
    newest = inst.telemetry.newest_trainer_step  # what an orchestrator at depth auto reads
    return self._response(**contract.stage_answer(outcome, newest))  # pylint: disable=protected-access

  def reset_staged(self: Any, keys: list[str] | None = None) -> Any:
    """Drops staged batches (all when `keys` is None), freeing their device buffers."""
    dropped = _trainer(inst).reset(self, keys)
    return self._response(**contract.reset_answer(dropped))  # pylint: disable=protected-access

  @functools.wraps(original_fwd_bwd)
  def fwd_bwd(self: Any, *args: Any, **kwargs: Any) -> Any:
    return _trainer(inst).fwd_bwd(self, original_fwd_bwd, args, kwargs)

  @functools.wraps(original_update)
  def update(self: Any, *args: Any, **kwargs: Any) -> Any:
    """The host's update, its computation observed (it ends a step of the telemetry)."""
    return _trainer(inst).update(self, original_update, args, kwargs)

  registry.set(worker_cls, contract.STAGE_BATCH, stage_batch)
  registry.set(worker_cls, contract.RESET_STAGED, reset_staged)
  registry.set(worker_cls, contract.FWD_BWD, fwd_bwd)
  registry.set(worker_cls, contract.UPDATE, update)


# ---------------------------------------------------------------- the orchestrator's


def _orchestrator(inst: installation_lib.Installation) -> Any:
  return inst.orchestrator or inst.orchestrator_side()


def _engine_hooks(registry: patching.PatchRegistry, inst: installation_lib.Installation,
                  engine_cls: type) -> None:
  """DistributedRLEngine: stage_train_batch / reset_staged_batches, and per_token_logps routed
  (a large one over the side channel or the stream)."""
  original_logps = engine_cls.__dict__["per_token_logps"]

  async def stage_train_batch(self: Any, payload: Any, *, key: str,
                              role: Any = ACTOR) -> Any:
    """Sends stage_batch to the trainer (over the side channel or the chunked stream when it is
    large); the outcome says whether to train by key or inline."""
    return await _orchestrator(inst).stage(self, payload, key=key, role=role)

  async def reset_staged_batches(self: Any, keys: list[str] | None = None, *,
                                 role: Any = ACTOR,
                                 timeout_s: float | None = None) -> list[str]:
    """Drops staged batches on the trainer (all when `keys` is None); returns the dropped keys.
    `timeout_s` bounds the call (TimeoutError after it); None leaves the handle's own deadline."""
    return await _orchestrator(inst).reset(self, keys, role=role, timeout_s=timeout_s)

  @functools.wraps(original_logps)
  async def per_token_logps(self: Any, role: Any, items: Any, **kwargs: Any) -> Any:
    if kwargs:  # what the plugin's transports do not carry: tunix's own call
      return await original_logps(self, role, items, **kwargs)
    return await _orchestrator(inst).per_token_logps(self, role, items, original_logps)

  registry.set(engine_cls, "stage_train_batch", stage_train_batch)
  registry.set(engine_cls, "reset_staged_batches", reset_staged_batches)
  registry.set(engine_cls, "per_token_logps", per_token_logps)


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


def _program_hooks(registry: patching.PatchRegistry, inst: installation_lib.Installation,
                   program_cls: type, engine_cls: type) -> None:
  """StandardRLProgram: its train loop staged (by the way this tunix has, probes.loop_way), and
  the upstream change's two seams as real methods a subclass can override."""

  def _prestage_across_boundary(self: Any, next_step: int) -> bool:
    """Whether to stage step `next_step`'s first micro-batches while this step's boundary
    (update, weight sync) runs.

    Added by tunix-stage-plugin while staging is installed (the upstream change's name). Default:
    yes, unless `max_staleness=0` (the next step's rollouts then wait for the weight sync). Asked
    once per step boundary that has a next step. Override in a subclass, e.g. to skip the
    prestage at its own checkpoint boundaries.
    """
    del next_step
    if self.max_staleness == 0:
      if inst.first_time("no-prestage-at-max-staleness-0"):
        log.info("tunix-stage: no cross-step prestage: max_staleness=0 holds the next step's "
                 "rollouts until the weight sync ends; it needs max_staleness >= 1 (or None)")
      return False
    return True

  if probes.loop_way(program_cls) == probes.SEAM:  # only the way this tunix has is loaded
    # pylint: disable-next=import-outside-toplevel
    from tunix_stage_plugin.hosts.tunix import loop_seam
    loop_seam.apply(registry, inst, program_cls, engine_cls)
  else:
    _copy_way(registry, inst, program_cls, engine_cls)
  registry.set(program_cls, "_stage_ahead_while_pending", _stage_ahead_while_pending)
  registry.set(program_cls, "_prestage_across_boundary", _prestage_across_boundary)


def _copy_way(registry: patching.PatchRegistry, inst: installation_lib.Installation,
              program_cls: type, engine_cls: type) -> None:
  """tunix c7d8950, which has no seam: the plugin's copy of its train_stage (loop_copy.py)."""
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
    # pylint: disable-next=import-outside-toplevel  (the loop loads where a program trains staged)
    from tunix_stage_plugin.hosts.tunix import loop_copy, run as run_lib
    run = run_lib.Run(inst, self, engine, num_steps, open_ended=False)
    try:
      return await loop_copy.train_stage(run)
    finally:
      await run.close()

  registry.set(program_cls, "train_stage", train_stage)
