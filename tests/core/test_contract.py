"""The wire contract between the tunix hooks' two ends (core/contract.py, no tunix
needed): what an answer carries is built and read in one place, and a remote error is read from
tunix's envelope once, into a type callers match on."""

from __future__ import annotations

import types

import pytest

from tunix_stage_plugin.core import contract


def response(**fields):
  """What tunix's ExecutionResponse holds (its fields, not its class: tunix is absent here)."""
  base = {"result": None, "error_message": None, "error_type": None, "traceback": None,
          "metadata": {}}
  return types.SimpleNamespace(**{**base, **fields})


def test_an_answer_is_read_back_as_it_was_built():
  outcome = contract.refused("ts0badcafe.0-s1-m2", "host bound reached")
  read = contract.stage_outcome(response(metadata=contract.stage_answer(outcome, None)))
  assert read == outcome and read.trainer is None  # before the trainer's first step
  # The trainer's newest closed step rides on the answer, its numbers as they were.
  newest = contract.TrainerStep(
      run="r", step=3, step_s=2.5, compute_s=2.0, mid_step_wait_s=0.25, boundary_wait_s=None,
      other_s=0.0, microbatches=4, fwd_bwd_s=0.5, received=4, received_s=0.4,
      received_bytes=4 << 20, placed=4, placed_s=0.1, placed_bytes=4 << 20, staged=4,
      pool_waits=1, pool_wait_s=0.05, pool_over_bound=0, max_device_batches=1,
      max_host_batches=2, host_sized=True)
  read = contract.stage_outcome(response(metadata=contract.stage_answer(outcome, newest)))
  assert read == outcome and read.trainer == newest and read.trainer.holds == 4
  assert contract.dropped_keys(response(metadata=contract.reset_answer(["a", "b"]))) == ["a", "b"]
  trained = contract.mark_placement_fallback(response(), "its placement failed")
  assert contract.placement_fallback(trained) == "its placement failed"
  assert contract.placement_fallback(response()) is None
  answer = contract.train_step_answer(trained, 3, accumulated=True)
  assert answer == {"fwd_bwd": trained, "updated": True, "train_step": 3, "accumulated": True}
  assert contract.fwd_bwd_response(answer, updated=True) is trained
  assert contract.fwd_bwd_response(trained, updated=False) is trained
  # The trainer's step count an update answered (the orchestrator's scalars sit at it); a
  # fwd_bwd's answer alone (no update) carries none.
  assert contract.trained_step(answer) == 3
  assert contract.trained_step(trained) is None and contract.trained_step(None) is None
  assert contract.trained_step({**answer, "train_step": None}) is None


def test_a_remote_error_keeps_tunixs_envelope_and_is_matched_by_its_type():
  failed = response(error_message="stage key 'k' was already used\nsecond line",
                    error_type="StageKeyError", traceback="Traceback ...")
  with pytest.raises(RuntimeError) as raised:
    contract.unwrap(failed)
  error = raised.value
  assert isinstance(error, contract.RemoteError)
  assert (error.type_name, error.message) == ("StageKeyError", "stage key 'k' was already used")
  assert str(error) == ("RemoteExecutionError [StageKeyError]: stage key 'k' was already used\n"
                        "second line\nRemote traceback:\nTraceback ...")
  # tunix's own call raises the envelope as a plain RuntimeError: read the same way.
  parsed = contract.RemoteError.of(RuntimeError(str(error)))
  assert (parsed.type_name, parsed.message) == (error.type_name, error.message)
  assert contract.RemoteError.of(error) is error
  assert contract.RemoteError.of(RuntimeError("[AttributeError] in a message")) is None
  assert contract.RemoteError.of(ValueError("RemoteExecutionError [X]: y")) is None
  assert contract.unwrap(response(result=3)) == 3


def test_a_missing_module_is_named_only_by_a_module_not_found_error():
  missing = contract.RemoteError("ModuleNotFoundError", "No module named 'tunix_stage_plugin.x'")
  typed = contract.typed_error(missing, contract.FWD_BWD)
  assert isinstance(typed, contract.Unsupported)
  assert str(typed) == "tunix-stage-plugin is not installed on the trainer"
  other = contract.RemoteError("ImportError", "No module named 'tunix_stage_plugin'")
  assert contract.typed_error(other, contract.STAGE_BATCH) is None
  elsewhere = contract.RemoteError("ModuleNotFoundError", "No module named 'numpy'")
  assert contract.typed_error(elsewhere, contract.STAGE_BATCH) is None


def test_one_map_turns_the_trainers_errors_into_the_plugins_types():
  envelope = RuntimeError("RemoteExecutionError [StageKeyError]: stage key 'k' is not staged\n"
                          "Remote traceback:\n...")
  typed = contract.typed_error(envelope, contract.FWD_BWD)
  assert type(typed) is contract.StageKeyError and str(typed) == "stage key 'k' is not staged"
  unreadable = contract.RemoteError("StagedPayloadUnreadable", "zstd: corrupt")
  typed = contract.typed_error(unreadable, contract.FWD_BWD)
  assert type(typed) is contract.StagedPayloadUnreadable and str(typed) == "zstd: corrupt"
  # AttributeError is "no such method" only for a method the plugin adds to the trainer.
  missing = contract.RemoteError("AttributeError", "Method 'stage_batch' not found")
  typed = contract.typed_error(missing, contract.STAGE_BATCH)
  assert isinstance(typed, contract.Unsupported) and "has no stage_batch" in str(typed)
  assert isinstance(contract.typed_error(missing, contract.SIDE_PORT), contract.Unsupported)
  assert contract.typed_error(missing, contract.FWD_BWD) is None  # the trainer's own bug
  assert contract.typed_error(RuntimeError("not an envelope"), contract.STAGE_BATCH) is None
  assert contract.typed_error(ValueError("RemoteExecutionError [StageKeyError]: k"),
                              contract.STAGE_BATCH) is None
  # The context manager raises the typed error from the original; any other error as it is.
  with pytest.raises(contract.StageKeyError) as raised:
    with contract.typed_errors(contract.STAGE_BATCH):
      raise envelope
  assert raised.value.__cause__ is envelope
  plain = RuntimeError("connection reset")
  with pytest.raises(RuntimeError) as raised:
    with contract.typed_errors(contract.STAGE_BATCH):
      raise plain
  assert raised.value is plain
