"""The contract between an orchestrator and a trainer, built and parsed here only: the stage keys,
the outcomes, the methods the plugin adds and their lanes, what answers carry, the remote errors.

A key is `<prefix>-s<step>-m<index>`; the prefix is `st<8 hex>` per run, or `ts<session>.<n>`
where a trainer tells orchestrators apart (docs/tunix.md "One orchestrator per trainer"). The
pipeline acts on an outcome's status, never on a reason's text. A remote error is tunix's
envelope, parsed once (`RemoteError`); `typed_error` is the one map to the plugin's errors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import itertools
import re
import secrets
from typing import Any, Iterator, NamedTuple

# ---------------------------------------------------------------- stage keys

CHARS = "A-Za-z0-9._:-"
MAX_LEN = 128
RULE = f"a str of 1-{MAX_LEN} characters from [{CHARS}]"
# The longest prefix a pipeline may use: room for "-s<step>-m<index>" within MAX_LEN.
MAX_PREFIX_LEN = MAX_LEN - 32

_KEY = re.compile(f"[{CHARS}]+")
_PIPELINE_KEY = re.compile(r"(?P<prefix>.+)-s(?P<step>[0-9]+)-m(?P<index>[0-9]+)")
_SESSION_PREFIX = re.compile(r"ts(?P<session>[0-9a-f]{8})\.[0-9]+")


class StageKeyError(KeyError):
  """A staging key is malformed, already in use, or not staged."""

  def __str__(self) -> str:  # KeyError repr()s its argument; we want the sentence.
    return str(self.args[0])


class PipelineKey(NamedTuple):
  prefix: str
  step: int
  index: int


def check_key(key: Any) -> str:
  """`key`, or StageKeyError naming the rule."""
  if not isinstance(key, str):
    raise StageKeyError(f"stage key must be {RULE}; got {type(key).__name__} {key!r}")
  if not 1 <= len(key) <= MAX_LEN:
    raise StageKeyError(f"stage key must be {RULE}; got one of length {len(key)}")
  if not _KEY.fullmatch(key):
    raise StageKeyError(f"stage key must be {RULE}; got {key!r}")
  return key


def check_prefix(prefix: Any) -> str:
  """A pipeline's key prefix, or ValueError (too long, not a str) / StageKeyError (a character
  outside the charset), each naming the rule."""
  if not isinstance(prefix, str) or len(prefix) > MAX_PREFIX_LEN:
    raise ValueError(f"key_prefix must be a str of at most {MAX_PREFIX_LEN} characters from "
                     f"[{CHARS}]; got {prefix!r}")
  check_key(build_key(prefix, 0, 0))
  return prefix


def build_key(prefix: str, step: int, index: int) -> str:
  """The key of micro-batch `index` of step `step` in the run whose keys start with `prefix`."""
  return f"{prefix}-s{step}-m{index}"


def parse_key(key: Any) -> PipelineKey | None:
  """A pipeline's key as (prefix, step, index); None for any other key."""
  match = _PIPELINE_KEY.fullmatch(key) if isinstance(key, str) else None
  if match is None:
    return None
  return PipelineKey(match["prefix"], int(match["step"]), int(match["index"]))


def run_prefix() -> str:
  """A fresh prefix for a run that names no session: keys unique across orchestrator restarts
  on one trainer."""
  return f"st{secrets.token_hex(4)}"


def new_session() -> str:
  """A fresh orchestrator session, as a prefix carries it (8 hex digits)."""
  return secrets.token_hex(4)


def session_prefix(session: str, loop: int) -> str:
  """The prefix of loop `loop` of the orchestrator process whose session is `session`."""
  return f"ts{session}.{loop}"


# This orchestrator process's session, and its loops so far. Per process, not per installation:
# a loop's prefix must never come back while a trainer remembers its keys (an uninstall and
# install in one process keep counting).
SESSION = new_session()
_loops = itertools.count()


def next_loop_prefix() -> str:
  """The key prefix of this process's next staged loop (its session, then the loop's number)."""
  return session_prefix(SESSION, next(_loops))


def session_of(key: Any) -> str | None:
  """The session a pipeline key's prefix carries (None for a key that carries none)."""
  parsed = parse_key(key)
  match = None if parsed is None else _SESSION_PREFIX.fullmatch(parsed.prefix)
  return match["session"] if match else None


# ---------------------------------------------------------------- outcomes


class StageStatus(enum.Enum):
  STAGED = "staged"  # placed under its key; train it by key
  REFUSED = "refused"  # nothing is held on the trainer (bound, reset, not stageable): train inline
  FAILED = "failed"  # the trainer may hold something (an error mid-stage, a lost reply): reset, inline
  UNSUPPORTED = "unsupported"  # this trainer can never stage: train inline and stop offering
  # A train call's, never a stage's: staged, but the trainer could not place it and trained it
  # inline from its payload (Trained.fallback).
  UNPLACED = "unplaced"


@dataclasses.dataclass(frozen=True)
class StageOutcome:
  key: str
  status: StageStatus
  reason: str | None = None  # why not staged, for logs and reports
  # The trainer's newest closed step, where the trainer sends it (auto sizes from it).
  trainer: "TrainerStep | None" = dataclasses.field(default=None, compare=False)

  @property
  def staged(self) -> bool:
    return self.status is StageStatus.STAGED

  def carrying(self, trainer: "TrainerStep | None") -> "StageOutcome":
    """This outcome with the trainer's newest closed step on it (a stage answer's)."""
    return dataclasses.replace(self, trainer=trainer)

  def as_dict(self) -> dict[str, Any]:
    """The form that travels in a reply (plain types only)."""
    return {"key": self.key, "status": self.status.value, "reason": self.reason,
            "trainer": None if self.trainer is None else self.trainer.as_dict()}

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "StageOutcome":
    trainer = d.get("trainer")  # absent from a trainer that sends none
    return cls(d["key"], StageStatus(d["status"]), d["reason"],
               None if trainer is None else TrainerStep.from_dict(trainer))


def staged(key: str) -> StageOutcome:
  return StageOutcome(key, StageStatus.STAGED)


def refused(key: str, reason: str) -> StageOutcome:
  return StageOutcome(key, StageStatus.REFUSED, reason)


def failed(key: str, reason: str) -> StageOutcome:
  return StageOutcome(key, StageStatus.FAILED, reason)


def unsupported(key: str, reason: str) -> StageOutcome:
  return StageOutcome(key, StageStatus.UNSUPPORTED, reason)


@dataclasses.dataclass(frozen=True)
class Trained:
  """What an engine's train call returns: the host's result and, for a micro-batch sent by key
  whose placement failed on the trainer, why it was trained inline from the held payload."""

  result: Any
  fallback: str | None = None


class StagedPayloadUnreadable(RuntimeError):
  """Raised by an engine's train(stage_key=...) when the trainer could not decode the staged
  payload (compressed bytes damaged, or no codec there) and trained nothing: the pipeline trains
  that micro-batch inline instead and counts a fallback. Trainers raise it by this name."""


@dataclasses.dataclass(frozen=True)
class TrainerStep:
  """A trainer's newest closed step in numbers, riding on each stage_batch answer: what a depth
  sized each step (auto, core/sizing.py) reads of the trainer, and a host bound sized each step
  reads of its own steps. Seconds are the step's sums over its micro-batches, but `fwd_bwd_s`
  (a micro-batch's compute, the step's median). `of` makes it from the figures a trainer's step
  aggregator made (core/telemetry/recorder.py; their shape: core/telemetry/figures.py)."""

  run: str  # the trainer's run: a step is read once
  step: int
  step_s: float | None  # None: the trainer's first step (it compiles, no step before it)
  compute_s: float
  mid_step_wait_s: float  # the device idle mid-step, waiting for its input
  boundary_wait_s: float | None  # ... at the step boundary (None: a first step)
  other_s: float  # the compute lane's own calls
  microbatches: int  # fwd_bwd computations
  fwd_bwd_s: float | None
  received: int  # micro-batches received by side channel or stream (0: by tunix's own call)
  received_s: float
  received_bytes: int
  placed: int
  placed_s: float
  placed_bytes: int
  staged: int  # placements on the staging lane
  pool_waits: int  # transfers that waited for a receive buffer
  pool_wait_s: float
  pool_over_bound: int  # waits that ran out
  max_device_batches: int  # the bounds in force on the trainer
  max_host_batches: int
  host_sized: bool  # it sizes its host bound itself (it may then hold one more)

  @classmethod
  def of(cls, figures: dict[str, Any], *, run: str, max_device_batches: int,
         max_host_batches: int, host_sized: bool) -> "TrainerStep":
    """From a step's figures as the trainer's step aggregator made them, and the bounds in
    force; KeyError where the figures lack one (a broken contract)."""
    wait, receive, place, pool = (figures["input_wait_s"], figures["receive"], figures["place"],
                                  figures["pool"])
    return cls(run=run, step=figures["step"], step_s=figures["step_s"],
               compute_s=figures["compute_s"], mid_step_wait_s=wait["mid_step"],
               boundary_wait_s=wait["boundary"], other_s=figures["other_s"],
               microbatches=figures["microbatches"], fwd_bwd_s=figures["compute"]["fwd_bwd_median_s"], received=receive["calls"],
               received_s=receive["seconds"], received_bytes=receive["bytes"],
               placed=place["count"], placed_s=place["seconds"], placed_bytes=place["bytes"],
               staged=place["staged"], pool_waits=pool["waits"], pool_wait_s=pool["wait_s"],
               pool_over_bound=pool["over_bound"], max_device_batches=max_device_batches,
               max_host_batches=max_host_batches, host_sized=host_sized)

  @property
  def holds(self) -> int:
    """The most micro-batches the trainer can hold staged: its device and host bounds, one more
    where it sizes its host bound itself."""
    return self.max_device_batches + self.max_host_batches + (1 if self.host_sized else 0)

  def as_dict(self) -> dict[str, Any]:
    """The form that travels in a reply (plain types only)."""
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "TrainerStep":
    return cls(**d)


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


def stage_answer(outcome: StageOutcome,
                 newest: TrainerStep | None) -> dict[str, Any]:
  """stage_batch's answer (the worker's response metadata): the outcome, with the trainer's
  newest closed step on it (None before its first), what a depth at auto sizes from."""
  return {_STAGED: outcome.staged, _OUTCOME: outcome.carrying(newest).as_dict()}


def stage_outcome(response: Any) -> StageOutcome:
  return StageOutcome.from_dict(response.metadata[_OUTCOME])


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
_BY_NAME = {t.__name__: t for t in (StageKeyError, StagedPayloadUnreadable)}


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
