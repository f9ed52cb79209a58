"""A job's metrics records (TUNIX_STAGE_METRICS) read into tables: per role, one pandas DataFrame,
a row per process and step, its columns named as the figures (core/telemetry/figures.py) beside
the record's own fields (the run, the process, the step, the settings).

Each file is read in blocks of whole lines by pyarrow's JSON reader under the record's schema
(SHAPES, made from the figures' table), and each block's columns are checked at once against it:
types by the reader, ranges, nulls and the per-record rule by `_columns`. A block that either
refuses is read again line by line by the standard library's JSON and `check`, the one check of
a record, which names the file, the line and the field that is wrong in one line; a block it
accepts (a key given twice, a lone surrogate) is kept as it reads it. docs/observability.md
"tunix-stage report".
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import time
from typing import Any, Iterable, Iterator

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pa_json

from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.core import inputs
from tunix_stage_plugin.core.telemetry import figures as figures_lib
from tunix_stage_plugin.core.telemetry import record as record_lib

TRAINER, ORCHESTRATOR = record_lib.TRAINER, record_lib.ORCHESTRATOR
# The version that added each field a record of an older version lacks (version 1 had no run).
ADDED = {"run": 2}
# The bounds keep every figure a float holds exactly enough to print in a column: a count up to
# 2**53 (bytes: 8 PiB), a number up to 1e12 (seconds: 31,000 years; a Unix time).
MAX_COUNT, MAX_NUMBER = 2**53, 1e12
NUMBER = f"a number >= 0 and <= {MAX_NUMBER:.0e}"
COUNT = inputs.integer_range(0, MAX_COUNT)
TEXT = "text"
# A depth or bound carried as `auto` (a record of a process that had made no choice yet).
SIZED = f"{config_lib.AUTO}, or {COUNT}"
OBJECT = "a JSON object"
MISSING = "missing"
PATHS_ACCEPTED = "the folder TUNIX_STAGE_METRICS named, or record files"
LINES_ACCEPTED = f"one {record_lib.SCHEMA} record per line, as TUNIX_STAGE_METRICS wrote it"
MAX_LINE = 1 << 20  # bytes; a record's line is a few hundred
BLOCK = 4 << 20  # bytes of whole lines read at once (pyarrow's parse holds a few times as many)
# A last line without its newline in a file modified this recently is still being written.
WRITING_S = 10.0


class RecordError(ValueError):
  """A record file that cannot be read as this schema; one line naming the file and line."""


class Maybe:  # pylint: disable=too-few-public-methods
  """A shape, or null."""

  def __init__(self, shape: Any) -> None:
    self.shape = shape


_KIND = {figures_lib.SECONDS: NUMBER, figures_lib.RATE: NUMBER, figures_lib.COUNT: COUNT,
         figures_lib.BYTES: COUNT, figures_lib.TEXT: TEXT, figures_lib.CAUSE: TEXT}


def _role_shape(role: str) -> dict[str, Any]:
  """What each field of `role`'s record holds beside the common ones, from the figures' table: a
  kind, Maybe(kind) (or null), an object of exactly these fields ("?name": one it may lack), or
  {"*": shape}: an object whose every field is `shape` (a family: one entry per transport)."""
  shape: dict[str, Any] = {}
  for f in figures_lib.BY_ROLE[role].values():
    if not f.path:
      continue  # derived from others
    leaf = Maybe(_KIND[f.unit]) if f.null else _KIND[f.unit]
    path, at = f.path, shape
    if f.family is not None:  # {"*": the parts of one entry}
      n = len(f.family)
      for key in f.family[:-1]:
        at = at.setdefault(key, {})
      entry = at.setdefault(f.family[-1], {"*": {}})
      if len(path) == n + 1:
        entry["*"] = leaf
        continue
      at, path = entry["*"], path[n + 1:]
    for key in path[:-1]:
      at = at.setdefault(key, {})
    at[("?" if f.optional else "") + path[-1]] = leaf
  return shape


def _carried(setting: config_lib.Setting) -> str:
  """What a record's setting holds: a count (a depth or bound; `auto` for one sized each step,
  before its first choice), else a text."""
  if config_lib.COUNT_ACCEPTED not in setting.accepted:
    return TEXT
  return SIZED if config_lib.AUTO in setting.accepted else COUNT


# The record's fields and what each holds (core/telemetry/record.py writes them): the common ones,
# then each role's from the figures' table. A depth or bound may be carried as `auto`.
SHAPES = {
    "common": {"host": TEXT, "process": {"pid": COUNT, "hostname": TEXT},
               "run": {"id": TEXT, "started": NUMBER}, "time": NUMBER, "step": COUNT,
               "settings": {f"?{s.field}": _carried(s) for s in record_lib.CARRIED}},
    **{role: _role_shape(role) for role in record_lib.ROLES},
}
# Per version, the fields its records lack.
_LACKS = {version: tuple(f for f, added in ADDED.items() if added > version)
          for version in range(1, record_lib.VERSION + 1)}
FIELDS = {role: tuple(k.removeprefix("?") for k in SHAPES[role]) for role in record_lib.ROLES}
COMMON = ("schema", "version", "role", *SHAPES["common"])


def _error(name: str, accepted: str, why: str) -> RecordError:
  return RecordError(inputs.invalid(name, None, accepted, why))


# --- the one check of a record ----------------------------------------------------------------


class _Bad(Exception):
  """A field that is not what SHAPES says: `path`, its names from the record's top."""

  def __init__(self, value: Any, accepted: str, path: tuple[str, ...],
               why: str | None = None) -> None:
    super().__init__(accepted)
    self.value, self.accepted, self.path, self.why = value, accepted, path, why


def _is_count(v: Any) -> bool:
  return type(v) is int and 0 <= v <= MAX_COUNT  # pylint: disable=unidiomatic-typecheck


_LEAVES = {
    NUMBER: lambda v: type(v) in (int, float) and 0 <= v <= MAX_NUMBER,  # NaN fails
    COUNT: _is_count,
    SIZED: lambda v: v == config_lib.AUTO or _is_count(v),
    TEXT: lambda v: type(v) is str,  # pylint: disable=unidiomatic-typecheck
}


def _walk(value: Any, shape: Any, path: tuple[str, ...]) -> None:
  """Raises _Bad at the first field of `value` that is not what `shape` says."""
  if isinstance(shape, Maybe):
    if value is None:
      return
    shape = shape.shape
  if isinstance(shape, dict):
    if type(value) is not dict:  # pylint: disable=unidiomatic-typecheck
      raise _Bad(value, OBJECT, path)
    if "*" in shape:
      for key, item in value.items():
        _walk(item, shape["*"], (*path, key))
      return
    for name, inner in shape.items():
      key = name.removeprefix("?")
      if key in value:
        _walk(value[key], inner, (*path, key))
      elif key == name:
        raise _Bad(None, LINES_ACCEPTED, (*path, key), MISSING)
  elif not _LEAVES[shape](value):
    raise _Bad(value, shape, path)


def check(where: str, record: Any) -> None:
  """`record` (the value of one line; `where`: its file and line) against SHAPES; RecordError, one
  line naming the field that is wrong and what it accepts."""
  if not isinstance(record, dict) or record.get("schema") != record_lib.SCHEMA:
    raise _error(where, "the files TUNIX_STAGE_METRICS wrote", f"not a {record_lib.SCHEMA} record "
                 f"(its schema field is "
                 f"{record.get('schema') if isinstance(record, dict) else None!r})")
  version = record.get("version")
  if type(version) is not int or version not in _LACKS:  # pylint: disable=unidiomatic-typecheck
    raise _error(where, f"versions 1 to {record_lib.VERSION}: read it with the version that wrote "
                 "it", f"schema version {version!r} is not one this tunix-stage-plugin reads")
  role = record.get("role")
  if not isinstance(role, str) or role not in FIELDS:
    raise _error(where, " | ".join(FIELDS), f"role {role!r}")
  lacks = _LACKS[version]
  shape = {(f"?{k}" if k in lacks else k): v for k, v in {**SHAPES["common"],
                                                            **SHAPES[role]}.items()}
  try:
    _walk(record, shape, ())
  except _Bad as e:
    if len(e.path) == 1 and e.why == MISSING:  # a field of the record itself: name them all
      missing = [k for k in (*COMMON, *SHAPES[role]) if k not in record
                 and not k.startswith("?") and k not in lacks]
      raise _error(where, LINES_ACCEPTED, f"a {role} record without {missing}") from None
    name = f"{where} {'.'.join(e.path)}"
    if e.why is not None:
      raise _error(name, e.accepted, e.why) from None
    raise RecordError(inputs.invalid(name, json.dumps(e.value)[:64], e.accepted)) from None
  if role == TRAINER:
    place = record["place"]
    if place["staged"] + place["inline"] > place["count"]:
      raise _error(f"{where} place", LINES_ACCEPTED, "more staged and inline placements than "
                   "its count")


def _decode(where: str, raw: bytes) -> Any:
  """The JSON value of one line; RecordError naming the line where it is not one."""
  try:
    return json.loads(raw)
  except json.JSONDecodeError as e:
    raise _error(where, LINES_ACCEPTED, f"not a JSON record ({e.msg})") from None
  except UnicodeDecodeError:
    raise _error(where, LINES_ACCEPTED, "not UTF-8 text") from None
  except (ValueError, RecursionError) as e:  # a number of more than 4300 digits; deep nesting
    raise _error(where, LINES_ACCEPTED, f"not a JSON record ({type(e).__name__})") from None


# --- the schema as pyarrow reads it -----------------------------------------------------------

_ARROW = {NUMBER: pa.float64(), COUNT: pa.int64(), SIZED: pa.int64(), TEXT: pa.string()}


def _family_keys(role: str) -> dict[tuple[str, ...], list[str]]:
  """Per family (its path), the names the figures' table knows (its transports, kinds)."""
  out: dict[tuple[str, ...], list[str]] = {}
  for f in figures_lib.BY_ROLE[role].values():
    if f.family is not None:
      keys = out.setdefault(f.family, [])
      if f.path[len(f.family)] not in keys:
        keys.append(f.path[len(f.family)])
  return out


def _arrow(shape: Any, path: tuple[str, ...], families: dict) -> pa.DataType:
  if isinstance(shape, Maybe):
    shape = shape.shape
  if not isinstance(shape, dict):
    return _ARROW[shape]
  if "*" in shape:
    return pa.struct([(k, _arrow(shape["*"], (*path, k), families)) for k in families[path]])
  return pa.struct([(k.removeprefix("?"), _arrow(v, (*path, k.removeprefix("?")), families))
                    for k, v in shape.items()])


def _schema(role: str) -> pa.Schema:
  families = _family_keys(role)
  fields = {"schema": TEXT, "version": COUNT, "role": TEXT, **SHAPES["common"], **SHAPES[role]}
  return pa.schema([(k.removeprefix("?"), _arrow(v, (k.removeprefix("?"),), families))
                    for k, v in fields.items()])


@dataclasses.dataclass(frozen=True)
class _Leaf:
  """One column of a role's record as pyarrow reads it (its objects flattened), what it holds,
  and when a null in it is what the record said: a `maybe` leaf's key written null, or an
  `optional` key (the leaf's own, or its family entry's) absent; `added`: the version whose
  records hold its top field (an older record lacks it)."""

  path: tuple[str, ...]
  kind: str
  maybe: bool
  optional: str | None
  added: int = 1

  @property
  def name(self) -> str:
    return ".".join(self.path)


def _leaves(shape: dict[str, Any], families: dict, path: tuple[str, ...] = (),
            optional: str | None = None) -> Iterator[_Leaf]:
  for name, inner in shape.items():
    key = name.removeprefix("?")
    here, opt = (*path, key), (key if name != key else optional)
    maybe = isinstance(inner, Maybe)
    inner = inner.shape if maybe else inner
    if isinstance(inner, dict) and "*" in inner:  # an entry per name the table knows, optional
      entry = inner["*"]
      for k in families[here]:
        if isinstance(entry, dict):
          yield from _leaves(entry, families, (*here, k), k)
        else:
          yield _Leaf((*here, k), entry.shape if isinstance(entry, Maybe) else entry,
                      isinstance(entry, Maybe), k)
    elif isinstance(inner, dict):
      yield from _leaves(inner, families, here, opt)
    else:
      yield _Leaf(here, inner, maybe, opt, ADDED.get(here[0], 1))


class _Role:
  """What reading one role's records needs: its pyarrow schema and its leaves."""

  def __init__(self, role: str) -> None:
    self.role = role
    self.families = _family_keys(role)
    self.schema = _schema(role)
    fields = {"schema": TEXT, "version": COUNT, "role": TEXT, **SHAPES["common"], **SHAPES[role]}
    self.leaves = tuple(_leaves(fields, self.families))
    self.names = {leaf.name for leaf in self.leaves}
    self.family_names = tuple(".".join(p) + "." for p in self.families)


_ROLES = {role: _Role(role) for role in record_lib.ROLES}


# The parse's transient memory goes back to the system as it is freed (pyarrow's default pool
# keeps it: a long record's report would hold its peak).
_POOL = pa.system_memory_pool()


class _Refused(Exception):
  """A block the columns' check refuses: read again line by line, where `check` names why."""


def _flat(table: pa.Table) -> dict[str, pa.ChunkedArray]:
  while any(pa.types.is_struct(f.type) for f in table.schema):
    table = table.flatten()
  return dict(zip(table.column_names, table.columns))


class _Lines:
  """A block of whole lines of a file, as read: its bytes, where each line ends, and, asked for,
  which lines hold a field's name (`"name":`)."""

  def __init__(self, first: int, data: bytes, ends: np.ndarray) -> None:
    self.first, self.data, self.ends = first, data, ends  # ends: each line's newline
    self._text: pa.Array | None = None
    self._has: dict[str, np.ndarray] = {}

  def __len__(self) -> int:
    return len(self.ends)

  def split(self) -> list[bytes]:
    return self.data.split(b"\n")[:len(self.ends)]

  def has(self, key: str, rows: np.ndarray) -> np.ndarray:
    """Per line of `rows`, whether it holds `"key":` (a record's field by that name: inside a
    JSON string a quote is escaped, so no string holds it)."""
    if key not in self._has:
      pattern = f'"{key}":'.encode()
      if len(rows) <= 64:  # a few lines (a first step's nulls): each looked at
        starts = np.r_[0, self.ends[:-1] + 1]
        return np.array([self.data.find(pattern, starts[r], self.ends[r]) >= 0 for r in rows],
                        dtype=bool)
      if pattern not in self.data:
        self._has[key] = np.zeros(len(self), dtype=bool)
      else:
        if self._text is None:  # the lines as one array over the block's bytes (no copy)
          offsets = np.r_[0, self.ends + 1].astype(np.int32)
          self._text = pa.Array.from_buffers(pa.binary(), len(self), [
              None, pa.py_buffer(offsets), pa.py_buffer(self.data)])
        self._has[key] = pc.match_substring(self._text, pattern.decode()).to_numpy(
            zero_copy_only=False)
    return self._has[key][rows]


def _columns(role: _Role, table: pa.Table, lines: _Lines) -> dict[str, pa.ChunkedArray]:
  """The block's leaves, checked against the record's schema all at once; _Refused where any
  row may not be what SHAPES says (check() then names it)."""
  if table.num_rows != len(lines):  # a blank line, which pyarrow skips
    raise _Refused()
  flat = _flat(table)
  if any(name not in role.names and name.startswith(role.family_names) for name in flat):
    raise _Refused()  # an entry of a family the table does not know: check() reads it
  version = flat["version"].to_numpy(zero_copy_only=False)
  if (flat["schema"].null_count or flat["role"].null_count or flat["version"].null_count
      or not pc.all(pc.equal(flat["schema"], record_lib.SCHEMA)).as_py()
      or not pc.all(pc.equal(flat["role"], role.role)).as_py()
      or not np.isin(version, list(_LACKS)).all()):
    raise _Refused()
  for leaf in role.leaves:
    column = flat[leaf.name]
    if leaf.kind in (NUMBER, COUNT, SIZED):
      limit = MAX_NUMBER if leaf.kind == NUMBER else MAX_COUNT
      low, high = pc.min_max(column).values()
      if low.is_valid and (low.as_py() < 0 or high.as_py() > limit):
        raise _Refused()
      if leaf.kind == NUMBER and pc.any(pc.is_nan(column)).as_py():
        raise _Refused()
    if not column.null_count or (leaf.maybe and leaf.optional == leaf.path[-1]):
      continue
    rows = np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))
    fine = np.zeros(len(rows), dtype=bool)
    if leaf.maybe:
      fine |= lines.has(leaf.path[-1], rows)
    if leaf.optional is not None:
      fine |= ~lines.has(leaf.optional, rows)
    if leaf.added > 1:
      fine |= (version[rows] < leaf.added) & ~lines.has(leaf.path[0], rows)
    if not fine.all():
      raise _Refused()
  if role.role == TRAINER:
    place = pc.add(flat["place.staged"], flat["place.inline"])
    if pc.any(pc.greater(place, flat["place.count"])).as_py():
      raise _Refused()
  return flat


def _line_by_line(path: str, first: int, lines: list[bytes]) -> dict[str, list[dict[str, Any]]]:
  """The block's records read by json and checked by `check` (RecordError at the first one that
  is wrong), by role."""
  out: dict[str, list[dict[str, Any]]] = {}
  for n, raw in enumerate(lines, start=first):
    where = f"{path}:{n}"
    record = _decode(where, raw)
    check(where, record)
    out.setdefault(record["role"], []).append(_tabled(record))
  return out


def _tabled(value: Any) -> Any:
  """A checked record as a table holds it: a setting carried as `auto` (no choice made yet) not
  known (null); a text that is not Unicode (a lone surrogate, which JSON can say) with the code
  point it held written out."""
  if isinstance(value, dict):
    return {k: None if k in _SIZED_SETTINGS and v == config_lib.AUTO else _tabled(v)
            for k, v in value.items()}
  if isinstance(value, str) and not value.isascii():
    return value.encode("utf-8", "backslashreplace").decode("utf-8")
  return value


_SIZED_SETTINGS = {s.field for s in record_lib.CARRIED if config_lib.AUTO in s.accepted}


# --- a role's table: the record's fields by the figures' names --------------------------------

# The record's own fields (what tells its process, run and step), by their column's name.
IDENTITY = {"role": ("role",), "host": ("host",), "hostname": ("process", "hostname"),
            "pid": ("process", "pid"), "run": ("run", "id"), "run_started": ("run", "started"),
            "time": ("time",), "step": ("step",),
            **{s.field: ("settings", s.field) for s in record_lib.CARRIED}}
TEXTS = ("role", "host", "hostname", "run", "codec", "bound_by", "sizing", "file")


def _compact(name: str, column: pa.ChunkedArray, absent: Any) -> pa.ChunkedArray:
  """A column as the table keeps it: a text as codes into its values, an integer in the fewest
  bytes that hold this block's values (a null: a float's NaN, exact up to 2**53), a family's
  name absent from a step as `absent`."""
  if absent is not None and column.null_count:
    column = pc.fill_null(column, absent)
  if name in TEXTS:
    return pc.dictionary_encode(column)
  if pa.types.is_integer(column.type):
    if column.null_count:
      return column.cast(pa.float64())
    high = pc.max(column).as_py() or 0
    for kind in (pa.int8(), pa.int16(), pa.int32()):
      if high <= np.iinfo(kind.to_pandas_dtype()).max:
        return column.cast(kind)
  return column


def _block(role: str, flat: dict[str, pa.ChunkedArray], file: int) -> pa.Table:
  out = {}
  for name, path in IDENTITY.items():
    out[name] = _compact(name, flat[".".join(path)], None)
  for f in figures_lib.BY_ROLE[role].values():
    if f.path:
      out[f.name] = _compact(f.name, flat[".".join(f.path)], f.absent)
  rows = len(flat["step"])
  out["file"] = pa.chunked_array([pa.array(np.full(rows, file, dtype=np.int16))])
  return pa.table(out)


# --- reading files ----------------------------------------------------------------------------

_KINDS = ((stat.S_ISFIFO, "a named pipe"), (stat.S_ISDIR, "a folder"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"))


def _kind(mode: int) -> str:
  return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def files(paths: Iterable[str], notes: list[str] | None = None) -> list[tuple[str, str]]:
  """The record files `paths` name, each with the path given it came from (a file as given, a
  folder's *.jsonl files). An entry of a folder that is not a regular file is skipped, never
  opened (a named pipe's open would wait for a writer), and said in `notes` where given; a path
  given that is not a regular file is refused. A file given twice is read once."""
  out: list[tuple[str, str]] = []
  seen: set[str] = set()
  notes = [] if notes is None else notes

  def add(path: str, source: str) -> None:
    if os.path.realpath(path) not in seen:
      seen.add(os.path.realpath(path))
      out.append((path, source))

  for path in paths:
    try:
      mode = os.stat(path).st_mode
    except OSError:
      raise _error(path, PATHS_ACCEPTED, "no such file or folder") from None
    if stat.S_ISDIR(mode):
      found = 0
      for name in sorted(n for n in os.listdir(path) if n.endswith(record_lib.SUFFIX)):
        entry = os.path.join(path, name)
        try:
          kind = os.stat(entry).st_mode
        except OSError as e:
          notes.append(f"{entry}: skipped: cannot be read ({e.strerror or e})")
          continue
        if stat.S_ISREG(kind):
          add(entry, path)
          found += 1
        else:
          notes.append(f"{entry}: skipped: {_kind(kind)}, not a record file")
      if not found:
        raise _error(path, PATHS_ACCEPTED,
                     f"a folder with no metrics record in it (*{record_lib.SUFFIX})")
    elif stat.S_ISREG(mode):
      add(path, path)
    else:
      raise _error(path, PATHS_ACCEPTED, f"not a regular file ({_kind(mode)})")
  return out


def _blocks(path: str, f: Any) -> Iterator[tuple[_Lines | None, bytes]]:
  """The file's whole lines, a block at a time: (the lines, b""); last, its last line without a
  newline, if any: (None, the line). A line longer than MAX_LINE is refused as soon as it is."""
  n, rest = 1, b""
  while True:
    data = f.read(BLOCK)
    if not data:
      break
    data = rest + data
    ends = np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == ord("\n"))
    lengths = np.diff(ends, prepend=-1) - 1
    rest = data[ends[-1] + 1:] if len(ends) else data
    if len(rest) > MAX_LINE or (len(ends) and lengths.max() > MAX_LINE):
      long = np.flatnonzero(lengths > MAX_LINE)
      at = n + (int(long[0]) if len(long) else len(ends))
      raise _error(f"{path}:{at}", LINES_ACCEPTED, f"a line of more than {MAX_LINE} bytes")
    if len(ends):
      yield _Lines(n, data[:ends[-1] + 1], ends), b""
      n += len(ends)
  if rest.strip():
    yield _Lines(n, b"", np.zeros(0, dtype=np.int64)), rest


class _File:
  """One record file read into blocks of each role's table; `note` says when its last line was
  cut short: a process killed while writing it, or one still writing it (modified within
  WRITING_S)."""

  def __init__(self, path: str, index: int) -> None:
    self.path, self.index = path, index
    self.note: str | None = None
    self.count = 0
    self.blocks: dict[str, list[pa.Table]] = {}

  def read(self) -> None:
    try:
      f = open(self.path, "rb")  # pylint: disable=consider-using-with
    except OSError as e:
      raise _error(self.path, LINES_ACCEPTED, f"cannot be read ({e.strerror or e})") from None
    with f:
      role: str | None = None
      for lines, last in _blocks(self.path, f):
        if last:  # its last line, without its newline
          try:
            self._add(self._checked(lines.first, [last]))
          except RecordError:
            self.note = self._cut(os.fstat(f.fileno()).st_mtime)
          continue
        if role is None:  # the role a file's records are of: its first record's
          where = f"{self.path}:{lines.first}"
          first_record = _decode(where, lines.data[:lines.ends[0]])
          check(where, first_record)
          role = first_record["role"]
        self._add(self._read(role, lines))
    if not self.count and self.note is None:
      raise _error(self.path, LINES_ACCEPTED, "holds no record")

  def _read(self, role: str, lines: _Lines) -> dict[str, pa.Table]:
    """A block of whole lines: pyarrow's reading where its columns' check passes them, else
    check()'s, line by line."""
    try:
      table = pa_json.read_json(
          pa.BufferReader(lines.data),
          read_options=pa_json.ReadOptions(block_size=2 * MAX_LINE + 2),
          parse_options=pa_json.ParseOptions(explicit_schema=_ROLES[role].schema,
                                             unexpected_field_behavior="infer"),
          memory_pool=_POOL)
      return {role: _block(role, _columns(_ROLES[role], table, lines), self.index)}
    except (pa.ArrowInvalid, _Refused):
      return self._checked(lines.first, lines.split())

  def _checked(self, first: int, lines: list[bytes]) -> dict[str, pa.Table]:
    out = {}
    for role, records in _line_by_line(self.path, first, lines).items():
      table = pa.Table.from_pylist(records, schema=_ROLES[role].schema)
      out[role] = _block(role, _flat(table), self.index)
    return out

  def _add(self, tables: dict[str, pa.Table]) -> None:
    for role, table in tables.items():
      self.blocks.setdefault(role, []).append(table)
      self.count += table.num_rows

  def _cut(self, modified: float) -> str:
    ago = time.time() - modified
    why = (f"is still being written (the file changed {max(ago, 0):.0f} s ago)"
           if ago < WRITING_S else "is cut short (the process was killed while writing it)")
    return f"{self.path}: its last line {why}; read the {self.count} whole record(s) before it"


@dataclasses.dataclass
class Records:
  """What record files hold: per role, its steps as a DataFrame (a row per process and step, in
  each process's step order; `file` an index into `files`); each file's path given (`sources`);
  notes on what was skipped or cut short."""

  steps: dict[str, pd.DataFrame]
  files: tuple[str, ...]
  sources: tuple[str, ...]
  notes: list[str]


def derive(role: str, frame: pd.DataFrame) -> pd.DataFrame:
  """`frame` with the role's derived figures (figures.FIGURES' `derive`) as columns."""
  for f in figures_lib.BY_ROLE[role].values():
    if f.derive is not None:
      value = f.derive(frame.__getitem__)
      frame[f.name] = (np.asarray(value, dtype=np.int8) if f.unit == figures_lib.COUNT
                       else np.asarray(value, dtype=np.float64))
  return frame


def empty(role: str) -> pd.DataFrame:
  """A table of `role` with no step."""
  return _frame(role, [])


def _frame(role: str, blocks: list[pa.Table]) -> pd.DataFrame:
  if not blocks:
    none = _block(role, _flat(pa.Table.from_pylist([], schema=_ROLES[role].schema)), 0)
    return derive(role, none.to_pandas())
  table = pa.concat_tables(blocks, promote_options="permissive")
  frame = table.to_pandas(self_destruct=True, split_blocks=True)
  del table
  # Each process's steps together and in step order (a file's lines are; sorted where not).
  keys = ["hostname", "pid", "run"]
  group = frame.groupby(keys, sort=False, dropna=False, observed=True).ngroup().to_numpy()
  changes, step = np.diff(group) != 0, frame["step"].to_numpy()
  if changes.sum() != group.max(initial=0) or not ((np.diff(step) > 0) | changes).all():
    frame = frame.sort_values([*keys, "step"], kind="stable", ignore_index=True,
                              na_position="first")
  return derive(role, frame)


def read(paths: Iterable[str]) -> Records:
  """The records `paths` name (a folder TUNIX_STAGE_METRICS named, or record files). Raises
  RecordError (one line: the file, the line, the field) for a path or a record that cannot be
  read."""
  notes: list[str] = []
  found = files(paths, notes)
  blocks: dict[str, list[pa.Table]] = {role: [] for role in record_lib.ROLES}
  for index, (path, _) in enumerate(found):
    one = _File(path, index)
    one.read()
    for role, tables in one.blocks.items():
      blocks[role] += tables
    if one.note is not None:
      notes.append(one.note)
  return Records({role: _frame(role, tables) for role, tables in blocks.items()},
                 tuple(p for p, _ in found), tuple(s for _, s in found), notes)


def of_records(records: Iterable[dict[str, Any]]) -> dict[str, pd.DataFrame]:
  """Records already in memory (a process's own, as core.telemetry.record.make made them), per
  role, as `read` gives a file's: each checked first."""
  by_role: dict[str, list[dict[str, Any]]] = {role: [] for role in record_lib.ROLES}
  for n, rec in enumerate(records, start=1):
    check(f"record {n}", rec)
    by_role[rec["role"]].append(_tabled(rec))
  return {role: _frame(role, [_block(role, _flat(pa.Table.from_pylist(
      recs, schema=_ROLES[role].schema)), 0)] if recs else [])
          for role, recs in by_role.items()}
