"""The metrics record (TUNIX_STAGE_METRICS): one JSON object per line and per step, one file per
process and run, each line flushed as its step ends; a record that cannot be written is said once
and dropped. The schema is versioned (`SCHEMA`, `VERSION`); `Reader` reads this version and the
one before it as a stream, each field checked against SHAPES, so a record edited by hand is one
line naming the field, and a record of any length is read in memory that its steps' figures
bound, never its bytes. The fields: docs/observability.md "The record".
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import stat
import sys
import threading
import time
from typing import Any, Callable, Iterable, Iterator

from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.core import inputs

try:  # optional, the `fast` extra: a long record read in about half the time (docs/observability.md)
  import orjson
except ImportError:
  orjson = None  # pylint: disable=invalid-name

SCHEMA = "tunix-stage-metrics"
VERSION = 2
# The version that added each field a record of an older version lacks (version 1 had no run).
ADDED = {"run": 2}
TRAINER, ORCHESTRATOR = "trainer", "orchestrator"

# What each field holds, so that a reader refuses a record edited by hand in one line naming the
# field, never a traceback in the report: a kind (NUMBER, COUNT, TEXT), Maybe(kind) (or null), an
# object of exactly these fields ("?name": a field it may lack), or {"*": shape} (an object whose
# every field is `shape`). The writers: make() and telemetry.trainer / telemetry.orchestrator.
# The bounds keep every figure a float holds exactly enough to print in a column: a count up to
# 2**53 (bytes: 8 PiB), a number up to 1e12 (seconds: 31,000 years; a Unix time).
MAX_COUNT, MAX_NUMBER = 2**53, 1e12
NUMBER = f"a number >= 0 and <= {MAX_NUMBER:.0e}"
COUNT = inputs.integer_range(0, MAX_COUNT)
TEXT = "text"


class Maybe:  # pylint: disable=too-few-public-methods
  """A shape, or null."""

  def __init__(self, shape: Any) -> None:
    self.shape = shape


# The staging settings a record carries (those that shape its figures: depths, bounds, codec),
# from the settings table; a reader takes a missing one at the table's default. A depth or bound
# set to auto is carried as the value in force at the step, its choice in the role's `sizing`.
# The setting each role sizes at auto: what its records' `sizing` speaks of.
SIZED = {ORCHESTRATOR: "max_staged_batches", TRAINER: "max_host_batches"}
CARRIED = tuple(config_lib.SETTINGS_BY_FIELD[field] for field in (
    "max_staged_batches", "max_device_batches", "max_host_batches", "codec"))
TRANSFERS = {"*": {"calls": COUNT, "bytes": COUNT, "seconds": NUMBER, "?gib_s": Maybe(NUMBER)}}
SHAPES = {
    "common": {"host": TEXT, "process": {"pid": COUNT, "hostname": TEXT},
               "run": {"id": TEXT, "started": NUMBER}, "time": NUMBER,
               "step": COUNT, "settings": {f"?{s.field}": COUNT if isinstance(s.default, int)
                                           else TEXT for s in CARRIED}},
    TRAINER: {
        "?host_step": Maybe(COUNT), "step_s": Maybe(NUMBER), "compute_s": NUMBER,
        "input_wait_s": {"mid_step": NUMBER, "boundary": Maybe(NUMBER)}, "other_s": NUMBER,
        "microbatches": COUNT,
        "compute": {"fwd_bwd_median_s": Maybe(NUMBER), "update_s": NUMBER,
                    "alone_s": Maybe(NUMBER), "beside_transfer": COUNT,
                    "slowdown_s": Maybe(NUMBER)},
        "receive": {"calls": COUNT, "bytes": COUNT, "seconds": NUMBER, "by_transport": TRANSFERS},
        "place": {"count": COUNT, "seconds": NUMBER, "bytes": COUNT, "staged": COUNT,
                  "inline": COUNT},
        "pool": {"waits": COUNT, "wait_s": NUMBER, "over_bound": COUNT},
        "staged": {"peak_device": Maybe(COUNT), "peak_host": Maybe(COUNT)}, "bound_by": TEXT,
        "?sizing": Maybe(TEXT)},
    ORCHESTRATOR: {
        "?host_step": Maybe(COUNT), "step_s": Maybe(NUMBER), "microbatches": COUNT,
        "depth": COUNT, "staged": COUNT, "inline": COUNT, "prestaged": COUNT, "peak_staged": COUNT,
        "fallbacks": {"count": COUNT, "by_kind": {"*": COUNT}}, "sent": TRANSFERS,
        "stage_calls": {"count": COUNT, "seconds": NUMBER, "median_s": Maybe(NUMBER),
                        "max_s": Maybe(NUMBER)},
        "?sizing": Maybe(TEXT)},
}
# The fields each role's record carries beside the common ones (from the one table above).
FIELDS = {role: tuple(k.removeprefix("?") for k in SHAPES[role]) for role in (TRAINER, ORCHESTRATOR)}
COMMON = ("schema", "version", "role", *SHAPES["common"])
SUFFIX = ".jsonl"
PATHS_ACCEPTED = "the folder TUNIX_STAGE_METRICS named, or record files"
LINES_ACCEPTED = f"one {SCHEMA} record per line, as TUNIX_STAGE_METRICS wrote it"
MAX_LINE = 1 << 20  # bytes; a record's line is a few hundred
CHUNK = 512  # lines decoded in one call
# A last line without its newline in a file modified this recently is still being written.
WRITING_S = 10.0


class RecordError(ValueError):
  """A record file that cannot be read as this schema; one line naming the file and line."""


def new_run() -> dict[str, Any]:
  """A run's identity (a process's telemetry makes one, and a new one for each run it starts):
  an id no other run shares, and when it started (Unix seconds)."""
  return {"id": secrets.token_hex(4), "started": time.time()}


def make(role: str, host: str, figures: dict[str, Any], settings: dict[str, Any],
         run: dict[str, Any]) -> dict[str, Any]:
  return {"schema": SCHEMA, "version": VERSION, "role": role, "host": host,
          "process": {"pid": os.getpid(), "hostname": socket.gethostname()}, "run": run,
          "time": time.time(), "settings": settings, **figures}


def setting(rec: dict[str, Any], field: str) -> Any:
  """A setting `rec` says it ran with (CARRIED), or the settings table's default."""
  return rec["settings"].get(field, config_lib.SETTINGS_BY_FIELD[field].default)


def file_name(role: str, run: str) -> str:
  return f"{role}-{socket.gethostname()}-{os.getpid()}-{run}{SUFFIX}"


class Writer:
  """Appends one process's records of one run to its file in `directory` (made on the first
  record)."""

  def __init__(self, directory: str, role: str, run: str) -> None:
    self.path = os.path.join(directory, file_name(role, run))
    self._lock = threading.Lock()
    self._file: Any = None
    self._failed = False

  def write(self, record: dict[str, Any]) -> None:
    with self._lock:
      if self._failed:
        return
      try:
        if self._file is None:
          os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
          self._file = open(self.path, "a", encoding="utf-8")  # pylint: disable=consider-using-with
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()  # the step is on disk (in the OS) before the next begins
      except (OSError, ValueError, TypeError) as e:
        self._failed = True
        print(f"tunix-stage: metrics: cannot write {self.path} ({type(e).__name__}: {e}); the "
              "job goes on without its metrics record", file=sys.stderr, flush=True)

  def close(self) -> None:
    with self._lock:
      if self._file is not None:
        self._file.close()
        self._file = None


_KINDS = ((stat.S_ISFIFO, "a named pipe"), (stat.S_ISDIR, "a folder"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"))


def _kind(mode: int) -> str:
  return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def files(paths: Iterable[str], notes: list[str] | None = None) -> list[str]:
  """The record files `paths` name (a file as given, a folder's *.jsonl files). An entry of a
  folder that is not a regular file is skipped, never opened (a named pipe's open would wait for
  a writer), and said in `notes` where given; a path given that is not a regular file is
  refused."""
  out: list[str] = []
  notes = [] if notes is None else notes
  for path in paths:
    try:
      mode = os.stat(path).st_mode
    except OSError:
      raise _error(path, PATHS_ACCEPTED, "no such file or folder") from None
    if stat.S_ISDIR(mode):
      found = 0
      for name in sorted(n for n in os.listdir(path) if n.endswith(SUFFIX)):
        entry = os.path.join(path, name)
        try:
          kind = os.stat(entry).st_mode
        except OSError as e:
          notes.append(f"{entry}: skipped: cannot be read ({e.strerror or e})")
          continue
        if stat.S_ISREG(kind):
          out.append(entry)
          found += 1
        else:
          notes.append(f"{entry}: skipped: {_kind(kind)}, not a record file")
      if not found:
        raise _error(path, PATHS_ACCEPTED, f"a folder with no metrics record in it (*{SUFFIX})")
    elif stat.S_ISREG(mode):
      out.append(path)
    else:
      raise _error(path, PATHS_ACCEPTED, f"not a regular file ({_kind(mode)})")
  return out


def _error(name: str, accepted: str, why: str) -> "RecordError":
  return RecordError(inputs.invalid(name, None, accepted, why))


class Reader:
  """One record file's records, read as they are iterated, CHUNK lines at a time (the file is
  never in memory whole); `note`, once iterated, says when its last line was cut short: a process
  killed while writing it, or one still writing it (the file modified within WRITING_S). Raises
  RecordError for anything else. Records are read-only: parts equal to the line before's are
  that line's (a long record holds little more than its changing figures)."""

  def __init__(self, path: str) -> None:
    self.path = path
    self.note: str | None = None
    self.count = 0
    self.offset = 0  # where the line of the record last given starts (`at` reads it again)

  def __iter__(self) -> Iterator[dict[str, Any]]:
    try:
      f = open(self.path, "rb")  # pylint: disable=consider-using-with
    except OSError as e:
      raise _error(self.path, LINES_ACCEPTED, f"cannot be read ({e.strerror or e})") from None
    with f:
      before: dict[str, Any] | None = None
      lines: list[bytes] = []
      starts: list[int] = []  # where each of `lines` starts in the file
      n = at = 0  # the lines read; where the next starts
      while True:
        raw = f.readline(MAX_LINE + 1)
        if raw.endswith(b"\n"):
          n += 1
          lines.append(raw)
          starts.append(at)
          at += len(raw)
          if len(lines) < CHUNK:
            continue
        elif len(raw) > MAX_LINE:
          raise _error(f"{self.path}:{n + 1}", LINES_ACCEPTED, f"a line of more than "
                       f"{MAX_LINE} bytes")
        values = _fast(lines)
        fast = values is not None
        if not fast:
          values = _decode(self.path, n - len(lines) + 1, lines)
        for record, self.offset, line in zip(values, starts, lines):
          try:
            before = _check(self.path, self.count + 1, record, before)
          except RecordError:
            if fast:  # what is wrong said of json's value, as without orjson
              _check(self.path, self.count + 1, _decode(self.path, n, [line])[0], None)
            raise
          self.count += 1
          yield before
        lines, starts = [], []
        if not raw.endswith(b"\n"):  # the end: its last line, if any, without its newline
          break
      if raw.strip():
        try:
          (record,) = _decode(self.path, n + 1, [raw])
          before = _check(self.path, n + 1, record, before)
        except RecordError:
          self.note = self._cut(os.fstat(f.fileno()).st_mtime)
        else:
          self.count += 1
          self.offset = at
          yield before
    if not self.count and self.note is None:
      raise _error(self.path, LINES_ACCEPTED, "holds no record")

  def _cut(self, modified: float) -> str:
    ago = time.time() - modified
    why = (f"is still being written (the file changed {max(ago, 0):.0f} s ago)"
           if ago < WRITING_S else "is cut short (the process was killed while writing it)")
    return f"{self.path}: its last line {why}; read the {self.count} whole record(s) before it"


def at(path: str, offsets: Iterable[int]) -> list[dict[str, Any]]:
  """The records whose lines start at `offsets` in `path` (Reader.offset's), read again: a long
  record's reader keeps its figures (core.telemetry.steps) and reads the records it shows."""
  out = []
  try:
    with open(path, "rb") as f:
      for offset in offsets:
        f.seek(offset)
        (value,) = _decode(path, 0, [f.readline(MAX_LINE + 1)])
        out.append(_check(path, 0, value, None))
  except OSError as e:
    raise _error(path, LINES_ACCEPTED, f"cannot be read ({e.strerror or e})") from None
  except RecordError:
    raise _error(path, LINES_ACCEPTED, "changed while it was read (a line read before is no "
                 "longer that record)") from None
  return out


def read(path: str) -> tuple[list[dict[str, Any]], str | None]:
  """The records of one file, and Reader's note on its last line."""
  reader = Reader(path)
  return list(reader), reader.note


class _Bad(Exception):
  """A field that is not what SHAPES says; `path`: the field's names, innermost first."""

  def __init__(self, value: Any, accepted: str, why: str | None = None) -> None:
    super().__init__(accepted)
    self.value, self.accepted, self.why = value, accepted, why
    self.path: list[str] = []


MISSING = "missing"
OBJECT = "a JSON object"
# Each leaf's test as an expression of `v` (_written's).
_TESTS = {NUMBER: "(type(v) is float or type(v) is int) and 0 <= v <= MAX_NUMBER",
          COUNT: "type(v) is int and 0 <= v <= MAX_COUNT", TEXT: "type(v) is str"}


def _bad(value: Any, accepted: str, path: tuple[str, ...], why: str | None = None) -> _Bad:
  bad = _Bad(value, accepted, why)
  bad.path = list(reversed(path))
  return bad


def _written(shape: dict[str, Any]) -> Callable[[dict[str, Any], Any], None]:
  """The check of a record of `shape` (SHAPES), written out as one function (a record's fields
  checked in a few microseconds, not a call each): it raises _Bad naming the first field that is
  not what `shape` says. A top-level object equal to the line before's (`b`) is that line's
  (checked already, and held once)."""
  lines: list[str] = []

  def check(sub: Any, var: str, path: tuple[str, ...], indent: str, depth: int) -> None:
    where = "(" + "".join(f"{p}, " for p in path) + ")"  # literals, and the loops' keys
    if isinstance(sub, Maybe):
      lines.append(f"{indent}if {var} is not None:")
      check(sub.shape, var, path, indent + "  ", depth)
    elif isinstance(sub, dict):
      lines.append(f"{indent}if type({var}) is not dict:")
      lines.append(f"{indent}  raise _bad({var}, OBJECT, {where})")
      if "*" in sub:
        key, item = f"k{depth}", f"i{depth}"
        lines.append(f"{indent}for {key}, {item} in {var}.items():")
        check(sub["*"], item, (*path, key), indent + "  ", depth + 1)
        return
      for name, inner in sub.items():
        field, value = name.removeprefix("?"), f"x{depth}"
        lines.append(f"{indent}{value} = {var}.get({field!r}, _M)")
        if name.startswith("?"):
          lines.append(f"{indent}if {value} is not _M:")
          check(inner, value, (*path, repr(field)), indent + "  ", depth + 1)
        else:
          lines.append(f"{indent}if {value} is _M:")
          missing = "(" + "".join(f"{p}, " for p in (*path, repr(field))) + ")"
          lines.append(f"{indent}  raise _bad(None, LINES_ACCEPTED, {missing}, MISSING)")
          check(inner, value, (*path, repr(field)), indent, depth + 1)
    else:
      lines.append(f"{indent}v = {var}")
      lines.append(f"{indent}if not ({_TESTS[sub]}):")
      lines.append(f"{indent}  raise _bad(v, {sub!r}, {where})")

  for name, sub in shape.items():
    field = name.removeprefix("?")
    body = "  "
    lines.append(f"  x = r.get({field!r}, _M)")
    if name.startswith("?"):
      lines.append("  if x is not _M:")
      body = "    "
    else:
      lines.append("  if x is _M:")
      lines.append(f"    raise _bad(None, LINES_ACCEPTED, ({field!r},), MISSING)")
    if isinstance(sub, dict):  # the line before's, where equal
      lines.append(f"{body}if b is not None and type(x) is dict and x == b.get({field!r}):")
      lines.append(f"{body}  r[{field!r}] = b[{field!r}]")
      lines.append(f"{body}else:")
      body += "  "
    check(sub, "x", (repr(field),), body, 0)
  names = {"_bad": _bad, "_M": object(), "OBJECT": OBJECT, "MISSING": MISSING,
           "LINES_ACCEPTED": LINES_ACCEPTED, "MAX_NUMBER": MAX_NUMBER, "MAX_COUNT": MAX_COUNT}
  exec(compile("def check(r, b):\n" + "\n".join(lines) + "\n", "<record check>", "exec"),  # pylint: disable=exec-used
       names)
  return names["check"]


# Per version, the fields its records lack; per role and version, the check of its records.
_LACKS = {version: tuple(field for field, added in ADDED.items() if added > version)
          for version in range(1, VERSION + 1)}
_CHECKS = {(role, version): _written({(f"?{k}" if k in lacks else k): shape for k, shape in
                                      {**SHAPES["common"], **SHAPES[role]}.items()})
           for role in FIELDS for version, lacks in _LACKS.items()}


def _fast(lines: list[bytes]) -> list[Any] | None:
  """orjson's values of `lines` where it is installed and reads them all (the same values as
  json's, read in a third of the time), else None: json reads them, and names a line that is
  not a JSON record (orjson refuses what json reads as NaN, the infinities, lone surrogates,
  another encoding, and reads an integer past 64 bits as a float: the check refuses those, its
  line said of json's value)."""
  if orjson is None:
    return None
  try:
    return [orjson.loads(raw) for raw in lines]
  except ValueError:
    return None


def _decode(path: str, first: int, lines: list[bytes]) -> list[Any]:
  """The JSON values of `lines` (line `first` on): in one call, so that their field names are
  shared; line by line where that fails, to name the line that is not a JSON record."""
  try:
    values = json.loads(b"[" + b",".join(lines) + b"]")
    if len(values) == len(lines):
      return values
  except (ValueError, RecursionError):
    pass
  values = []
  for n, raw in enumerate(lines, start=first):
    where = f"{path}:{n}"
    try:
      values.append(json.loads(raw))
    except json.JSONDecodeError as e:
      raise _error(where, LINES_ACCEPTED, f"not a JSON record ({e.msg})") from None
    except UnicodeDecodeError:
      raise _error(where, LINES_ACCEPTED, "not UTF-8 text") from None
    except (ValueError, RecursionError) as e:  # a number of more than 4300 digits; deep nesting
      raise _error(where, LINES_ACCEPTED, f"not a JSON record ({type(e).__name__})") from None
  return values


def _check(path: str, n: int, record: Any, before: dict[str, Any] | None) -> dict[str, Any]:
  """`record` (line `n` of `path`), checked against SHAPES; its parts equal to those of `before`
  (the line before's, of the same role) are `before`'s: what repeats (the process, the run, the
  settings, an unchanged pool) is checked and held once."""
  if not isinstance(record, dict) or record.get("schema") != SCHEMA:
    raise _error(f"{path}:{n}", "the files TUNIX_STAGE_METRICS wrote", f"not a {SCHEMA} record "
                 f"(its schema field is "
                 f"{record.get('schema') if isinstance(record, dict) else None!r})")
  version = record.get("version")
  if type(version) is not int or version not in _LACKS:  # pylint: disable=unidiomatic-typecheck
    raise _error(f"{path}:{n}", f"versions 1 to {VERSION}: read it with the version that wrote "
                 "it", f"schema version {version!r} is not one this tunix-stage-plugin reads")
  role = record.get("role")
  if not isinstance(role, str) or role not in FIELDS:
    raise _error(f"{path}:{n}", " | ".join(FIELDS), f"role {role!r}")
  try:
    same = before is not None and before["role"] == role and before["version"] == version
    _CHECKS[role, version](record, before if same else None)
  except _Bad as e:
    if len(e.path) == 1 and e.why == MISSING:  # a field of the record itself: name them all
      missing = [k for k in (*COMMON, *SHAPES[role]) if k not in record
                 and not k.startswith("?") and k not in _LACKS[version]]
      raise _error(f"{path}:{n}", LINES_ACCEPTED, f"a {role} record without {missing}") from None
    name = f"{path}:{n} {'.'.join(reversed(e.path))}"
    if e.why is not None:
      raise _error(name, e.accepted, e.why) from None
    raise RecordError(inputs.invalid(name, json.dumps(e.value)[:64], e.accepted)) from None
  if role == TRAINER:
    place = record["place"]
    if place["staged"] + place["inline"] > place["count"]:
      raise _error(f"{path}:{n} place", LINES_ACCEPTED, "more staged and inline placements than "
                   "its count")
  return record
