"""The wire contract between the orchestrator's hooks and the trainer's on tunix's host: the methods
the plugin adds to a TrainerWorker and its server, their keywords, what their answers carry, the
transports' names, and the remote errors both ends answer with.

Each name is written here once and both ends import it; an answer is built and read by one pair of
functions; tunix's error envelope is parsed here into a `RemoteError`, and `typed_error` is the one
map to the plugin's typed errors (no caller reads a type's name). Imports no tunix (the plain suite
reads it). docs/design.md "A micro-batch's way".
"""

from __future__ import annotations

import contextlib
import re
from typing import Any, Iterator

from tunix_stage_plugin.core import keys as keys_lib
from tunix_stage_plugin.core import outcome as outcome_lib

# ---------------------------------------------------------------- TrainerWorker's methods

# (payload, key) -> a StageOutcome with the trainer's newest closed step on it (stage_answer)
STAGE_BATCH = "stage_batch"
RESET_STAGED = "reset_staged"  # (keys=None) -> the dropped keys (reset_answer)
FWD_BWD = "fwd_bwd"  # tunix's; the plugin adds the keyword STAGE_KEY
UPDATE = "update"  # tunix's
PER_TOKEN_LOGPS = "per_token_logps"  # tunix's (the reference worker's)
HEARTBEAT, INFO = "heartbeat", "info"  # tunix's
STAGE_KEY = "stage_key"  # fwd_bwd(stage_key=k): train the batch staged under k

# A TrainerWorker's lane table (core.executor): stage_batch on the staging thread; heartbeat, info
# and reset_staged answered at once (a reset only drops references, and must not
# queue behind a stage waiting for a host buffer: the reset is often what frees it); any other
# method on the compute thread, the computations (OBSERVED) timed by the worker's hooks and every
# other call as the lane's own.
STAGING_METHODS = frozenset({STAGE_BATCH})
LIGHT_METHODS = frozenset({HEARTBEAT, INFO, RESET_STAGED})
OBSERVED = frozenset({FWD_BWD, UPDATE})

# ---------------------------------------------------------------- the trainer server's own methods

# The side channel's two methods, answered by the trainer's server before tunix's dispatch.
SIDE_PORT = "tunix_stage_bulk_port"  # () -> transport.wire.announcement(port, limits)
SIDE_CALL = "tunix_stage_bulk_call"  # (header=bytes) -> the call's response, its bytes beside it
SIDE_METHODS = frozenset({SIDE_PORT, SIDE_CALL})
SIDE_HEADER = "header"  # SIDE_CALL's one keyword

# The chunked stream: a gRPC client-stream method on the trainer's own server port.
STREAM_SERVICE = "tunix_stage.ExecutionStream"
STREAM_METHOD_NAME = "Execute"
STREAM_METHOD = f"/{STREAM_SERVICE}/{STREAM_METHOD_NAME}"
# The trainer's initial metadata once it accepted a stream's header: the client sends the chunks
# only then (a refusal or a missing method is answered before any chunk is sent).
STREAM_READY_KEY, STREAM_READY = "tunix-stage-chunks", "send"

# ---------------------------------------------------------------- how a call travelled

UNARY = "unary"  # tunix's own call, byte for byte
SIDE_CHANNEL = "side"  # its header on tunix's call, its bytes on the bulk channel
STREAM = "stream"  # the chunked stream, for calls over tunix's message cap

# ---------------------------------------------------------------- what the answers carry

_OUTCOME, _STAGED, _DROPPED = "outcome", "staged", "dropped"
# In a staged fwd_bwd's answer: why the staged batch was trained from its payload (None: from its
# placement).
_PLACEMENT_FALLBACK = "placement_fallback"


def stage_answer(outcome: outcome_lib.StageOutcome,
                 newest: outcome_lib.TrainerStep | None) -> dict[str, Any]:
  """stage_batch's answer (the worker's response metadata): the outcome, with the trainer's
  newest closed step on it (None before its first), what a depth at auto sizes from."""
  return {_STAGED: outcome.staged, _OUTCOME: outcome.carrying(newest).as_dict()}


def stage_outcome(response: Any) -> outcome_lib.StageOutcome:
  return outcome_lib.StageOutcome.from_dict(response.metadata[_OUTCOME])


def reset_answer(dropped: list[str]) -> dict[str, Any]:
  return {_DROPPED: dropped}


def dropped_keys(response: Any) -> list[str]:
  return response.metadata[_DROPPED]


def mark_placement_fallback(response: Any, reason: str | None) -> Any:
  """A staged fwd_bwd's response, saying how its batch was trained."""
  response.metadata[_PLACEMENT_FALLBACK] = reason
  return response


def placement_fallback(response: Any) -> str | None:
  return response.metadata.get(_PLACEMENT_FALLBACK)


def train_step_answer(fwd_bwd: Any, step: Any, *, accumulated: bool) -> dict[str, Any]:
  """tunix's train_step answer after an update (DistributedRLEngine.train_step's keys), for a
  fwd_bwd the plugin's transports carried and the update sent after it."""
  return {"fwd_bwd": fwd_bwd, "updated": True, "train_step": step, "accumulated": accumulated}


def trained_step(answer: Any) -> int | None:
  """The trainer's step count in a train_step answer after an update (train_step_answer's, or
  tunix's own: the `train_steps` the worker's update returned, the step its loss is logged at);
  None for an answer without an update."""
  if isinstance(answer, dict) and answer.get("updated"):
    step = answer.get("train_step")
    return step if isinstance(step, int) and not isinstance(step, bool) else None
  return None


def fwd_bwd_response(answer: Any, *, updated: bool) -> Any:
  """fwd_bwd's response in a train_step answer: the answer itself, or its part after an update."""
  return answer["fwd_bwd"] if updated else answer


# ---------------------------------------------------------------- remote errors

_ENVELOPE = re.compile(
    r"RemoteExecutionError \[(?P<type>[A-Za-z_][A-Za-z0-9_.]*)\](: (?P<message>[^\n]*))?")
_MISSING_MODULE = re.compile(r"No module named '(?P<module>[^']+)'")
PACKAGE = __name__.split(".", 1)[0]  # what a trainer without the plugin cannot import
# The methods the plugin adds to the trainer: a trainer without them answers AttributeError
# (tunix's "Method '...' not found").
_ADDED = frozenset({STAGE_BATCH, RESET_STAGED, SIDE_PORT})
# The plugin's errors a trainer raises by their name, as the orchestrator raises them.
_BY_NAME = {t.__name__: t for t in (keys_lib.StageKeyError, outcome_lib.StagedPayloadUnreadable)}


class RemoteError(RuntimeError):
  """An exception raised on the other end: its type's name and its message's first line.

  Its text is tunix's envelope (`RemoteExecutionError [Type]: message`, then the remote
  traceback), so a caller that catches tunix's RuntimeError sees what it saw before."""

  def __init__(self, type_name: str, message: str, text: str | None = None) -> None:
    super().__init__(text if text is not None
                     else f"RemoteExecutionError [{type_name}]: {message}")
    self.type_name = type_name
    self.message = message

  @classmethod
  def of(cls, error: BaseException) -> "RemoteError | None":
    """`error` as a RemoteError: itself, or the envelope tunix's own call raised parsed; None
    for any other exception."""
    if isinstance(error, RemoteError):
      return error
    match = _ENVELOPE.match(str(error)) if isinstance(error, RuntimeError) else None
    if match is None:
      return None
    return cls(match["type"], match["message"] or "", str(error))


class Unsupported(RuntimeError):
  """The trainer can never answer this call: the plugin's method is not there (no plugin there,
  or staging off there), or the call names the plugin's classes, which it cannot import."""


def typed_error(error: BaseException, method: str) -> Exception | None:
  """The plugin's typed error that `error`, raised by a call of `method` to the trainer (tunix's
  envelope, or a RemoteError from the plugin's transports), stands for: a StageKeyError, a
  StagedPayloadUnreadable, an Unsupported; None for any other error (raise it as it is)."""
  remote = RemoteError.of(error)
  if remote is None:
    return None
  typed = _BY_NAME.get(remote.type_name)
  if typed is not None:
    return typed(remote.message)
  if remote.type_name == AttributeError.__name__ and method in _ADDED:
    return Unsupported(
        f"the trainer has no {method} (tunix-stage-plugin not installed there, or "
        "TUNIX_STAGE_BATCH is not 'stage' in the trainer's environment)")
  missing = (_MISSING_MODULE.search(remote.message)
             if remote.type_name == ModuleNotFoundError.__name__ else None)
  if missing is not None and missing["module"].split(".")[0] == PACKAGE:
    # A compressed payload names our classes: a trainer without the plugin cannot unpickle it.
    return Unsupported("tunix-stage-plugin is not installed on the trainer")
  return None


@contextlib.contextmanager
def typed_errors(method: str) -> Iterator[None]:
  """Raises, for an error of the call of `method` in its block, the typed error it stands for
  (typed_error), from it; any other error as it is."""
  try:
    yield
  except RuntimeError as e:
    typed = typed_error(e, method)
    if typed is None:
      raise
    raise typed from e


def unwrap(response: Any) -> Any:
  """A response's result, or its error as a RemoteError (the plugin's transports get tunix's
  ExecutionResponse itself: nothing to parse)."""
  if response.error_message is None:
    return response.result
  text = f"RemoteExecutionError [{response.error_type}]: {response.error_message}"
  if response.traceback:
    text = f"{text}\nRemote traceback:\n{response.traceback}"
  raise RemoteError(str(response.error_type), response.error_message.split("\n", 1)[0], text)
