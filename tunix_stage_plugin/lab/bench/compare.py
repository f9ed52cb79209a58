"""`tunix-stage bench --compare A.json B.json`: two benchmark JSONs side by side, per mode.

Reads only the files (runs no benchmark, loads neither JAX nor gRPC). Per mode: the median step
(B/A), the hidden fraction (B - A), step / limit (B/A) and the fallbacks (B - A).
"""

from __future__ import annotations

import json
import math
from typing import Any


ACCEPTED = "a tunix-stage bench JSON (bench-out/bench.json) with at least one mode"
MAX_BYTES = 64 << 20  # far above a bench JSON (tens of KiB); a larger file is not one


class CompareError(ValueError):
  """A file that cannot be compared: `path` and why (the command words the one error line)."""

  def __init__(self, path: str, why: str) -> None:
    super().__init__(f"{path}: {why}")
    self.path, self.why = path, why


def load(path: str) -> dict[str, Any]:
  from tunix_stage_plugin.lab import inputs  # pylint: disable=import-outside-toplevel
  try:
    data = json.loads(inputs.read_file(path, ACCEPTED, MAX_BYTES).decode("utf-8-sig"))
  except inputs.Refused as e:
    raise CompareError(path, e.why or "unreadable") from None
  except UnicodeDecodeError as e:
    raise CompareError(path, f"not UTF-8 text (at byte {e.start})") from None
  except json.JSONDecodeError as e:
    raise CompareError(path, f"not JSON ({e.msg} at line {e.lineno})") from None
  except (ValueError, RecursionError) as e:  # a number of more than 4300 digits; deep nesting
    raise CompareError(path, f"not JSON that can be read ({type(e).__name__})") from None
  if not isinstance(data, dict) or not isinstance(data.get("modes"), dict):
    raise CompareError(path, 'not a tunix-stage bench JSON (no "modes" object)')
  if not data["modes"]:
    raise CompareError(path, 'no mode finished in this run ("modes" is empty)')
  for mode, figures in data["modes"].items():
    if not isinstance(figures, dict):
      raise CompareError(path, f"modes.{mode} is not an object")
  return data


def _number(value: Any) -> float | None:
  ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
  return float(value) if ok else None


def _ratio(a: float | None, b: float | None) -> str:
  return "-" if a is None or b is None or a == 0 else f"{b / a:.3f}x"


def _difference(a: float | None, b: float | None, spec: str) -> str:
  return "-" if a is None or b is None else format(b - a, "+" + spec)


def _fmt(value: float | None, spec: str) -> str:
  return "-" if value is None else format(value, spec)


def _describe(label: str, path: str, data: dict[str, Any]) -> str:
  meta = data.get("meta") if isinstance(data.get("meta"), dict) else {}
  options = data.get("options") if isinstance(data.get("options"), dict) else {}
  commit = meta.get("git_commit")
  parts = [meta.get("date_utc") or "no date (older JSON)",
           f"commit {commit[:10]}{' (dirty)' if meta.get('git_dirty') else ''}"
           if isinstance(commit, str) else None,
           meta.get("hostname"),
           f"M={options['microbatches']}" if "microbatches" in options else None,
           f"scenario {options['scenario']}" if "scenario" in options else None,
           "tiny" if options.get("tiny") else None,
           "interrupted" if data.get("interrupted") else None]
  return f"{label} = {path} ({', '.join(str(p) for p in parts if p)})"


COLUMNS = ("mode", "step s A", "step s B", "B/A", "hidden A", "hidden B", "B-A",
           "step/limit A", "step/limit B", "B/A", "fallbacks A", "fallbacks B", "B-A")


def format_compare(path_a: str, a: dict[str, Any], path_b: str, b: dict[str, Any]) -> str:
  rows = []
  both = [m for m in a["modes"] if m in b["modes"]]
  for mode in both:
    ma, mb = a["modes"][mode], b["modes"][mode]
    step = [_number(m.get("median_step_s")) for m in (ma, mb)]
    hidden = [_number(m.get("hidden_fraction")) for m in (ma, mb)]
    limit = [_number(m.get("step_over_limit")) for m in (ma, mb)]
    fallbacks = [_number(m.get("fallbacks")) for m in (ma, mb)]
    rows.append((mode, _fmt(step[0], ".3f"), _fmt(step[1], ".3f"), _ratio(*step),
                 _fmt(hidden[0], ".2f"), _fmt(hidden[1], ".2f"), _difference(*hidden, ".2f"),
                 _fmt(limit[0], ".3f"), _fmt(limit[1], ".3f"), _ratio(*limit),
                 _fmt(fallbacks[0], ".0f"), _fmt(fallbacks[1], ".0f"),
                 _difference(*fallbacks, ".0f")))
  lines = [_describe("A", path_a, a), _describe("B", path_b, b), ""]
  if rows:
    widths = [max(len(r[i]) for r in (COLUMNS, *rows)) for i in range(len(COLUMNS))]
    table = [COLUMNS, tuple("-" * w for w in widths), *rows]
    lines += ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                        for i, (cell, w) in enumerate(zip(row, widths))) for row in table]
  else:
    lines.append("no mode ran in both")
  only_a = [m for m in a["modes"] if m not in b["modes"]]
  only_b = [m for m in b["modes"] if m not in a["modes"]]
  if only_a:
    lines.append(f"only in A: {', '.join(only_a)}")
  if only_b:
    lines.append(f"only in B: {', '.join(only_b)}")
  return "\n".join(lines)


def compare(path_a: str, path_b: str) -> str:
  """The comparison's text; CompareError (one line) for a file that cannot be compared."""
  return format_compare(path_a, load(path_a), path_b, load(path_b))
