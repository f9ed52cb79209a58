"""How each kind of trainer is staged behind tunix's TrainerWorker: one Placement per kind.

A Placement prepares and places a payload on the staging thread through the trainer's own
preparation step, and at consume time that same step (its "seam") hands the staged batch through
instead of preparing again, so a staged micro-batch is prepared exactly once, as inline. tunix's
PeftTrainer has one (hosts/tunix/worker.py), MaxText's engine another (hosts/maxtext/). Adapters
register theirs here; the worker hook asks each in order. The registry is the process's, not one
installation's: tunix's worker and MaxText's engine are two adapters' hooks that meet here.
docs/maxtext.md.
"""

from __future__ import annotations

import functools
import threading
import time
import weakref
from typing import Any, Callable, Protocol

from tunix_stage_plugin.core import tracks


class Placement(Protocol):
  name: str
  # Raises for a payload this kind of trainer can never stage (refused before any wait); None
  # where no payload can be told unstageable before its preparation runs (a failure there is a
  # failed stage, trained inline).
  check: Callable[[Any], None] | None

  def find(self, trainer: Any) -> tuple[Any, str | None]:
    """(target, None): stage through `target`; (None, reason): this kind, but it can never
    stage; (None, None): not this kind of trainer."""

  def place(self, target: Any, payload: Any) -> Any:
    """On the staging thread: prepare and place `payload`; blocks until the copy is done."""

  def computation(self, target: Any, kind: str) -> Any:
    """Right after `target`'s fwd_bwd or update (`kind`) returned, on the same thread: an output
    of the computation it queued, ready once that computation ended (the telemetry's watcher
    waits for it, off the compute lane); None where there is none to watch."""

  def tracer(self, target: Any) -> Any:
    """`target`'s tunix PerfTracer, where it has one (hosts/tunix/tracing.py); else None."""


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


# Which stores hold batches staged through which target, so a host event that makes them wrong
# (MaxText's restore_checkpoint or close) can drop them.
_holders: "weakref.WeakKeyDictionary[Any, weakref.WeakSet]" = weakref.WeakKeyDictionary()


def track(target: Any, store: Any) -> None:
  """`store` holds batches staged through `target`."""
  with _lock:
    _holders.setdefault(target, weakref.WeakSet()).add(store)


def discard(target: Any) -> list[str]:
  """Drops every batch staged through `target` (their device buffers go); returns their keys."""
  with _lock:
    stores = list(_holders.get(target, ()))
  return [key for store in stores for key in store.reset()]


class _Consuming(threading.local):
  """The staged batch a fwd_bwd on this thread is consuming, and what its seam did with it."""

  active = False
  staged: Any = None
  passed = False
  fallback: str | None = None


_consuming = _Consuming()


class Consume:
  """`with Consume(staged) as c:` around the host's fwd_bwd(staged): the seam on this thread
  hands `staged` through once; afterwards `c.passed` says whether it did and `c.fallback` why
  the seam trained it from its payload instead (None: it used the staged placement)."""

  def __init__(self, staged: Any) -> None:
    self.staged = staged
    self.passed = False
    self.fallback: str | None = None

  def __enter__(self) -> "Consume":
    _consuming.active, _consuming.staged = True, self.staged
    _consuming.passed, _consuming.fallback = False, None
    return self

  def __exit__(self, *exc: Any) -> None:
    self.passed, self.fallback = _consuming.passed, _consuming.fallback
    _consuming.active, _consuming.staged, _consuming.fallback = False, None, None


def seam(original: Callable[[Any, Any], Any], resolve: Callable[[Any, Any], Any],
         name: str) -> Callable[[Any, Any], Any]:
  """Wraps a trainer's preparation method: the host's own unless a Consume on this thread is
  handing a staged batch through, then `resolve(trainer, staged)` (once)."""

  @functools.wraps(original)
  def wrapper(self: Any, payload: Any) -> Any:
    if not _consuming.active:
      if _inline.recorder is None:
        return original(self, payload)
      with _inline.recorder.span(tracks.TRAINER_H2D, "inline", lane="inline",
                                 bytes=_inline.nbytes):
        prepared = original(self, payload)
      _inline.ended = time.perf_counter()
      return prepared
    _consuming.active = False
    if payload is not _consuming.staged:
      raise RuntimeError(f"the staged batch was replaced on its way from fwd_bwd to {name}; "
                         "staging cannot keep its one-preparation promise with this trainer")
    _consuming.passed = True
    return resolve(self, payload)

  return wrapper


class _Inline(threading.local):
  """The telemetry of a fwd_bwd on this thread that prepares its payload inline."""

  recorder: Any = None  # core.telemetry's Spans while such a call runs
  nbytes: int | None = None
  ended: float | None = None  # when its preparation ended (perf_counter)


_inline = _Inline()


class Inline:
  """`with Inline(recorder, nbytes) as i:` around a trainer call that may prepare its payload
  inline: the seam on this thread records that preparation (tracks.TRAINER_H2D, lane inline),
  and `i.ended` says when it ended (None: the call prepared nothing)."""

  def __init__(self, recorder: Any, nbytes: int | None) -> None:
    self.recorder = recorder
    self.nbytes = nbytes
    self.ended: float | None = None

  def __enter__(self) -> "Inline":
    _inline.recorder, _inline.nbytes, _inline.ended = self.recorder, self.nbytes, None
    return self

  def __exit__(self, *exc: Any) -> None:
    self.ended = _inline.ended
    _inline.recorder = _inline.nbytes = _inline.ended = None


def note_fallback(reason: str) -> None:
  """Called by a `resolve` that trains the staged micro-batch from its payload instead."""
  _consuming.fallback = reason
