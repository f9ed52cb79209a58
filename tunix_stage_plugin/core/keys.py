"""Stage keys: the one name a staged micro-batch goes by between orchestrator and trainer, built,
checked and parsed here and nowhere else.

A pipeline's key is `<prefix>-s<step>-m<index>`, the prefix per run: `st<8 hex>`, or
`ts<session>.<n>` where a host tells orchestrator processes apart (tunix's: a trainer that sees a
new session drops the older sessions' batches, docs/tunix.md "One orchestrator per trainer"). The
trainer's store takes any key of the charset and length below (a key staged by hand carries no
step). docs/design.md "Core semantics".
"""

from __future__ import annotations

import itertools
import re
import secrets
from typing import Any, NamedTuple

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
  parsed = parse(key)
  match = None if parsed is None else _SESSION_PREFIX.fullmatch(parsed.prefix)
  return match["session"] if match else None
