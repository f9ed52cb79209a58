"""`tunix-stage report --png FILE`: the job drawn, since people read a picture of the steps faster
than a table. Per trainer step one stacked bar of where the step went: the compute (the slowdown
beside transfers hatched inside it), the other compute-lane calls, the input wait at the boundary
and mid-step; the step's own micro-batches, staged and inline, counted above it (the
orchestrator's count of the step it trained; a first step marked as the compile it is). One panel
per run, side by side on one y scale, in the format FILE's name asks (matplotlib's; the `report`
extra), which is checked before any record is read. docs/observability.md "The picture".
"""

from __future__ import annotations

import importlib.util
import os
import textwrap
from typing import Sequence

import numpy as np
import pandas as pd

from tunix_stage_plugin.core import inputs
from tunix_stage_plugin.core import install_hint
from tunix_stage_plugin.reading import runs as runs_lib
from tunix_stage_plugin.reading import summary as summary_lib

EXTRA = "report"  # the package's extra that installs matplotlib (and pandas, pyarrow)
# The formats matplotlib writes, by file name ending (its savefig's): a name is refused with
# another, or none, rather than written as PNG under it.
FORMATS = {"png": "PNG", "svg": "SVG", "svgz": "SVG (compressed)", "pdf": "PDF",
           "eps": "EPS", "ps": "PostScript", "jpg": "JPEG", "jpeg": "JPEG", "tif": "TIFF",
           "tiff": "TIFF", "webp": "WebP"}
FORMATS_SAID = ", ".join(f".{s}" for s in FORMATS)
ACCEPTED = f"a file to write whose name ends in {FORMATS_SAID}"

# (label, colour, hatch) of each part of a bar, bottom to top.
PARTS = (
    ("compute", "#1f77b4", None),
    ("compute's slowdown beside transfers", "#1f77b4", "////"),
    ("other calls (weight sync, ...)", "#9e9e9e", None),
    ("input wait at the boundary", "#ff7f0e", None),
    ("input wait mid-step", "#d62728", None),
)
MAX_COUNTED = 40  # steps a panel may hold with the micro-batch counts above its bars


def refusal(path: str) -> str | None:
  """Why `path` cannot take the picture (one line: what is wrong and what is accepted), or
  None; asked before any record is read."""
  folder = os.path.dirname(os.path.abspath(path)) if path else ""
  suffix = os.path.splitext(path)[1].lower().lstrip(".")
  why = ("an empty name" if not path else
         "a folder" if os.path.isdir(path) else
         "its folder is not a folder that exists" if not os.path.isdir(folder) else
         "not writable" if not os.access(path if os.path.exists(path) else folder, os.W_OK) else
         f"a name ending in {'.' + suffix if suffix else 'no suffix'}, not a format matplotlib "
         "writes" if suffix not in FORMATS else None)
  if why is not None:
    return inputs.invalid("--png", path, ACCEPTED, why)
  try:
    found = importlib.util.find_spec("matplotlib") is not None
  except ImportError:  # a finder that refuses it
    found = False
  if not found:
    return inputs.invalid("--png", path, ACCEPTED, f"matplotlib is not installed; install the "
                          f"'{EXTRA}' extra: {install_hint.install_command(EXTRA)}")
  return None


def parts(trainer: pd.DataFrame) -> np.ndarray:
  """Each trainer step's bar, bottom to top (PARTS), a row a step: the parts add up to it."""
  compute = trainer["compute_s"].to_numpy()
  slowdown = np.nan_to_num(trainer["slowdown_s"].to_numpy())
  return np.column_stack([np.maximum(0.0, compute - slowdown), np.minimum(slowdown, compute),
                          trainer["other_s"], np.nan_to_num(trainer["input_wait_boundary_s"]),
                          trainer["input_wait_mid_step_s"]])


def counts(run: runs_lib.Run) -> list[str]:
  """Above each trainer step's bar: the micro-batches of the step it trained, staged `s` and
  inline `i`, as the orchestrator counted them (its step that ran the same train step, where
  both number it; else the same step), `n` where no orchestrator step says; a first step is
  the compile it is."""
  trainer, orchestrator = run.trainer_steps, run.orchestrator_steps
  keyed = orchestrator.dropna(subset=["host_step"]).drop_duplicates("host_step", keep="last")
  by_host_step = dict(zip(keyed["host_step"], zip(keyed["staged"], keyed["inline"])))
  by_step = dict(zip(orchestrator["step"], zip(orchestrator["staged"], orchestrator["inline"])))
  out = []
  for step, host_step, microbatches, first in zip(
      trainer["step"], trainer["host_step"], trainer["microbatches"],
      summary_lib.first_steps(trainer)):
    found = by_host_step.get(host_step) if by_host_step else by_step.get(step)
    said = f"{microbatches}n" if found is None else f"{found[0]}s\n{found[1]}i"
    out.append(f"{said}\ncompile" if first else said)
  return out


def draw(path: str, runs: Sequence[runs_lib.Run]) -> str | None:
  """Draws `runs` (each with its `label` and `trainer_steps`) to `path`, in the format its name
  asks (refusal() checked it first); the one line of why not, or None."""
  try:
    _draw(path, runs)
  except (OSError, ValueError) as e:
    return inputs.invalid("--png", path, ACCEPTED, f"{type(e).__name__}: {e}")
  return None


def _draw(path: str, runs: Sequence[runs_lib.Run]) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  from matplotlib import patches  # pylint: disable=import-outside-toplevel
  from matplotlib import pyplot as plt  # pylint: disable=import-outside-toplevel
  steps = max(len(run.trainer_steps) for run in runs)
  # Wide enough for the legend and the titles (a run's label says its start, processes and
  # settings: wrapped to its panel), wider with more steps.
  width = min(10.0, max(7.0, 1.5 + 0.35 * steps))
  fig, axes = plt.subplots(1, len(runs), figsize=(width * len(runs), 5.2), sharey=True,
                           squeeze=False)
  bars = [parts(run.trainer_steps) for run in runs]
  top = max((float(b.sum(axis=1).max()) for b in bars if len(b)), default=1.0) or 1.0
  for ax, run, run_bars in zip(axes[0], runs, bars):
    x = run.trainer_steps["step"].to_numpy()
    bottom = np.zeros(len(x))
    for n, (_, colour, hatch) in enumerate(PARTS):
      ax.bar(x, run_bars[:, n], bottom=bottom, width=0.8, color=colour, hatch=hatch,
             edgecolor="white" if hatch else colour, linewidth=0.0 if not hatch else 0.5)
      bottom = bottom + run_bars[:, n]
    if len(x) <= MAX_COUNTED:
      for step, height, said in zip(x, bottom, counts(run)):
        ax.text(step, height + top * 0.01, said, ha="center", va="bottom", fontsize=6,
                linespacing=0.9)
    summary = summary_lib.summary(run.trainer_steps, run.orchestrator_steps)["trainer"]
    ax.set_title(textwrap.fill(f"{run.label or 'the job'}: median step {summary['step_s']:.2f} "
                               f"s, input wait {summary['input_wait_s']:.2f} s",
                               width=int(width * 11)), fontsize=8, loc="left")
    ax.set_xlabel("trainer step")
    ax.set_xticks(x if len(x) <= MAX_COUNTED else x[::max(1, len(x) // 20)])
    ax.tick_params(labelsize=7)
    ax.grid(axis="y", linewidth=0.3)
    ax.set_axisbelow(True)
  axes[0][0].set_ylabel("seconds (the step's parts)")
  axes[0][0].set_ylim(0, top * 1.15)
  handles = [patches.Patch(facecolor=colour, hatch=hatch, edgecolor="white", label=label)
             for label, colour, hatch in PARTS]
  fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=7, frameon=False)
  fig.suptitle("where each trainer step went (above each bar: the step's micro-batches staged "
               "s, inline i)", fontsize=9)
  fig.tight_layout(rect=(0, 0.1, 1, 0.95))
  try:
    fig.savefig(path, dpi=100, format=os.path.splitext(path)[1].lower().lstrip("."))
  finally:
    plt.close(fig)
