"""DistributedRLEngine: stage_train_batch / reset_staged_batches.

RESET_TIMEOUT_S bounds the staged loop's resets (cleanup, often after a failed call): a trainer
answers a reset at once, off its lanes, so a reset that waited tunix's whole call deadline on a
stopped trainer would only delay the job's failure (~20 s on tunix's 60 s default).

stage_train_batch answers a typed StageOutcome (core.outcome): the trainer's own answer, or
UNSUPPORTED when the trainer has no stage_batch at all (no plugin there, or staging off), so the
pipeline asks once instead of sending every payload twice. A malformed or reused key raises.
A stage over tunix's message cap goes through the trainer's chunked stream (stream.py); one the
trainer cannot take that way (no stream there) is UNSUPPORTED too.
per_token_logps (a micro-batch to the reference worker) goes the same way when it is large; small
ones are tunix's own call. train_step itself is not touched: `train_step(None, stage_key=k, ...)` already reaches the
worker's fwd_bwd through the host's **kwargs, with no payload on the wire.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from tunix.experimental.common import datatypes

from tunix_stage_plugin.core import patching
from tunix_stage_plugin.core import outcome as outcome_lib
from tunix_stage_plugin.core import store as store_lib
from tunix_stage_plugin.hosts.tunix import installation as installation_lib
from tunix_stage_plugin.hosts.tunix import probes
from tunix_stage_plugin.hosts.tunix import stream

# The staged loop's reset deadline: a failed reset is kept and retried before the next step.
RESET_TIMEOUT_S = 3.0


def _trainer(engine: Any, role: datatypes.Role) -> Any:
  worker = engine._trainer_workers.get(role)  # pylint: disable=protected-access
  if worker is None:  # the same contract (and message) as the host's train_step
    raise ValueError(f"No trainer worker registered for role {role}")
  return worker


async def _stage(engine: Any, streams: stream.Streams, payload: Any, key: str,
                 role: datatypes.Role) -> outcome_lib.StageOutcome:
  worker = _trainer(engine, role)
  try:
    response = await stream.invoke(engine, streams, worker, "stage_batch", payload=payload,
                                   key=key)
  except stream.PayloadOverCap as e:  # no chunked stream on that trainer: it cannot stage this
    return outcome_lib.unsupported(key, str(e))
  except RuntimeError as e:  # the host's remote-error envelope
    remote = probes.remote_error_type(e)
    if remote == store_lib.StageKeyError.__name__:
      raise store_lib.StageKeyError(probes.remote_error_message(e)) from e
    if remote == "AttributeError":  # the host's "Method 'stage_batch' not found" answer
      return outcome_lib.unsupported(
          key, "the trainer has no stage_batch (tunix-stage-plugin not installed there, or "
          "TUNIX_STAGE_BATCH is not 'stage' in the trainer's environment)")
    if remote == "ModuleNotFoundError" and "tunix_stage_plugin" in str(e):
      # A compressed payload names our classes: a trainer without the plugin cannot unpickle it.
      return outcome_lib.unsupported(key, "tunix-stage-plugin is not installed on the trainer")
    return outcome_lib.failed(key, f"stage_batch failed on the trainer: {str(e)[:500]}")
  return outcome_lib.StageOutcome.from_dict(response.metadata["outcome"])


async def reset_staged_batches(self: Any, keys: list[str] | None = None, *,
                               role: datatypes.Role = datatypes.Role.ACTOR,
                               timeout_s: float | None = None) -> list[str]:
  """Drops staged batches on the trainer (all when `keys` is None); returns the dropped keys.

  `timeout_s` bounds the call (TimeoutError after it); None leaves the handle's own deadline.
  """
  call = self._invoke_worker(_trainer(self, role), "reset_staged", keys=keys)  # pylint: disable=protected-access
  if timeout_s is None:
    response = await call
  else:
    try:
      response = await asyncio.wait_for(call, timeout_s)
    except asyncio.TimeoutError:
      raise TimeoutError(f"reset_staged got no answer within {timeout_s:g} s") from None
  return response.metadata["dropped"]


def apply(registry: patching.PatchRegistry, inst: installation_lib.Installation,
          engine_cls: type) -> None:
  original_logps = engine_cls.__dict__["per_token_logps"]

  @functools.wraps(original_logps)
  async def per_token_logps(self: Any, role: datatypes.Role, items: Any, **kwargs: Any) -> Any:
    """tunix's call, unless it carries a micro-batch large enough for the side channel or over
    tunix's message cap (then it goes that way, to the worker tunix's call would reach)."""
    if kwargs:  # what the plugin's paths do not carry: tunix's own call
      return await original_logps(self, role, items, **kwargs)
    return await stream.per_token_logps(self, stream.streams_of(self), role, items,
                                        functools.partial(original_logps, self))

  async def stage_train_batch(self: Any, payload: Any, *, key: str,
                              role: datatypes.Role = datatypes.Role.ACTOR
                              ) -> outcome_lib.StageOutcome:
    """Sends stage_batch to the trainer (through its chunked stream when over tunix's message
    cap); the outcome says whether to train by key or inline."""
    return await _stage(self, stream.streams_of(self), payload, key, role)

  registry.set(engine_cls, "stage_train_batch", stage_train_batch)
  registry.set(engine_cls, "reset_staged_batches", reset_staged_batches)
  registry.set(engine_cls, "per_token_logps", per_token_logps)
