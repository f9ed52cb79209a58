"""Exact-reversal patch registry: what an installation set on host classes, and what was there.

`undo` puts each owner's `__dict__` back exactly (an inherited attribute we shadowed is deleted
again, an own one restored to the very same object) and runs the installation's cleanups (close
executors, drop staged batches) first. A sentinel attribute on each touched class lets a second
copy of the plugin see that the class is taken. An owner is a class, or a module (a driver's
parse function: activation/drivers.py).
"""

from __future__ import annotations

import dataclasses
import sys
import types
from typing import Any, Callable

SENTINEL = "__tunix_stage_patched__"


class _Absent:
  """Marks 'the owner had no attribute of its own under this name'."""

  def __repr__(self) -> str:
    return "<absent>"


ABSENT = _Absent()


Owner = type | types.ModuleType


@dataclasses.dataclass(frozen=True)
class Patch:
  owner: Owner
  attr: str
  original: Any  # the owner's own __dict__ value before we set ours, or ABSENT
  value: Any  # what we set

  @property
  def name(self) -> str:
    if isinstance(self.owner, types.ModuleType):
      return f"{self.owner.__name__}.{self.attr}"
    return f"{self.owner.__module__}.{self.owner.__qualname__}.{self.attr}"


class PatchRegistry:
  """Applies patches in order and undoes them in reverse order, exactly."""

  def __init__(self) -> None:
    self._patches: list[Patch] = []
    self._cleanups: list[Callable[[], None]] = []

  def __len__(self) -> int:
    return len(self._patches)

  def names(self) -> list[str]:
    return [p.name for p in self._patches if p.attr != SENTINEL]

  def set(self, owner: Owner, attr: str, value: Any) -> None:
    if any(p.owner is owner and p.attr == attr for p in self._patches):
      raise RuntimeError(f"{Patch(owner, attr, None, None).name} is already patched by this "
                         "registry")
    if SENTINEL not in owner.__dict__:
      self._set(owner, SENTINEL, True)
    self._set(owner, attr, value)

  def _set(self, owner: Owner, attr: str, value: Any) -> None:
    original = owner.__dict__.get(attr, ABSENT)
    setattr(owner, attr, value)
    self._patches.append(Patch(owner, attr, original, value))

  def on_undo(self, cleanup: Callable[[], None]) -> None:
    """Runs `cleanup` first thing in `undo` (last registered, first run)."""
    self._cleanups.append(cleanup)

  def undo(self) -> list[str]:
    """Runs the cleanups, then restores every patched class; returns one line per problem."""
    problems = []
    while self._cleanups:
      cleanup = self._cleanups.pop()
      try:
        cleanup()
      except Exception as e:  # pylint: disable=broad-except  (the classes must still be restored)
        problems.append(f"cleanup {getattr(cleanup, '__qualname__', cleanup)!s} failed: "
                        f"{type(e).__name__}: {e}")
    while self._patches:
      p = self._patches.pop()
      current = p.owner.__dict__.get(p.attr, ABSENT)
      if current is not p.value:
        # Someone replaced our hook after install; putting the original back would silently
        # drop their change, so leave theirs in place and say so.
        problems.append(f"{p.name} was replaced after install; left as found")
        continue
      if p.original is ABSENT:
        delattr(p.owner, p.attr)
      else:
        setattr(p.owner, p.attr, p.original)
    return problems


def report_problems(problems: list[str]) -> None:
  for line in problems:
    print(f"tunix-stage: uninstall: {line}", file=sys.stderr)
