"""The lab's inputs: bounded parsers for the bench's numbers, and checks before work starts.

The bench and simulate commands and orchestrator_main collect one line per refused input
(`Problems.take`), so a command reports them all and exits 2 before it spawns or connects to
anything; trainer_main's argparse flags use `argparse_type`. Every line has the settings' one
shape (core.inputs.invalid: `--flag='value' is invalid[: why]; accepted: ...`); a staging flag
(the device and host bounds, the codec) goes through the settings table itself
(`Problems.setting`), so it has one range in every command. Integers go through
core.inputs.integer. The parsers accept plain ASCII decimal only and bound what they accept, so a
typo is refused with the accepted range; an input file is read only when it is a regular file of
bounded size (`read_file`), so no input can hang a command. Light imports only: the embedded
processes import it. docs/bench.md: "Inputs, interrupts and memory".
"""

from __future__ import annotations

import argparse
import math
import os
import re
import stat
import tempfile
from typing import Any, Callable, Iterable, TypeVar

from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.core import inputs as core_inputs

T = TypeVar("T")

integer = core_inputs.integer  # the lab's integers go through the settings' parser
Refused = core_inputs.Refused

MAX_COUNT = 10**6  # steps, rounds, micro-batches, depths, retries
MAX_PORT = 65535
SEED_LIMIT = 2**32  # JAX's PRNGKey and numpy's seed sequence both take a 32-bit seed
MIB = 1 << 20
MIN_PAYLOAD_MIB = 1 / 1024  # 1 KiB: anything smaller is a typo, not a micro-batch
MAX_PAYLOAD_MIB = 64 * 1024.0  # 64 GiB per micro-batch, whatever the machine has
_DECIMAL = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?", re.ASCII)


def count(text: str) -> int:
  """A count of steps, rounds, micro-batches or batches: 1..MAX_COUNT."""
  return integer(text, minimum=1, maximum=MAX_COUNT)


def seed(text: str) -> int:
  return integer(text, minimum=0, maximum=SEED_LIMIT - 1)


def port(text: str) -> int:
  """A TCP port, 0 (any free port) to MAX_PORT."""
  return integer(text, minimum=0, maximum=MAX_PORT)


def number(text: str, *, above: float | None = None, at_least: float | None = None,
           at_most: float = 1e12) -> float:
  """A finite ASCII decimal (1.5, 2e-3) inside the bounds; ValueError says what is accepted."""
  low = (f"> {above:g}" if above is not None else f">= {at_least:g}")
  accepted = f"a number {low} and <= {at_most:g}"
  value = text.strip()
  if not _DECIMAL.fullmatch(value):
    raise Refused(accepted)
  parsed = float(value)
  if (not math.isfinite(parsed) or parsed > at_most or (above is not None and not parsed > above)
      or (at_least is not None and not parsed >= at_least)):
    raise Refused(accepted)
  return parsed


def positive(text: str) -> float:
  return number(text, above=0.0)


def nonnegative(text: str) -> float:
  return number(text, at_least=0.0)


def payload_mib(text: str) -> float:
  try:
    return number(text, at_least=MIN_PAYLOAD_MIB, at_most=MAX_PAYLOAD_MIB)
  except Refused:
    raise Refused(f"a size in MiB from 1/1024 (1 KiB) to {MAX_PAYLOAD_MIB:g} "
                  f"({MAX_PAYLOAD_MIB / 1024:g} GiB)") from None


def one_of(names: Iterable[str]) -> Callable[[str], str]:
  """A parser of one name out of `names`."""
  names = tuple(names)

  def parse(text: str) -> str:
    if text not in names:
      raise Refused(" | ".join(names))
    return text
  return parse


def argparse_type(parse: Callable[[str], T]) -> Callable[[str], T]:
  """`parse` as an argparse `type=`: a refusal reads `argument --flag: 'TEXT' is invalid;
  accepted: ...` (argparse puts the flag first)."""
  def parse_flag(text: str) -> T:
    try:
      return parse(text)
    except Refused as e:
      raise argparse.ArgumentTypeError(core_inputs.refusal("", text, e)) from None
  return parse_flag


def available_bytes() -> int | None:
  """MemAvailable from /proc/meminfo; None where it cannot be read (not Linux)."""
  try:
    with open("/proc/meminfo", encoding="ascii") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except (OSError, ValueError, IndexError):
    pass
  return None


def memory_refusal(payload_bytes: int, held: int, what: str) -> Refused | None:
  """A refusal when `held` payloads of `payload_bytes` cannot fit in the available memory."""
  need = payload_bytes * held
  available = available_bytes()
  if available is None or need <= available:
    return None
  return Refused(f"at most {available / held / MIB:.0f} MiB per micro-batch with these "
                 "settings, or fewer micro-batches held",
                 f"{held} micro-batches of {payload_bytes / MIB:g} MiB held at once ({what}) "
                 f"need {need / (1 << 30):.1f} GiB, more than the {available / (1 << 30):.1f} GiB "
                 "available (MemAvailable)")


def _creatable_dir_problem(path: str) -> str | None:
  """None when `path` is a writable directory, or can be made one; else why not."""
  path = os.path.abspath(path)
  existing = path
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    return f"{existing} is not a directory"
  try:  # permission bits say little for root or on read-only mounts: try it
    os.rmdir(tempfile.mkdtemp(prefix=".tunix-stage-check-", dir=existing))
  except OSError as e:
    return f"cannot create anything in {existing} ({e.strerror or e})"
  return None


def output_dir(path: str) -> str:
  """`path` when it is a writable directory or can be made one; Refused otherwise."""
  accepted = "a directory that exists or can be created, and written"
  if not path:
    raise Refused(accepted, "an empty path")
  problem = _creatable_dir_problem(path)
  if problem is not None:
    raise Refused(accepted, problem)
  return path


def output_file(path: str) -> str:
  """`path` when it can be written as a file (its folder exists or can be created)."""
  accepted = "a file path in a directory that exists or can be created, and written"
  if not path:
    raise Refused(accepted, "an empty path")
  if os.path.isdir(path):
    raise Refused(accepted, "a directory")
  if os.path.exists(path) and not os.access(path, os.W_OK):
    raise Refused(accepted, "exists and cannot be written")
  problem = _creatable_dir_problem(os.path.dirname(os.path.abspath(path)))
  if problem is not None:
    raise Refused(accepted, problem)
  return path


def output_png(path: str) -> str:
  """A file path for a PNG picture (`output_file`, named .png)."""
  if not path.lower().endswith(".png"):
    raise Refused("a file path ending in .png", "not a .png name")
  return output_file(path)


def read_file(path: str, accepted: str, max_bytes: int) -> bytes:
  """The bytes of `path`, a regular file of at most `max_bytes`; Refused (naming why, with
  `accepted`) otherwise. Only a regular file: a FIFO or a device could block or never end."""
  try:
    info = os.stat(path)
  except OSError as e:
    raise Refused(accepted, "no such file" if isinstance(e, FileNotFoundError)
                  else f"cannot read it ({e.strerror or e})") from None
  if not stat.S_ISREG(info.st_mode):
    raise Refused(accepted, "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file")
  if info.st_size > max_bytes:
    raise Refused(accepted, f"{info.st_size / MIB:.1f} MiB, more than the {max_bytes / MIB:g} MiB "
                  "read")
  try:
    with open(path, "rb") as f:
      data = f.read(max_bytes + 1)
  except OSError as e:
    raise Refused(accepted, f"cannot read it ({e.strerror or e})") from None
  if len(data) > max_bytes:  # it grew since the stat
    raise Refused(accepted, f"more than the {max_bytes / MIB:g} MiB read")
  return data


class Problems:
  """Collects one line per refused input, so a command can report them all and exit 2."""

  def __init__(self) -> None:
    self.lines: list[str] = []

  def take(self, flag: str, text: str | None, parse: Callable[[str], T]) -> T | None:
    """parse(text), or None after noting `flag='text' is invalid...` (None: not given)."""
    if text is None:
      return None
    try:
      return parse(text)
    except Refused as e:
      self.add(core_inputs.refusal(flag, text, e))
      return None

  def setting(self, field: str, text: str | None) -> Any:
    """The staging setting `field` given as its flag: the settings table's parser and range."""
    if text is None:
      return None
    setting = config_lib.SETTINGS_BY_FIELD[field]
    try:
      return config_lib.parse_value(setting, text, f"--{setting.flag}")
    except config_lib.ConfigError as e:
      for line in e.problems:
        self.add(line)
      return None

  def refuse(self, flag: str, text: str | None, accepted: str, why: str | None = None) -> None:
    self.add(core_inputs.invalid(flag, text, accepted, why))

  def add(self, line: str) -> None:
    if line not in self.lines:  # an input given twice is refused once
      self.lines.append(line)

  def __bool__(self) -> bool:
    return bool(self.lines)
