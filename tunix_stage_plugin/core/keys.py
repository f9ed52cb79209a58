"""Stage keys: the one name a staged micro-batch goes by between orchestrator and trainer, built,
checked and parsed here and nowhere else.

A pipeline names micro-batch `index` of step `step` `<prefix>-s<step>-m<index>`: the prefix is
per run (a host may put its own fields in it: tunix's orchestrator session, hosts/tunix/
sessions.py), the step and index make every key of a run unique. The trainer's store takes any key
of the charset and length below (a key staged by hand carries no step). docs/design.md "Core
semantics".
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

CHARS = "A-Za-z0-9._:-"
MAX_LEN = 128
RULE = f"a str of 1-{MAX_LEN} characters from [{CHARS}]"
# The longest prefix a pipeline may use: room for "-s<step>-m<index>" within MAX_LEN.
MAX_PREFIX_LEN = MAX_LEN - 32

_KEY = re.compile(f"[{CHARS}]+")
_PIPELINE_KEY = re.compile(r"(?P<prefix>.+)-s(?P<step>[0-9]+)-m(?P<index>[0-9]+)")


class StageKeyError(KeyError):
  """A staging key is malformed, already in use, or not staged."""

  def __str__(self) -> str:  # KeyError repr()s its argument; we want the sentence.
    return str(self.args[0])


class PipelineKey(NamedTuple):
  prefix: str
  step: int
  index: int


def check(key: Any) -> str:
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
  check(build(prefix, 0, 0))
  return prefix


def build(prefix: str, step: int, index: int) -> str:
  """The key of micro-batch `index` of step `step` in the run whose keys start with `prefix`."""
  return f"{prefix}-s{step}-m{index}"


def parse(key: Any) -> PipelineKey | None:
  """A pipeline's key as (prefix, step, index); None for any other key."""
  match = _PIPELINE_KEY.fullmatch(key) if isinstance(key, str) else None
  if match is None:
    return None
  return PipelineKey(match["prefix"], int(match["step"]), int(match["index"]))
