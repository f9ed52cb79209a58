"""TrainerWorker: stage_batch (its answer carrying the trainer's newest closed step) /
reset_staged, and fwd_bwd consuming a staged key exactly once.

A staged batch is prepared once, on the staging thread, through the hosted trainer's own
preparation step (hosts/placements.py; PeftTrainer's in peft.py), after a compressed payload is
decoded (compression.py); fwd_bwd and update are observed (observation.py). The calls go one way,
down: into the store, the placement and the observation. docs/tunix.md "What it hooks".
"""

from __future__ import annotations

import functools
from typing import Any

from tunix.experimental.common import datatypes

from tunix_stage_plugin.core import executor as executor_lib
from tunix_stage_plugin.core import keys as keys_lib
from tunix_stage_plugin.core import outcome as outcome_lib
from tunix_stage_plugin.core import patching
from tunix_stage_plugin.core import store as store_lib
from tunix_stage_plugin.core import tracks
from tunix_stage_plugin.hosts import placements
from tunix_stage_plugin.hosts.tunix import contract
from tunix_stage_plugin.hosts.tunix import installation as installation_lib
from tunix_stage_plugin.hosts.tunix import observation
from tunix_stage_plugin.hosts.tunix import peft
from tunix_stage_plugin.hosts.tunix import transforms
from tunix_stage_plugin.hosts.tunix.packed import CompressedPayload


def _codec() -> Any:
  """The codec's decoding (compression.py), loaded once a compressed payload arrives."""
  from tunix_stage_plugin.hosts.tunix import compression  # pylint: disable=import-outside-toplevel
  return compression


def _check(state: installation_lib.WorkerStaging, payload: Any) -> None:
  if isinstance(payload, CompressedPayload):
    payload = _codec().check(payload)  # refused at once when this trainer cannot decode it
  if state.placement.check is not None:
    state.placement.check(payload)


def _place(inst: installation_lib.Installation, state: installation_lib.WorkerStaging,
           payload: Any) -> Any:
  if isinstance(payload, CompressedPayload):  # decoded here, on the staging lane
    payload = _codec().decompress(payload)
  payload = transforms.apply_transforms(payload)
  with inst.recorder.span(tracks.TRAINER_H2D, "staged", lane="staging",
                          bytes=observation.nbytes(payload)):
    return state.placement.place(state.target, payload)


def _chosen(inst: installation_lib.Installation, worker: Any) -> installation_lib.WorkerStaging:
  """`worker`'s staging state, its trainer's placement chosen (on its first stage or call)."""
  state = inst.staging_of(worker)
  if state.placement is None and state.unsupported is None:
    state.placement, state.target, state.unsupported = placements.choose(worker._trainer)  # pylint: disable=protected-access
    if state.target is not None:
      store_lib.track(state.target, state.store)
  return state


def _unplaced_payload(key: str, payload: Any) -> Any:
  """A received batch that was never placed, as the host's inline fwd_bwd takes it."""
  if not isinstance(payload, CompressedPayload):
    return payload
  compression = _codec()
  try:
    return compression.decompress(payload)
  except compression.CodecError as e:  # trains nothing: the orchestrator sends it inline
    raise outcome_lib.StagedPayloadUnreadable(
        f"staged batch {key!r} did not decode ({e}); send it with its train call") from None


def apply(registry: patching.PatchRegistry, inst: installation_lib.Installation,
          worker_cls: type, peft_cls: type) -> None:
  original_fwd_bwd = vars(worker_cls)[contract.FWD_BWD]
  original_update = vars(worker_cls)[contract.UPDATE]

  def stage_batch(self: Any, payload: Any, key: str) -> datatypes.Response:
    """Places `payload` under `key` for a later fwd_bwd(stage_key=key); answers a StageOutcome."""
    state = _chosen(inst, self)
    if state.unsupported is not None:
      result = outcome_lib.unsupported(keys_lib.check(key), state.unsupported)
    else:
      state.sessions.admit(state.store, key)  # a new orchestrator: its predecessors' go
      # Two phases on the server's staging lane: answered once received, placed next there.
      result = state.store.stage(key, payload, functools.partial(_place, inst, state),
                                 check=functools.partial(_check, state),
                                 defer=executor_lib.defer_on_current_lane())
    newest = inst.telemetry.trainer_step()  # what an orchestrator at depth auto reads
    return self._response(**contract.stage_answer(result, newest))  # pylint: disable=protected-access

  def reset_staged(self: Any, keys: list[str] | None = None) -> datatypes.Response:
    """Drops staged batches (all when `keys` is None), freeing their device buffers."""
    dropped = inst.staging_of(self).store.reset(keys)
    return self._response(**contract.reset_answer(dropped))  # pylint: disable=protected-access

  @functools.wraps(original_fwd_bwd)
  def fwd_bwd(self: Any, *args: Any, **kwargs: Any) -> Any:
    if kwargs.get(contract.STAGE_KEY) is None:  # the host's call, observed only
      payload = kwargs.get("payload", args[0] if args else None)
      return observation.observed(inst, _chosen(inst, self), contract.FWD_BWD,
                                  functools.partial(original_fwd_bwd, self, *args, **kwargs),
                                  observation.nbytes(payload))
    key = kwargs.pop(contract.STAGE_KEY)
    payload = kwargs.pop("payload", args[0] if args else None)
    if payload is not None or len(args) > 1:
      raise ValueError(f"fwd_bwd got a payload and stage_key={key!r}; send one or the other")
    # take() removes the batch: a key is consumed exactly once; an unknown key raises.
    state = _chosen(inst, self)
    try:
      staged = state.store.take(key)
    except store_lib.PlacementFailed as e:  # received, never placed: the host's own inline call
      unplaced = _unplaced_payload(key, e.payload)
      inline = functools.partial(original_fwd_bwd, self, unplaced, **kwargs)
      with inst.recorder.span(tracks.TRAINER_FALLBACK, key, reason=e.reason):
        response = observation.observed(inst, state, contract.FWD_BWD, inline,
                                        observation.nbytes(unplaced))
      return contract.mark_placement_fallback(response, e.reason)
    with placements.Consume(staged) as consumed:
      response = observation.observed(inst, state, contract.FWD_BWD,
                                      functools.partial(original_fwd_bwd, self, staged, **kwargs))
    if not consumed.passed:
      raise RuntimeError(f"fwd_bwd(stage_key={key!r}) did not reach the trainer's preparation "
                         "step; the staged batch was prepared for a trainer that prepares there")
    return contract.mark_placement_fallback(response, consumed.fallback)

  peft.PeftPlacement(peft_cls, registry).apply()
  registry.set(worker_cls, contract.STAGE_BATCH, stage_batch)
  registry.set(worker_cls, contract.RESET_STAGED, reset_staged)
  registry.set(worker_cls, contract.FWD_BWD, fwd_bwd)

  @functools.wraps(original_update)
  def update(self: Any, *args: Any, **kwargs: Any) -> Any:
    """The host's update, its computation observed (it ends a step of the telemetry)."""
    return observation.observed(inst, _chosen(inst, self), contract.UPDATE,
                                functools.partial(original_update, self, *args, **kwargs))

  registry.set(worker_cls, contract.UPDATE, update)
