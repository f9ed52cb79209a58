"""Integers given as text: the one parser behind every staging setting and the lab's counts.

It accepts plain ASCII decimal digits only (int() alone would take "+2", " 2", "2_0" and "٢") and
bounds the value, so a typo such as 99999999999999999999999 is refused with the accepted range
rather than taken as a depth (docs/configuration.md).
"""

from __future__ import annotations

_MAX_DIGITS = 20  # longer digit strings are refused before int() turns them into a value


def integer(text: str, *, minimum: int = 1, maximum: int) -> int:
  """Plain ASCII decimal digits with a value in minimum..maximum; ValueError says what is accepted."""
  value = text.strip()
  accepted = f"accepted: an integer from {minimum} to {maximum}"
  if not (value.isascii() and value.isdigit()):
    raise ValueError(accepted)
  if len(value.lstrip("0")) > _MAX_DIGITS or not minimum <= int(value) <= maximum:
    raise ValueError(accepted)
  return int(value)
