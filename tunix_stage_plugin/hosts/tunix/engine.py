"""The orchestrator's calls to a trainer, one function per kind (a stage, a train, a reset, the
reference model's log-probs), each over tunix's DistributedRLEngine and the engine's router: the
staged loop (program.py) uses them with its run's router, and the hooks added to the engine
(stage_train_batch, reset_staged_batches; per_token_logps routed) are the same functions.

Every call that may carry a micro-batch goes through `route.Router.call` once; a train is tunix's
own `train_step`, byte for byte; a trainer's error becomes the plugin's typed error through the
one map (contract.typed_errors); a stage answers a typed StageOutcome (core.outcome).
docs/tunix.md "What it hooks".
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from tunix.experimental.common import datatypes

from tunix_stage_plugin.core import outcome as outcome_lib
from tunix_stage_plugin.core import patching
from tunix_stage_plugin.hosts.tunix import contract
from tunix_stage_plugin.hosts.tunix import installation as installation_lib
from tunix_stage_plugin.hosts.tunix import route
from tunix_stage_plugin.hosts.tunix import stream

ACTOR = datatypes.Role.ACTOR
# The staged loop's reset deadline: a trainer answers a reset at once, off its lanes, so a reset
# that waited tunix's whole call deadline on a stopped trainer would only delay the job's failure
# (~20 s on tunix's 60 s default). A failed reset is kept and retried before the next step.
RESET_TIMEOUT_S = 3.0


def _trainer(engine: Any, role: datatypes.Role) -> Any:
  worker = engine._trainer_workers.get(role)  # pylint: disable=protected-access
  if worker is None:  # the same contract (and message) as tunix's train_step
    raise ValueError(f"No trainer worker registered for role {role}")
  return worker


async def stage(engine: Any, router: route.Router, payload: Any, *, key: str,
                role: datatypes.Role = ACTOR) -> outcome_lib.StageOutcome:
  """`stage_batch(payload, key)` on the trainer of `role`: its StageOutcome (the trainer's newest
  closed step on it); a trainer that can never stage it answers UNSUPPORTED, a failure FAILED; a
  malformed or reused key raises StageKeyError (the caller's bug, not a fallback)."""
  worker = _trainer(engine, role)
  try:
    with contract.typed_errors(contract.STAGE_BATCH):
      response = await route.invoke(engine, router, worker, contract.STAGE_BATCH,
                                    payload=payload, key=key)
  except (stream.PayloadOverCap, contract.Unsupported) as e:  # e.g. no chunked stream there
    return outcome_lib.unsupported(key, str(e))
  except RuntimeError as e:  # the trainer's error, or a failure on this side
    return outcome_lib.failed(key, f"stage_batch failed on the trainer: {str(e)[:500]}")
  return contract.stage_outcome(response)


async def train(engine: Any, router: route.Router, payload: Any, *, stage_key: str | None,
                apply_optimizer: bool, role: datatypes.Role = ACTOR,
                accumulate_gradients: bool = True) -> outcome_lib.Trained:
  """tunix's `engine.train_step(payload, ...)` (`train_step(None, stage_key=k, ...)` for a
  staged batch), byte for byte, unless its fwd_bwd takes the side channel or the stream: then
  that fwd_bwd goes there with the same keywords, and `update` and the answer are tunix's
  train_step's (distributed_rl_engine.DistributedRLEngine.train_step). Trained.result is that
  answer; Trained.fallback, for a staged batch, why the trainer trained it from its payload."""
  worker = _trainer(engine, role)
  keyed = {} if stage_key is None else {contract.STAGE_KEY: stage_key}
  with contract.typed_errors(contract.FWD_BWD):
    transport, answer = await router.call(
        worker, contract.FWD_BWD, {"payload": payload, "skip_jit": False, **keyed},
        lambda: engine.train_step(payload, role=role, accumulate_gradients=accumulate_gradients,
                                  apply_optimizer=apply_optimizer, **keyed),
        carries_batch=stage_key is None)
  if transport != contract.UNARY and apply_optimizer:  # the rest of tunix's train_step, as it is
    step = await engine._invoke_worker(worker, contract.UPDATE)  # pylint: disable=protected-access
    answer = contract.train_step_answer(answer, step, accumulated=accumulate_gradients)
  fallback = (None if stage_key is None else contract.placement_fallback(
      contract.fwd_bwd_response(answer, updated=apply_optimizer)))
  return outcome_lib.Trained(answer, fallback=fallback)


async def reset(engine: Any, keys: list[str] | None = None, *, role: datatypes.Role = ACTOR,
                timeout_s: float | None = None) -> list[str]:
  """Drops staged batches on the trainer (all when `keys` is None); returns the dropped keys.

  `timeout_s` bounds the call (TimeoutError after it); None leaves the handle's own deadline.
  """
  call = engine._invoke_worker(_trainer(engine, role), contract.RESET_STAGED, keys=keys)  # pylint: disable=protected-access
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
    tunix's message cap: then it goes that way, to the worker tunix's call would reach (an
    inference worker of `role`, else the trainer)."""
    if kwargs:  # what the plugin's transports do not carry: tunix's own call
      return await original_logps(self, role, items, **kwargs)
    # pylint: disable-next=protected-access
    worker = self._inference_workers.get(role) or self._trainer_workers.get(role)
    _, result = await route.router_of(inst, self).call(
        worker, contract.PER_TOKEN_LOGPS, {"items": items},
        lambda: original_logps(self, role, items=items))
    return result

  async def stage_train_batch(self: Any, payload: Any, *, key: str, role: datatypes.Role = ACTOR
                              ) -> outcome_lib.StageOutcome:
    """Sends stage_batch to the trainer (over the side channel or the chunked stream when it is
    large); the outcome says whether to train by key or inline."""
    return await stage(self, route.router_of(inst, self), payload, key=key, role=role)

  registry.set(engine_cls, "stage_train_batch", stage_train_batch)
  registry.set(engine_cls, "reset_staged_batches", reset)  # a method as it is
  registry.set(engine_cls, "per_token_logps", per_token_logps)
