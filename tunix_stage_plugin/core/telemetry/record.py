"""The metrics record (TUNIX_STAGE_METRICS): one JSON object per line and per step, one file per
process, each line flushed as its step ends; a record that cannot be written is said once and
dropped. The schema is versioned (`SCHEMA`, `VERSION`); `read` takes this version only, each field
checked against SHAPES, so a record edited by hand is one line naming the field.
The fields: docs/observability.md "The record".
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import threading
import time
from typing import Any, Iterable

from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.core import inputs

SCHEMA = "tunix-stage-metrics"
VERSION = 1
TRAINER, ORCHESTRATOR = "trainer", "orchestrator"

# What each field holds, so that `read` refuses a record edited by hand in one line naming the
# field, never a traceback in the report: a kind (NUMBER, COUNT, TEXT), Maybe(kind) (or null), an
# object of exactly these fields ("?name": a field it may lack), or {"*": shape} (an object whose
# every field is `shape`). The writers: make() and telemetry.trainer / telemetry.orchestrator.
NUMBER, COUNT, TEXT = "a number >= 0", "an integer >= 0", "text"


class Maybe:  # pylint: disable=too-few-public-methods
  """A shape, or null."""

  def __init__(self, shape: Any) -> None:
    self.shape = shape


# The staging settings a record carries (those that shape its figures: depths, bounds, codec),
# from the settings table; a reader takes a missing one at the table's default.
CARRIED = tuple(config_lib.SETTINGS_BY_FIELD[field] for field in (
    "max_staged_batches", "max_device_batches", "max_host_batches", "codec"))
TRANSFERS = {"*": {"calls": COUNT, "bytes": COUNT, "seconds": NUMBER, "?gib_s": Maybe(NUMBER)}}
SHAPES = {
    "common": {"host": TEXT, "process": {"pid": COUNT, "hostname": TEXT}, "time": NUMBER,
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
        "staged": {"peak_device": Maybe(COUNT), "peak_host": Maybe(COUNT)}, "bound_by": TEXT},
    ORCHESTRATOR: {
        "?host_step": Maybe(COUNT), "step_s": Maybe(NUMBER), "microbatches": COUNT,
        "depth": COUNT, "staged": COUNT, "inline": COUNT, "prestaged": COUNT, "peak_staged": COUNT,
        "fallbacks": {"count": COUNT, "by_kind": {"*": COUNT}}, "sent": TRANSFERS,
        "stage_calls": {"count": COUNT, "seconds": NUMBER, "median_s": Maybe(NUMBER),
                        "max_s": Maybe(NUMBER)}},
}
# The fields each role's record carries beside the common ones (from the one table above).
FIELDS = {role: tuple(k.removeprefix("?") for k in SHAPES[role]) for role in (TRAINER, ORCHESTRATOR)}
COMMON = ("schema", "version", "role", *SHAPES["common"])
SUFFIX = ".jsonl"
PATHS_ACCEPTED = "the folder TUNIX_STAGE_METRICS named, or record files"
LINES_ACCEPTED = f"one {SCHEMA} record per line, as TUNIX_STAGE_METRICS wrote it"


class RecordError(ValueError):
  """A record file that cannot be read as this schema; one line naming the file and line."""


def make(role: str, host: str, figures: dict[str, Any], settings: dict[str, Any]
         ) -> dict[str, Any]:
  return {"schema": SCHEMA, "version": VERSION, "role": role, "host": host,
          "process": {"pid": os.getpid(), "hostname": socket.gethostname()},
          "time": time.time(), "settings": settings, **figures}


def setting(rec: dict[str, Any], field: str) -> Any:
  """A setting `rec` says it ran with (CARRIED), or the settings table's default."""
  return rec["settings"].get(field, config_lib.SETTINGS_BY_FIELD[field].default)


def file_name(role: str) -> str:
  return f"{role}-{socket.gethostname()}-{os.getpid()}{SUFFIX}"


class Writer:
  """Appends one process's records to its file in `directory` (made on the first record)."""

  def __init__(self, directory: str, role: str) -> None:
    self.path = os.path.join(directory, file_name(role))
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


def files(paths: Iterable[str]) -> list[str]:
  """The record files `paths` name: a file as given, a directory's *.jsonl files."""
  out = []
  for path in paths:
    if os.path.isdir(path):
      found = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(SUFFIX))
      if not found:
        raise _error(path, PATHS_ACCEPTED, f"a folder with no metrics record in it (*{SUFFIX})")
      out += found
    elif os.path.isfile(path):
      out.append(path)
    else:
      raise _error(path, PATHS_ACCEPTED, "not a regular file" if os.path.exists(path)
                   else "no such file or folder")
  return out


def _error(name: str, accepted: str, why: str) -> "RecordError":
  return RecordError(inputs.invalid(name, None, accepted, why))


def read(path: str) -> tuple[list[dict[str, Any]], str | None]:
  """The records of one file, and a note when its last line was cut short (a process killed
  while writing it: the records before it are whole). Raises RecordError for anything else."""
  try:
    with open(path, "rb") as f:
      data = f.read()
  except OSError as e:
    raise _error(path, LINES_ACCEPTED, f"cannot be read ({e.strerror or e})") from None
  lines = data.split(b"\n")
  cut = lines.pop() if lines else b""  # what follows the last newline: empty when whole
  records, note = [], None
  for n, raw in enumerate(lines, start=1):
    records.append(_parse(path, n, raw))
  if cut.strip():
    try:
      records.append(_parse(path, len(lines) + 1, cut))
    except RecordError:
      note = (f"{path}: its last line is cut short (the process was killed while writing it); "
              f"read the {len(records)} whole record(s) before it")
  if not records and note is None:
    raise _error(path, LINES_ACCEPTED, "holds no record")
  return records, note


def _parse(path: str, n: int, raw: bytes) -> dict[str, Any]:
  where = f"{path}:{n}"
  try:
    record = json.loads(raw)
  except json.JSONDecodeError as e:
    raise _error(where, LINES_ACCEPTED, f"not a JSON record ({e.msg})") from None
  except UnicodeDecodeError:
    raise _error(where, LINES_ACCEPTED, "not UTF-8 text") from None
  except (ValueError, RecursionError) as e:  # a number of more than 4300 digits; deep nesting
    raise _error(where, LINES_ACCEPTED, f"not a JSON record ({type(e).__name__})") from None
  if not isinstance(record, dict) or record.get("schema") != SCHEMA:
    raise _error(where, "the files TUNIX_STAGE_METRICS wrote", f"not a {SCHEMA} record (its "
                 f"schema field is {record.get('schema') if isinstance(record, dict) else None!r})")
  if record.get("version") != VERSION:
    raise _error(where, f"version {VERSION}: read it with the version that wrote it",
                 f"schema version {record.get('version')!r} is not one this tunix-stage-plugin "
                 "reads")
  role = record.get("role")
  if not isinstance(role, str) or role not in FIELDS:
    raise _error(where, " | ".join(FIELDS), f"role {role!r}")
  missing = [k for k in (*COMMON, *SHAPES[role]) if k not in record and not k.startswith("?")]
  if missing:
    raise _error(where, LINES_ACCEPTED, f"a {role} record without {missing}")
  for shapes in (SHAPES["common"], SHAPES[role]):
    for key, shape in shapes.items():
      field = key.removeprefix("?")  # a field a record may lack
      if field in record:
        _check(record[field], shape, f"{where} {field}")
  if role == TRAINER and record["place"]["staged"] + record["place"]["inline"] > \
      record["place"]["count"]:
    raise _error(f"{where} place", LINES_ACCEPTED, "more staged and inline placements than "
                 "its count")
  return record


def _check(value: Any, shape: Any, name: str) -> None:
  """Raises RecordError unless `value` is what `shape` (SHAPES) says."""
  if isinstance(shape, Maybe):
    if value is not None:
      _check(value, shape.shape, name)
    return
  if isinstance(shape, dict):
    if not isinstance(value, dict):
      raise _wrong(value, "a JSON object", name)
    if "*" in shape:
      for key, item in value.items():
        _check(item, shape["*"], f"{name}.{key}")
      return
    for key, sub in shape.items():
      field = key.removeprefix("?")
      if field in value:
        _check(value[field], sub, f"{name}.{field}")
      elif not key.startswith("?"):
        raise _error(f"{name}.{field}", LINES_ACCEPTED, "missing")
    return
  number = isinstance(value, (int, float)) and not isinstance(value, bool)
  if (shape == TEXT and not isinstance(value, str)
      or shape == COUNT and not (number and isinstance(value, int) and value >= 0)
      or shape == NUMBER and not (number and math.isfinite(value) and value >= 0)):
    raise _wrong(value, shape, name)


def _wrong(value: Any, accepted: str, name: str) -> "RecordError":
  return RecordError(inputs.invalid(name, json.dumps(value)[:64], accepted))
