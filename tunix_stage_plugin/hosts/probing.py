"""Capability probes shared by the host adapters: does a host have what the hooks rely on, with
the expected shape? Probing never changes the host (docs/tunix.md)."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable

from tunix_stage_plugin.core import patching


@dataclasses.dataclass(frozen=True)
class Probe:
  """One capability the hooks rely on, checked before anything is patched."""

  name: str
  ok: bool
  detail: str = ""


def parameters(fn: Any) -> dict[str, inspect.Parameter]:
  return dict(inspect.signature(fn).parameters)


def has_var_kwargs(fn: Any) -> bool:
  return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters(fn).values())


def check(name: str, test: Callable[[], str | None]) -> Probe:
  """`test` returns None when the capability is there, else what is wrong."""
  try:
    problem = test()
  except Exception as e:  # pylint: disable=broad-except  (a probe that cannot run has failed)
    problem = f"{type(e).__name__}: {e}"
  return Probe(name, problem is None, problem or "ok")


def method(cls: type, attr: str, *, params: tuple[str, ...], coroutine: bool,
            var_kwargs: bool = False, own: bool = False) -> str | None:
  # getattr_static: no descriptor runs, so probing leaves the class untouched (a plain getattr
  # of e.g. __annotations__ would create and store one on Python 3.12).
  fn = cls.__dict__.get(attr) if own else inspect.getattr_static(cls, attr, None)
  if fn is None:
    return f"{cls.__qualname__}.{attr} is missing"
  if inspect.iscoroutinefunction(fn) != coroutine:
    return f"{cls.__qualname__}.{attr} is {'not ' if coroutine else ''}a coroutine function"
  missing = [p for p in params if p not in parameters(fn)]
  if missing:
    return f"{cls.__qualname__}.{attr}{inspect.signature(fn)} lacks {missing}"
  if var_kwargs and not has_var_kwargs(fn):
    return f"{cls.__qualname__}.{attr}{inspect.signature(fn)} takes no **kwargs"
  return None


def free(cls: type, *attrs: str) -> str | None:
  taken = [a for a in attrs + (patching.SENTINEL,) if hasattr(cls, a)]
  if taken:
    return (f"{cls.__qualname__} already has {taken} (the host's own, or another copy of the "
            "plugin installed)")
  return None


