"""How each kind of trainer is staged behind tunix's TrainerWorker: the registry of Placements (one
per kind) and the seam they stage through.

A Placement prepares and places a payload on the staging thread through the trainer's own
preparation step, and at consume time that step (its "seam") hands the staged batch through, so a
staged micro-batch is prepared exactly once, as inline (tunix's PeftTrainer: hosts/tunix/peft.py;
MaxText's engine: hosts/maxtext/). The registry is the process's, not one installation's: two
adapters' hooks meet here. docs/maxtext.md.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Any, Callable, Protocol

from tunix_stage_plugin.core import patching


class Placement(Protocol):
  name: str
  host: str  # the host the telemetry names for this kind's computations
  # Raises for a payload this kind of trainer can never stage (refused before any wait); None
  # where no payload can be told unstageable before its preparation runs (a failure there is a
  # failed stage, trained inline).
  check: Callable[[Any], None] | None

  def find(self, trainer: Any) -> tuple[Any, str | None]:
    """(target, None): stage through `target`; (None, reason): this kind, but it can never
    stage; (None, None): not this kind of trainer."""

  def place(self, target: Any, payload: Any) -> Any:
    """On the staging thread: prepare and place `payload`; blocks until the copy is done."""

  def resolve(self, target: Any, staged: Any) -> Any:
    """In the seam, consuming `staged` (what `place` returned): what the preparation returns."""

  def computation(self, target: Any, kind: str) -> Any:
    """Right after `target`'s fwd_bwd or update (`kind`, contract.FWD_BWD or UPDATE) returned, on
    the same thread: an output of the computation it queued, ready once that computation ended
    (the telemetry's watcher waits for it, off the compute lane); None where there is none."""

  def tracer(self, target: Any) -> Any:
    """`target`'s tunix PerfTracer, where it has one (hosts/tunix/tracing.py); else None."""

  def metrics_logger(self, target: Any) -> Any:
    """What `target` logs its metrics with, where it has one (a tunix MetricsLogger:
    hosts/tunix/metrics.py; MaxText's engine's: hosts/maxtext/metrics.py); else None."""

  def step_sink(self, target: Any, logger: Any) -> Any:
    """The step sink (core.telemetry.process.StepSink) that logs each trainer step's scalars
    through `logger` (what metrics_logger answered) at the step `target` logs its loss at."""


_lock = threading.Lock()
_placements: list[Placement] = []


def register(placement: Placement) -> Callable[[], None]:
  """Adds `placement` (first registered, first asked); returns the call that removes it."""
  with _lock:
    _placements.append(placement)
  return lambda: unregister(placement)


def unregister(placement: Placement) -> None:
  with _lock:
    if placement in _placements:
      _placements.remove(placement)


def registered() -> tuple[Placement, ...]:
  with _lock:
    return tuple(_placements)


def choose(trainer: Any) -> tuple[Placement | None, Any, str | None]:
  """(placement, target, None) for the first placement that takes `trainer`, else
  (None, None, why it cannot stage)."""
  for placement in registered():
    target, reason = placement.find(trainer)
    if target is not None:
      return placement, target, None
    if reason is not None:
      return None, None, reason
  kinds = ", ".join(p.name for p in registered()) or "none installed"
  return None, None, (f"the hosted trainer is a {type(trainer).__qualname__}; staging supports "
                      f"{kinds} (or a proxy forwarding to one)")


def owner(trainer: Any, seam_name: str, cls: type) -> Any:
  """The `cls` instance that owns the `seam_name` method `trainer`'s calls reach: the trainer
  itself, or the one a mesh-binding proxy (tunix's _MeshBoundTrainer) forwards to; else None."""
  found = getattr(getattr(trainer, seam_name, None), "__self__", None)
  return found if isinstance(found, cls) else None


def set_seam(registry: patching.PatchRegistry, placement: Placement, cls: type, seam_name: str,
             said: str) -> None:
  """`cls`'s own `seam_name` becomes a seam resolving through `placement`, undone on uninstall
  (`said`: the method as a refusal names it)."""
  registry.set(cls, seam_name, seam(vars(cls)[seam_name], placement.resolve, said))


class _Seam(threading.local):
  """What the seam on this thread is doing: handing a staged batch through (a Consume is active)
  or, while a Prepared is active, timing the host's own preparation."""

  consuming = False
  staged: Any = None
  passed = False
  fallback: str | None = None
  timing = False
  prepared: tuple[float, float] | None = None


_seam = _Seam()


class Consume:
  """`with Consume(staged) as c:` around the host's fwd_bwd(staged): the seam on this thread
  hands `staged` through once; afterwards `c.passed` says whether it did and `c.fallback` why
  the seam trained it from its payload instead (None: it used the staged placement)."""

  def __init__(self, staged: Any) -> None:
    self.staged = staged
    self.passed = False
    self.fallback: str | None = None

  def __enter__(self) -> "Consume":
    _seam.consuming, _seam.staged = True, self.staged
    _seam.passed, _seam.fallback = False, None
    return self

  def __exit__(self, *exc: Any) -> None:
    self.passed, self.fallback = _seam.passed, _seam.fallback
    _seam.consuming, _seam.staged, _seam.fallback = False, None, None


class Prepared:
  """`with Prepared() as p:` around a trainer call that may prepare its payload inline (the
  host's own preparation, through the seam on this thread): afterwards `p.span` says when that
  preparation ran, (start, end) in perf_counter (None: the call prepared nothing)."""

  def __init__(self) -> None:
    self.span: tuple[float, float] | None = None

  def __enter__(self) -> "Prepared":
    _seam.timing, _seam.prepared = True, None
    return self

  def __exit__(self, *exc: Any) -> None:
    self.span = _seam.prepared
    _seam.timing, _seam.prepared = False, None


def note_fallback(reason: str) -> None:
  """Called by a `resolve` that trains the staged micro-batch from its payload instead."""
  _seam.fallback = reason


def seam(original: Callable[[Any, Any], Any], resolve: Callable[[Any, Any], Any],
         name: str) -> Callable[[Any, Any], Any]:
  """Wraps a trainer's preparation method: the host's own unless a Consume on this thread is
  handing a staged batch through, then `resolve(trainer, staged)` (once)."""

  @functools.wraps(original)
  def wrapper(self: Any, payload: Any) -> Any:
    if not _seam.consuming:
      if not _seam.timing:
        return original(self, payload)
      start = time.perf_counter()
      try:
        return original(self, payload)
      finally:
        _seam.prepared = (start, time.perf_counter())
    _seam.consuming = False
    if payload is not _seam.staged:
      raise RuntimeError(f"the staged batch was replaced on its way from fwd_bwd to {name}; "
                         "staging cannot keep its one-preparation promise with this trainer")
    _seam.passed = True
    return resolve(self, payload)

  return wrapper
