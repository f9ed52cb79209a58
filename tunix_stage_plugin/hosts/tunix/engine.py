"""DistributedRLEngine: stage_train_batch / reset_staged_batches.

Staging is an optimisation, so the engine answers None whenever a micro-batch was not staged (the
trainer refused, its staging failed, or the worker has no stage_batch at all) and the caller trains
that micro-batch inline. train_step itself is not touched: `train_step(None, stage_key=k, ...)`
already reaches the worker's fwd_bwd through the host's **kwargs, with no payload on the wire.
"""

from __future__ import annotations

import logging
from typing import Any

from tunix.experimental.common import datatypes

from tunix_stage_plugin.activation import registry as registry_lib

log = logging.getLogger("tunix_stage_plugin")


def _trainer(engine: Any, role: datatypes.Role) -> Any:
  worker = engine._trainer_workers.get(role)  # pylint: disable=protected-access
  if worker is None:  # the same contract (and message) as the host's train_step
    raise ValueError(f"No trainer worker registered for role {role}")
  return worker


async def stage_train_batch(self: Any, payload: Any, *, key: str,
                            role: datatypes.Role = datatypes.Role.ACTOR) -> str | None:
  """Sends stage_batch to the trainer; returns `key` when staged, None to train inline."""
  worker = _trainer(self, role)
  try:
    response = await self._invoke_worker(worker, "stage_batch", payload=payload, key=key)  # pylint: disable=protected-access
  except RuntimeError as e:  # the host's remote-error envelope, e.g. no stage_batch on the worker
    log.info("stage_batch(%s) failed on the trainer; training inline: %s", key, e)
    return None
  if response.metadata["staged"]:
    return key
  log.info("stage_batch(%s) not staged; training inline: %s", key, response.metadata["reason"])
  return None


async def reset_staged_batches(self: Any, keys: list[str] | None = None, *,
                               role: datatypes.Role = datatypes.Role.ACTOR) -> list[str]:
  """Drops staged batches on the trainer (all when `keys` is None); returns the dropped keys."""
  response = await self._invoke_worker(_trainer(self, role), "reset_staged", keys=keys)  # pylint: disable=protected-access
  return response.metadata["dropped"]


def apply(registry: registry_lib.PatchRegistry, engine_cls: type) -> None:
  registry.set(engine_cls, "stage_train_batch", stage_train_batch)
  registry.set(engine_cls, "reset_staged_batches", reset_staged_batches)
