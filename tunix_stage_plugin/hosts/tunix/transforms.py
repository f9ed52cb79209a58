"""Payload transforms applied by stage_batch before the trainer prepares a payload.

The upstream change used this step to densify a compact MoE routing record before placement. The
default is no transform (identity). Transforms run on the trainer's staging thread, in the order
registered, and only on the staged path: an inline fwd_bwd is the host's own code, untouched.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

PayloadTransform = Callable[[Any], Any]

_lock = threading.Lock()
_transforms: list[PayloadTransform] = []


def register_payload_transform(fn: PayloadTransform) -> PayloadTransform:
  """Adds `fn(payload) -> payload`; usable as a decorator. Registering twice is an error."""
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


def apply_transforms(payload: Any) -> Any:
  for fn in payload_transforms():
    payload = fn(payload)
  return payload
