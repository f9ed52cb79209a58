"""How each kind of trainer is staged: the registry of placements, the seam a staged batch is handed
through, and the payload transforms users register.

A placement prepares a payload through the trainer's own preparation step, on the placer thread.
When the batch trains, the same step (its seam) hands the placed batch through instead of
preparing again: a staged micro-batch is prepared once, as inline. The seam knows a batch by the
object itself (`handing`, `timing`). The registry is the process's: two adapters' hooks meet here.
docs/design.md "A micro-batch's way"; docs/maxtext.md.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator

from tunix_stage_plugin.core import patching

if TYPE_CHECKING:  # the contract each kind of trainer implements
  from tunix_stage_plugin.hosts.interface import Placement


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
  """(placement, target, None) for the first placement that takes `trainer` (or the trainer a
  mesh-binding proxy such as tunix's _MeshBoundTrainer forwards to), else (None, None, why it
  cannot stage)."""
  for placement in registered():
    owner = getattr(getattr(trainer, placement.seam, None), "__self__", None)
    target, reason = (None, None) if owner is None else placement.find(owner)
    if target is not None:
      return placement, target, None
    if reason is not None:
      return None, None, reason
  kinds = ", ".join(p.name for p in registered()) or "none installed"
  return None, None, (f"the hosted trainer is a {type(trainer).__qualname__}; staging supports "
                      f"{kinds} (or a proxy forwarding to one)")


# ---------------------------------------------------------------- the seam


class Handed:
  """What a seam did with the staged batch it was to hand through: `passed` whether it did,
  `fallback` why it prepared the payload instead (None: it handed the placed batch)."""

  def __init__(self, placement: Placement, staged: Any) -> None:
    self.placement = placement
    self.staged = staged
    self.passed = False
    self.fallback: str | None = None


class Prepared:
  """When a trainer's own preparation ran inside one call (`span`: perf_counter start and end;
  None: the call prepared nothing)."""

  span: tuple[float, float] | None = None


_seams_lock = threading.Lock()
_handing: dict[int, Handed] = {}  # by id(staged): a placed batch a seam hands through once
_timing: dict[int, Prepared] = {}  # by id(payload): an inline payload whose preparation is timed


@contextlib.contextmanager
def _held(table: dict[int, Any], obj: Any, value: Any) -> Iterator[Any]:
  """`value` in `table` under `obj`'s identity for the block's length."""
  with _seams_lock:
    table[id(obj)] = value
  try:
    yield value
  finally:
    with _seams_lock:
      table.pop(id(obj), None)


def handing(placement: Placement, staged: Any) -> ContextManager[Handed]:
  """Around the host's fwd_bwd(staged): the seam that meets `staged` hands it through once."""
  return _held(_handing, staged, Handed(placement, staged))


def timing(payload: Any) -> ContextManager[Prepared]:
  """Around a host call that may prepare `payload` inline: when a seam prepared it."""
  return _held(_timing, payload, Prepared())


def set_seam(registry: patching.PatchRegistry, cls: type, name: str) -> None:
  """`cls`'s own `name` method becomes a seam, undone on uninstall."""
  registry.set(cls, name, _seam(vars(cls)[name]))


def _seam(original: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
  """A trainer's preparation method, wrapped: a staged batch being handed through is resolved
  (once); any other payload is the host's own, timed where a call asked."""

  @functools.wraps(original)
  def wrapper(self: Any, payload: Any) -> Any:
    with _seams_lock:
      handed = _handing.get(id(payload))
      if handed is not None and handed.staged is payload and not handed.passed:
        handed.passed = True
      else:
        handed = None
      prepared = _timing.get(id(payload))
    if handed is None:
      if prepared is None or prepared.span is not None:
        return original(self, payload)
      start = time.perf_counter()
      try:
        return original(self, payload)
      finally:
        prepared.span = (start, time.perf_counter())
    batch, handed.fallback = handed.placement.resolve(self, payload)
    return batch

  return wrapper


# ---------------------------------------------------------------- payload transforms

PayloadTransform = Callable[[Any], Any]
_transforms: list[PayloadTransform] = []


def register_payload_transform(fn: PayloadTransform) -> PayloadTransform:
  """Adds `fn(payload) -> payload`, run on the placer thread before a staged payload is placed,
  in the order registered (an inline fwd_bwd is the host's own code, untouched); usable as a
  decorator. The upstream change densified a compact MoE routing record here. Registering twice
  is an error."""
  if not callable(fn):
    raise TypeError(f"a payload transform must be callable; got {type(fn).__name__}")
  with _lock:
    if fn in _transforms:
      raise ValueError(f"payload transform {fn!r} is already registered")
    _transforms.append(fn)
  return fn


def unregister_payload_transform(fn: PayloadTransform) -> None:
  with _lock:
    _transforms.remove(fn)


def payload_transforms() -> tuple[PayloadTransform, ...]:
  with _lock:
    return tuple(_transforms)
