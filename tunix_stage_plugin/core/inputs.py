"""Inputs given as text: the one integer parser and the one shape of an error about an input
(`invalid`: `NAME='value' is invalid[: why]; accepted: WHAT`, the value cut to MAX_ECHO
characters), so a user meets one style for a variable, a flag or a line of a file.

The integer parser accepts plain ASCII decimal digits only (int() alone would take "+2", " 2",
"2_0" and "٢") and bounds the value, so 99999999999999999999999 is refused with the accepted range
rather than taken as a depth (docs/configuration.md).
"""

from __future__ import annotations

_MAX_DIGITS = 20  # longer digit strings are refused before int() turns them into a value
MAX_ECHO = 32  # how much of a refused value an error repeats


class Refused(ValueError):
  """A value outside what its parser accepts: `accepted` says what is, `why` (optional) what is
  wrong with this one."""

  def __init__(self, accepted: str, why: str | None = None) -> None:
    super().__init__(f"{why}; accepted: {accepted}" if why else f"accepted: {accepted}")
    self.accepted = accepted
    self.why = why


def echo(text: str) -> str:
  """`text` as an error message repeats it: repr, cut to MAX_ECHO characters."""
  if len(text) <= MAX_ECHO:
    return repr(text)
  return f"{text[:MAX_ECHO]!r}... ({len(text)} characters)"


def invalid(name: str, value: str | None, accepted: str, why: str | None = None) -> str:
  """The one error line about an input: `NAME='value' is invalid[: why]; accepted: ACCEPTED`
  (`NAME is invalid...` when there is no value to repeat, e.g. two flags that exclude each
  other; `'value' is invalid...` without a name, where argparse names the flag first)."""
  head = name if value is None else f"{name}={echo(value)}" if name else echo(value)
  return f"{head} is invalid{': ' + why if why else ''}; accepted: {accepted}"


def refusal(name: str, value: str | None, error: Refused) -> str:
  """`error` as the one error line about input `name`."""
  return invalid(name, value, error.accepted, error.why)


def integer_range(minimum: int, maximum: int) -> str:
  """What `integer(minimum=, maximum=)` accepts, as every error and help says it."""
  return f"an integer >= {minimum} and <= {maximum}"


def integer(text: str, *, minimum: int = 1, maximum: int) -> int:
  """Plain ASCII decimal digits with a value in minimum..maximum; Refused says what is accepted."""
  value = text.strip()
  if not (value.isascii() and value.isdigit()) or len(value.lstrip("0")) > _MAX_DIGITS \
      or not minimum <= int(value) <= maximum:
    raise Refused(integer_range(minimum, maximum))
  return int(value)
