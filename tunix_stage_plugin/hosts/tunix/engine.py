"""tunix's DistributedRLEngine, the orchestrator's handle on its workers: stage_train_batch and
reset_staged_batches added, per_token_logps routed.

stage_train_batch answers a typed StageOutcome (core.outcome): the trainer's own answer, or
UNSUPPORTED when the trainer can never stage (no stage_batch there: no plugin, or staging off;
a stage over tunix's message cap that the trainer cannot take in chunks), so the pipeline asks
once instead of sending every payload twice; a malformed or reused key raises here too. Its
call, and per_token_logps's, take the transport route.py picks. train_step itself is not
touched: `train_step(None, stage_key=k, ...)` already reaches the worker's fwd_bwd through
tunix's **kwargs, with no payload on the wire. docs/tunix.md "What it hooks".
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from tunix.experimental.common import datatypes

from tunix_stage_plugin.core import outcome as outcome_lib
from tunix_stage_plugin.core import patching
from tunix_stage_plugin.core import store as store_lib
from tunix_stage_plugin.hosts.tunix import contract
from tunix_stage_plugin.hosts.tunix import installation as installation_lib
from tunix_stage_plugin.hosts.tunix import route
from tunix_stage_plugin.hosts.tunix import stream

# The staged loop's reset deadline: a trainer answers a reset at once, off its lanes, so a reset
# that waited tunix's whole call deadline on a stopped trainer would only delay the job's failure
# (~20 s on tunix's 60 s default). A failed reset is kept and retried before the next step.
RESET_TIMEOUT_S = 3.0
PACKAGE = __name__.split(".", 1)[0]  # what a trainer without the plugin cannot import


def _trainer(engine: Any, role: datatypes.Role) -> Any:
  worker = engine._trainer_workers.get(role)  # pylint: disable=protected-access
  if worker is None:  # the same contract (and message) as tunix's train_step
    raise ValueError(f"No trainer worker registered for role {role}")
  return worker


async def _stage(engine: Any, router: route.Router, payload: Any, key: str,
                 role: datatypes.Role) -> outcome_lib.StageOutcome:
  worker = _trainer(engine, role)
  try:
    response = await route.invoke(engine, router, worker, contract.STAGE_BATCH, payload=payload,
                                  key=key)
  except stream.PayloadOverCap as e:  # no chunked stream on that trainer: it cannot stage this
    return outcome_lib.unsupported(key, str(e))
  except RuntimeError as e:  # tunix's remote-error envelope, or a failure on this side
    remote = contract.RemoteError.of(e)
    if remote is None:
      return outcome_lib.failed(key, f"stage_batch failed on the trainer: {str(e)[:500]}")
    if remote.type_name == store_lib.StageKeyError.__name__:
      raise store_lib.StageKeyError(remote.message) from e
    if remote.type_name == AttributeError.__name__:  # tunix's "Method 'stage_batch' not found"
      return outcome_lib.unsupported(
          key, "the trainer has no stage_batch (tunix-stage-plugin not installed there, or "
          "TUNIX_STAGE_BATCH is not 'stage' in the trainer's environment)")
    if (remote.missing_module or "").split(".")[0] == PACKAGE:
      # A compressed payload names our classes: a trainer without the plugin cannot unpickle it.
      return outcome_lib.unsupported(key, "tunix-stage-plugin is not installed on the trainer")
    return outcome_lib.failed(key, f"stage_batch failed on the trainer: {str(e)[:500]}")
  return contract.stage_outcome(response)


async def reset_staged_batches(self: Any, keys: list[str] | None = None, *,
                               role: datatypes.Role = datatypes.Role.ACTOR,
                               timeout_s: float | None = None) -> list[str]:
  """Drops staged batches on the trainer (all when `keys` is None); returns the dropped keys.

  `timeout_s` bounds the call (TimeoutError after it); None leaves the handle's own deadline.
  """
  call = self._invoke_worker(_trainer(self, role), contract.RESET_STAGED, keys=keys)  # pylint: disable=protected-access
  if timeout_s is None:
    response = await call
  else:
    try:
      response = await asyncio.wait_for(call, timeout_s)
    except asyncio.TimeoutError:
      raise TimeoutError(f"reset_staged got no answer within {timeout_s:g} s") from None
  return contract.dropped_keys(response)


def apply(registry: patching.PatchRegistry, inst: installation_lib.Installation,
          engine_cls: type) -> None:
  original_logps = engine_cls.__dict__["per_token_logps"]

  @functools.wraps(original_logps)
  async def per_token_logps(self: Any, role: datatypes.Role, items: Any, **kwargs: Any) -> Any:
    """tunix's call, unless it carries a micro-batch large enough for the side channel or over
    tunix's message cap (then it goes that way, to the worker tunix's call would reach)."""
    if kwargs:  # what the plugin's transports do not carry: tunix's own call
      return await original_logps(self, role, items, **kwargs)
    return await route.per_token_logps(self, route.router_of(inst, self), role, items,
                                       functools.partial(original_logps, self))

  async def stage_train_batch(self: Any, payload: Any, *, key: str,
                              role: datatypes.Role = datatypes.Role.ACTOR
                              ) -> outcome_lib.StageOutcome:
    """Sends stage_batch to the trainer (over the side channel or the chunked stream when it is
    large); the outcome says whether to train by key or inline."""
    return await _stage(self, route.router_of(inst, self), payload, key, role)

  registry.set(engine_cls, "stage_train_batch", stage_train_batch)
  registry.set(engine_cls, "reset_staged_batches", reset_staged_batches)
  registry.set(engine_cls, "per_token_logps", per_token_logps)
