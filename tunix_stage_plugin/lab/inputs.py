"""The lab's inputs: bounded parsers for the bench's numbers, and checks before work starts.

The bench and simulate commands and orchestrator_main collect one line per refused input
(`Problems.take`), so a command reports them all and exits 2 before it spawns or connects to
anything; trainer_main's argparse flags use `argparse_type`. Integers go through
core.inputs.integer, the parser the staging settings use. The parsers accept plain ASCII decimal
only and bound what they accept, so a typo is refused with the accepted range. Light imports
only: the embedded processes import it. docs/bench.md: "Inputs, interrupts and memory".
"""

from __future__ import annotations

import argparse
import math
import os
import re
import tempfile
from typing import Callable, TypeVar

from tunix_stage_plugin.core import inputs as core_inputs

T = TypeVar("T")

integer = core_inputs.integer  # the lab's integers go through the settings' parser

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
  accepted = f"accepted: a number {low} and <= {at_most:g}"
  value = text.strip()
  if not _DECIMAL.fullmatch(value):
    raise ValueError(accepted)
  parsed = float(value)
  if (not math.isfinite(parsed) or parsed > at_most or (above is not None and not parsed > above)
      or (at_least is not None and not parsed >= at_least)):
    raise ValueError(accepted)
  return parsed


def positive(text: str) -> float:
  return number(text, above=0.0)


def nonnegative(text: str) -> float:
  return number(text, at_least=0.0)


def payload_mib(text: str) -> float:
  try:
    return number(text, at_least=MIN_PAYLOAD_MIB, at_most=MAX_PAYLOAD_MIB)
  except ValueError:
    raise ValueError(f"accepted: a size in MiB from 1/1024 (1 KiB) to {MAX_PAYLOAD_MIB:g} "
                     f"({MAX_PAYLOAD_MIB / 1024:g} GiB)") from None


def argparse_type(parse: Callable[[str], T], accepted: str) -> Callable[[str], T]:
  """`parse` as an argparse `type=`: a refusal reads `'TEXT': accepted ACCEPTED`."""
  def parse_flag(text: str) -> T:
    try:
      return parse(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{text!r}: accepted {accepted}") from None
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


def memory_problem(payload_bytes: int, held: int, what: str) -> str | None:
  """A refusal when `held` payloads of `payload_bytes` cannot fit in the available memory."""
  need = payload_bytes * held
  available = available_bytes()
  if available is None or need <= available:
    return None
  return (f"{held} micro-batches of {payload_bytes / MIB:g} MiB held at once ({what}) need "
          f"{need / (1 << 30):.1f} GiB, more than the {available / (1 << 30):.1f} GiB available "
          f"(MemAvailable); accepted: at most {available / held / MIB:.0f} MiB per micro-batch "
          "with these settings, or fewer micro-batches held")


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


def output_dir_problem(path: str) -> str | None:
  if not path:
    return "an empty path; accepted: a directory that exists or can be created"
  problem = _creatable_dir_problem(path)
  return None if problem is None else f"{problem}; accepted: a directory that can be written"


def output_file_problem(path: str) -> str | None:
  """None when `path` can be written as a file (its folder exists or can be created)."""
  if os.path.isdir(path):
    return "is a directory; accepted: a file path"
  if os.path.exists(path) and not os.access(path, os.W_OK):
    return "exists and cannot be written"
  problem = _creatable_dir_problem(os.path.dirname(os.path.abspath(path)))
  return None if problem is None else f"{problem}; accepted: a file in a writable directory"


class Problems:
  """Collects one line per refused input, so a command can report them all and exit 2."""

  def __init__(self) -> None:
    self.lines: list[str] = []

  def take(self, flag: str, text: str | None, parse: Callable[[str], T]) -> T | None:
    """parse(text), or None after noting `flag 'text': <what is accepted>` (None: not given)."""
    if text is None:
      return None
    try:
      return parse(text)
    except ValueError as e:
      self.add(f"{flag} {text!r}: {e}")
      return None

  def add(self, line: str) -> None:
    self.lines.append(line)

  def check_path(self, flag: str, path: str, problem: Callable[[str], str | None]) -> None:
    found = problem(path)
    if found is not None:
      self.add(f"{flag} {path!r}: {found}")

  def __bool__(self) -> bool:
    return bool(self.lines)
