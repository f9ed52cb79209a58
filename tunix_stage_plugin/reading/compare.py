"""`tunix-stage report A B`: two runs side by side, so a user reads whether the setting they changed
helped beyond the step-to-step noise, not from two medians alone.

Each figure is one the figures' table marks `compared` (core/telemetry/figures.py: the scalars
the dashboards show, under the same names, and the step's whole input wait); its median per run,
the change, and a verdict: a two-sided Mann-Whitney U test at 5 % on the two runs' steps when
both have at least MIN_STEPS (the steps the summary judges: a first step, which compiles, left
out where there are others), else "too few steps to tell". Each run's summary (what bounded its
steps, what staging hid, what to change) is `report`'s. docs/observability.md "Comparing two
runs".
"""

from __future__ import annotations

import json
import math
import statistics
from typing import Any

import numpy as np

from tunix_stage_plugin.core.telemetry import figures as figures_lib
from tunix_stage_plugin.reading import runs as runs_lib
from tunix_stage_plugin.reading import summary as summary_lib

MIN_STEPS = 5  # each run's steps the test needs; fewer: too few to tell
ALPHA = 0.05
BEYOND, WITHIN, TOO_FEW = "beyond the noise", "within the noise", "too few steps to tell"
ONE_RUN = "in one run only"  # a figure the other run has no step of (e.g. no orchestrator record)
TEST = (f"Mann-Whitney U, two-sided, at {ALPHA:.0%}, on each run's steps (a first step left out "
        f"where there are others; normal approximation with ties corrected); fewer than "
        f"{MIN_STEPS} steps in a run: {TOO_FEW}")
# The figures compared, each side's in the table's order: the trainer's whole input wait first.
FIGURES: tuple[figures_lib.Figure, ...] = tuple(sorted(
    (f for f in figures_lib.FIGURES if f.compared),
    key=lambda f: (f.role != figures_lib.TRAINER, f.name != "input_wait_s")))


def mann_whitney_p(a: list[float], b: list[float]) -> float:
  """The two-sided p-value of a Mann-Whitney U test of `a` against `b` (mid-ranks for ties, the
  normal approximation with the tie correction and a continuity correction); 1.0 where every
  value is the same."""
  values = sorted((v, side) for side, sample in ((0, a), (1, b)) for v in sample)
  ranks: list[float] = [0.0] * len(values)
  ties = 0.0
  i = 0
  while i < len(values):
    j = i
    while j + 1 < len(values) and values[j + 1][0] == values[i][0]:
      j += 1
    for k in range(i, j + 1):
      ranks[k] = (i + j) / 2 + 1
    t = j - i + 1
    ties += t ** 3 - t
    i = j + 1
  n1, n2 = len(a), len(b)
  n = n1 + n2
  u = sum(r for r, (_, side) in zip(ranks, values) if side == 0) - n1 * (n1 + 1) / 2
  variance = n1 * n2 / 12 * ((n + 1) - ties / (n * (n - 1)))
  if variance <= 0:
    return 1.0
  z = max(0.0, abs(u - n1 * n2 / 2) - 0.5) / math.sqrt(variance)
  return math.erfc(z / math.sqrt(2))


def compare(a: runs_lib.Run, b: runs_lib.Run, summaries: tuple[dict[str, Any], dict[str, Any]]
            ) -> dict[str, Any]:
  """The two runs' figures side by side, each change and its verdict, and each run's summary
  (`report`'s: report.summarize)."""
  figures = []
  for f in FIGURES:
    samples = []
    for run in (a, b):
      steps = run.steps(f.role)
      values = np.asarray(steps[f.name][summary_lib.judged(steps)], dtype=np.float64)
      samples.append(values[~np.isnan(values)].tolist())
    side, name = f.role, f.name
    if not samples[0] and not samples[1]:
      continue  # neither run knows it (e.g. no orchestrator records)
    medians = [statistics.median(s) if s else None for s in samples]
    change = pct = p = None
    verdict = ONE_RUN if None in medians else TOO_FEW
    if None not in medians:
      change = medians[1] - medians[0]
      pct = change / medians[0] if medians[0] else None
      if min(map(len, samples)) >= MIN_STEPS:
        p = mann_whitney_p(*samples)
        verdict = BEYOND if p < ALPHA else WITHIN
    figures.append({"side": side, "name": figures_lib.PREFIX + name, "a": medians[0],
                    "b": medians[1], "steps": [len(s) for s in samples], "change": change,
                    "change_pct": pct, "p": p, "verdict": verdict})
  return {"test": TEST,
          "runs": [{"label": run.label, "trainer_steps": len(run.trainer_steps),
                    "orchestrator_steps": len(run.orchestrator_steps),
                    "summary": summary}
                   for run, summary in zip((a, b), summaries)],
          "figures": figures}


def _n(value: float | int | None, seconds: bool = True, sign: str = "") -> str:
  """A figure as the table says it: seconds (and GiB/s) to the millisecond, counts as counts."""
  if value is None:
    return "-"
  return f"{value:{sign}.3f}" if seconds else f"{value:{sign}g}"


def _change(f: dict[str, Any]) -> str:
  if f["change"] is None:
    return "-"
  pct = "" if f["change_pct"] is None else f" ({f['change_pct']:+.0%})"
  return _n(f["change"], f["name"].endswith("_s"), "+") + pct


def _verdict(f: dict[str, Any]) -> str:
  return f["verdict"] + ("" if f["p"] is None else f" (p={f['p']:.3f})")


def text(result: dict[str, Any]) -> list[str]:
  a, b = result["runs"]
  out = [f"A: {a['label']} ({a['trainer_steps']} trainer steps, {a['orchestrator_steps']} "
         f"orchestrator steps)",
         f"B: {b['label']} ({b['trainer_steps']} trainer steps, {b['orchestrator_steps']} "
         f"orchestrator steps)",
         "medians a step (the first left out where there are others):"]
  rows = [["side", "figure", "A", "B", "change B - A", "verdict"]]
  rows += [[f["side"], f["name"], _n(f["a"], f["name"].endswith("_s")),
            _n(f["b"], f["name"].endswith("_s")), _change(f), _verdict(f)]
           for f in result["figures"]]
  widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
  out += ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
  out.append(f"noise: {result['test']}")
  for name, run in zip("AB", result["runs"]):
    trainer, staging = run["summary"].get("trainer"), run["summary"]["staging"]
    said = []
    if trainer is not None:
      said.append("bound by " + ", ".join(f"{k} in {n}" for k, n in trainer["bound_by"].items()
                                          if n) + " (steps)")
    if not staging["staged"]:
      said.append(f"did not stage: {staging['said']}")
    elif trainer is not None:
      said.append(f"staging hid {_n(trainer['hidden_s'])} s a step")
    if said:
      out.append(f"{name}: " + "; ".join(said))
    recommendations = run["summary"]["recommendations"]
    out.append(f"{name}: recommendation: " + ("; ".join(recommendations) if recommendations
                                               else "nothing to change"))
  return out


def run(a: runs_lib.Run, b: runs_lib.Run, *, summaries: tuple[dict[str, Any], dict[str, Any]],
        as_json: bool, notes: list[str]) -> int:
  """Prints the comparison of `a` and `b` (text, or one JSON object)."""
  result = compare(a, b, summaries)
  if as_json:
    print(json.dumps({**result, "notes": notes}, indent=2))
    return 0
  for note in notes:
    print(f"note: {note}")
  for line in text(result):
    print(line)
  return 0
