"""A run's step figures as columns: what the summary, the advice, report A B and the picture read,
kept at a few bytes a step a figure (8), so that a record of any length is summarized in memory
its steps bound, never its records. The columns are the record's own fields (record.SHAPES, the
one table): a number or a count per field, a text as a code into its values, an object of any
fields (`{"*": ...}`: a step's transports, its fallbacks by kind) as a column per field it was
seen to hold. docs/observability.md "Any length".
"""

from __future__ import annotations

import functools
import math
import operator
from array import array
from typing import Any, Callable, Iterable, Sequence

from tunix_stage_plugin.core.telemetry import record as record_lib

NULL = -1  # a count column's null (a count is >= 0); a number column's is NaN
# The common fields a step's columns hold (the others name its process and run: runs.py).
COMMON = ("time", "step")
# The text fields kept as columns: a code a step into their few values. Another text (words
# that may differ every step) is no figure: the records shown hold it.
TEXTS = ("bound_by",)


def _leaf(shape: Any) -> Any:
  return shape.shape if isinstance(shape, record_lib.Maybe) else shape


def _code(kind: Any) -> str:
  return "d" if kind == record_lib.NUMBER else "q"


class _Family:
  """The columns of one object of any fields (`{"*": shape}`), a column per field (and per part
  of it, its optional parts aside) it was seen to hold, 0 in a step that lacks it."""

  def __init__(self, shape: Any) -> None:
    shape = _leaf(shape["*"])
    self.parts = (tuple((k, _code(_leaf(s))) for k, s in shape.items() if not k.startswith("?"))
                  if isinstance(shape, dict) else None)
    self.code = _code(shape)
    self.columns: dict[str, Any] = {}  # field -> array, or {part: array}
    self._appends: dict[str, Any] = {}  # field -> its append, or ((part, append), ...)
    self.rows = 0

  def add(self, value: dict[str, Any] | None) -> None:
    rows, appends = self.rows, self._appends
    self.rows = rows + 1
    for key, item in (value or {}).items():
      append = appends.get(key)
      if append is None:
        append = self._column(key, rows)
      if self.parts is None:
        append(item)
      else:
        for part, each in append:
          each(item[part])
    if len(value or ()) != len(appends):  # the fields this step lacks
      for column in self.columns.values():
        for c in (column,) if self.parts is None else column.values():
          if len(c) == rows:
            c.append(0)

  def _column(self, key: str, rows: int) -> Any:
    if self.parts is None:
      column = self.columns[key] = array(self.code, bytes(8 * rows))
      append = self._appends[key] = column.append
    else:
      columns = self.columns[key] = {p: array(c, bytes(8 * rows)) for p, c in self.parts}
      append = self._appends[key] = tuple((p, c.append) for p, c in columns.items())
    return append


class Steps:
  """One role's figures over a run's steps (or a part of them), a column per field of its record
  (named by its path, `input_wait_s.mid_step`), in step order; `last`: the record of its last
  step, whole (what names its settings and host)."""

  def __init__(self, role: str, columns: dict[str, array], texts: dict[str, list[str]],
               families: dict[str, dict[str, Any]], last: dict[str, Any] | None) -> None:
    self.role, self.columns, self.texts, self.families = role, columns, texts, families
    self.last = last

  def __len__(self) -> int:
    return len(self.columns["step"])

  def values(self, name: str, rows: Sequence[int] | None = None) -> Sequence[Any]:
    """Column `name` (at `rows`, or every step): its array where it holds no null, else a list
    with None where the record said null (a text's column: its texts)."""
    column = self.columns[name] if rows is None else _pick(self.columns[name], rows)
    if name in self.texts:
      words = self.texts[name]
      return [None if c == NULL else words[c] for c in column]
    if column.typecode == "q":
      return [None if v == NULL else v for v in column] if NULL in column else column
    return [None if v != v else v for v in column] if any(map(math.isnan, column)) else column

  def family(self, name: str) -> dict[str, Any]:
    """An object of any fields (`receive.by_transport`), per field its column (or per part)."""
    return self.families[name]

  def take(self, rows: Sequence[int]) -> "Steps":
    """The steps at `rows` (in that order); their `last` is not known here (None)."""
    pick = lambda c: _pick(c, rows)  # noqa: E731
    return Steps(self.role, {k: pick(c) for k, c in self.columns.items()}, self.texts,
                 {k: {f: (pick(c) if isinstance(c, array) else {p: pick(a) for p, a in c.items()})
                      for f, c in fam.items()} for k, fam in self.families.items()}, None)

  @classmethod
  def of(cls, role: str, records: Iterable[dict[str, Any]]) -> "Steps":
    """The columns of `role`'s records (checked ones: record.Reader's, or record.make's)."""
    builder = Builder(role)
    for rec in records:
      builder.add(rec)
    return builder.steps()

  @classmethod
  def joined(cls, role: str, parts: Sequence["Steps"]) -> "Steps":
    """`parts` one after the other (a run's processes of one role)."""
    if len(parts) == 1:
      return parts[0]
    empty = Builder(role).steps()
    columns, texts = {}, {}
    for name, column in empty.columns.items():
      if name in empty.texts:  # each part's codes as codes into the values of them all
        words: dict[str, int] = {}
        for part in parts:
          codes = [words.setdefault(w, len(words)) for w in part.texts[name]]
          column.extend(NULL if c == NULL else codes[c] for c in part.columns[name])
        texts[name] = list(words)
      else:
        for part in parts:
          column.extend(part.columns[name])
      columns[name] = column
    families: dict[str, dict[str, Any]] = {}
    for name in empty.families:
      fields = dict.fromkeys(f for part in parts for f in part.families[name])
      families[name] = {field: _joined([(part.families[name].get(field), len(part))
                                        for part in parts]) for field in fields}
    return cls(role, columns, texts, families, parts[-1].last)


def _joined(pieces: list[tuple[Any, int]]) -> Any:
  """A family's field over parts (None: a part that lacks it, 0 in each of its steps)."""
  sample = next(p for p, _ in pieces if p is not None)
  if isinstance(sample, dict):
    return {k: _joined([(None if p is None else p[k], n) for p, n in pieces]) for k in sample}
  out = array(sample.typecode)
  for piece, rows in pieces:
    out.extend(piece if piece is not None else array(sample.typecode, bytes(8 * rows)))
  return out


def _pick(column: array, rows: Sequence[int]) -> array:
  """`column` at `rows`: a slice where they are a range (analysis.judged's, where they run on)."""
  if isinstance(rows, range) and rows.step == 1:
    return column[rows.start:rows.stop]
  if len(rows) == 1:
    return array(column.typecode, [column[rows[0]]])
  return array(column.typecode, operator.itemgetter(*rows)(column)) if rows else \
      array(column.typecode)


class Builder:
  """Columns made a record at a time (record.SHAPES' fields, by one function made from them)."""

  def __init__(self, role: str) -> None:
    self.role = role
    self.columns: dict[str, array] = {}
    self._words: dict[str, dict[str, int]] = {}
    self._families: dict[str, _Family] = {}
    self._appends: dict[str, Callable[[Any], None]] = {}
    self.last: dict[str, Any] | None = None
    shape = {k: v for k, v in record_lib.SHAPES["common"].items() if k in COMMON}
    self._add = _compile(shape | record_lib.SHAPES[role], self)

  def add(self, rec: dict[str, Any]) -> None:
    self._add(rec)
    self.last = rec

  def steps(self) -> Steps:
    return Steps(self.role, self.columns, {k: list(w) for k, w in self._words.items()},
                 {k: f.columns for k, f in self._families.items()}, self.last)

  def column(self, name: str, kind: Any) -> Callable[[Any], None]:
    """Column `name`'s append (made on the first ask: a null object's and its fields' share it)."""
    if name not in self._appends:
      column = self.columns[name] = array(_code(kind))
      if kind == record_lib.TEXT:
        words = self._words[name] = {}
        self._appends[name] = lambda w: column.append(
            NULL if w is None else words.setdefault(w, len(words)))
      else:
        self._appends[name] = column.append
    return self._appends[name]

  def family(self, name: str, shape: Any) -> Callable[[Any], None]:
    if name not in self._families:
      self._families[name] = _Family(shape)
    return self._families[name].add


def _compile(shape: dict[str, Any], builder: Builder) -> Callable[[dict[str, Any]], None]:
  """One function that appends a record's fields to `builder`'s columns: written out from
  `shape` (a function a field costs four times its time at 200,000 steps)."""
  names: dict[str, Any] = {"nan": math.nan, "NULL": NULL}
  lines: list[str] = []

  def nulls(shape: Any, path: str, indent: str) -> None:  # a null object: each column null
    for key, sub in shape.items():
      name = f"{path}.{key.removeprefix('?')}"
      sub = _leaf(sub)
      if isinstance(sub, dict) and "*" in sub:
        lines.append(f"{indent}{ref(builder.family(name, sub))}(None)")
      elif isinstance(sub, dict):
        nulls(sub, name, indent)
      elif sub != record_lib.TEXT or name in TEXTS:
        lines.append(f"{indent}{ref(builder.column(name, sub))}({_null(sub)})")

  def ref(value: Any) -> str:
    names[f"_{len(names)}"] = value
    return f"_{len(names) - 1}"

  def walk(shape: dict[str, Any], var: str, path: str, indent: str) -> None:
    for key, sub in shape.items():
      field = key.removeprefix("?")
      name = f"{path}{field}"
      maybe = key.startswith("?") or isinstance(sub, record_lib.Maybe)
      get = f"{var}.get({field!r})" if key.startswith("?") else f"{var}[{field!r}]"
      sub = _leaf(sub)
      if isinstance(sub, dict) and "*" in sub:
        lines.append(f"{indent}{ref(builder.family(name, sub))}({get})")
      elif isinstance(sub, dict):
        inner = f"v{len(lines)}"
        lines.append(f"{indent}{inner} = {get}")
        if maybe:
          lines.append(f"{indent}if {inner} is None:")
          nulls(sub, name, indent + "  ")
          lines.append(f"{indent}else:")
          walk(sub, inner, name + ".", indent + "  ")
        else:
          walk(sub, inner, name + ".", indent)
      elif sub != record_lib.TEXT or name in TEXTS:
        append = ref(builder.column(name, sub))
        if maybe and sub != record_lib.TEXT:
          lines.append(f"{indent}v = {get}; {append}({_null(sub)} if v is None else v)")
        else:
          lines.append(f"{indent}{append}({get})")

  walk(shape, "r", "", "  ")
  exec(_code_of("def add(r):\n" + "\n".join(lines) + "\n"), names)  # pylint: disable=exec-used
  return names["add"]


@functools.lru_cache(maxsize=8)
def _code_of(source: str) -> Any:
  """`source` compiled once (a pipeline sizing itself makes columns of a few records a step)."""
  return compile(source, "<record columns>", "exec")


def _null(kind: Any) -> str:
  return {record_lib.NUMBER: "nan", record_lib.TEXT: "None"}.get(kind, "NULL")
