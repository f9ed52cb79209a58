"""`tunix-stage report --png FILE`: the job drawn, since people read a picture of the steps faster
than a table. Per trainer step one stacked bar of where the step went: the compute (the slowdown
beside transfers hatched inside it), the other compute-lane calls, the input wait at the boundary
and mid-step; the step's staged and inline micro-batches counted above it. One panel per run,
side by side on one y scale. In the lab because matplotlib is a lab library (the `bench` extra);
report_cmd loads this module only for --png. docs/observability.md "The picture".
"""

from __future__ import annotations

import textwrap
from typing import Sequence

from tunix_stage_plugin.core import inputs
from tunix_stage_plugin.core.telemetry import analysis
from tunix_stage_plugin.core.telemetry import runs as runs_lib
from tunix_stage_plugin.core.telemetry import steps as steps_lib

# (label, colour, hatch) of each part of a bar, bottom to top.
PARTS = (
    ("compute", "#1f77b4", None),
    ("compute's slowdown beside transfers", "#1f77b4", "////"),
    ("other calls (weight sync, ...)", "#9e9e9e", None),
    ("input wait at the boundary", "#ff7f0e", None),
    ("input wait mid-step", "#d62728", None),
)
MAX_COUNTED = 40  # steps a panel may hold with the micro-batch counts above its bars


class PictureError(RuntimeError):
  """The picture cannot be drawn: matplotlib is not installed, or no run holds a trainer step."""


def parts(trainer: steps_lib.Steps) -> list[tuple[float, ...]]:
  """Each trainer step's bar, bottom to top (PARTS): the parts add up to the step."""
  return [(max(0.0, compute - (slowdown or 0.0)), min(slowdown or 0.0, compute), other,
           boundary or 0.0, mid)
          for compute, slowdown, other, boundary, mid in zip(*(trainer.values(name) for name in (
              "compute_s", "compute.slowdown_s", "other_s", "input_wait_s.boundary",
              "input_wait_s.mid_step")))]


def draw(path: str, runs: Sequence[runs_lib.Run]) -> None:
  """Draws `runs` (each with its `label` and `trainer_steps`) to the PNG file `path`."""
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    from matplotlib import patches  # pylint: disable=import-outside-toplevel
    from matplotlib import pyplot as plt  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    from tunix_stage_plugin.core import install_hint  # pylint: disable=import-outside-toplevel
    raise PictureError(f"--png needs matplotlib ({e}); install the 'bench' extra: "
                       f"{install_hint.install_command('bench')}") from None
  if not any(len(run.trainer_steps) for run in runs):
    raise PictureError(inputs.invalid("--png", path, "records holding a trainer's steps (the "
                                      "picture draws them)", "these records hold no trainer step"))
  steps = max(len(run.trainer_steps) for run in runs)
  # Wide enough for the legend and the titles (a run's label says its start, processes and
  # settings: wrapped to its panel), wider with more steps.
  width = min(10.0, max(7.0, 1.5 + 0.35 * steps))
  fig, axes = plt.subplots(1, len(runs), figsize=(width * len(runs), 5.2), sharey=True,
                           squeeze=False)
  bars = [parts(run.trainer_steps) for run in runs]
  top = max((sum(bar) for run_bars in bars for bar in run_bars), default=1.0) or 1.0
  for ax, run, run_bars in zip(axes[0], runs, bars):
    x = run.trainer_steps.values("step")
    bottom = [0.0] * len(x)
    for n, (_, colour, hatch) in enumerate(PARTS):
      heights = [bar[n] for bar in run_bars]
      ax.bar(x, heights, bottom=bottom, width=0.8, color=colour, hatch=hatch,
             edgecolor="white" if hatch else colour, linewidth=0.0 if not hatch else 0.5)
      bottom = [b + h for b, h in zip(bottom, heights)]
    if len(x) <= MAX_COUNTED:
      for step, height, staged, inline in zip(x, bottom, run.trainer_steps.values("place.staged"),
                                              run.trainer_steps.values("place.inline")):
        ax.text(step, height + top * 0.01, f"{staged}s\n{inline}i",
                ha="center", va="bottom", fontsize=6, linespacing=0.9)
    summary = analysis.summary(run.trainer_steps, run.orchestrator_steps)["trainer"]
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
  fig.suptitle("where each trainer step went (above each bar: micro-batches staged s, "
               "inline i)", fontsize=9)
  fig.tight_layout(rect=(0, 0.1, 1, 0.95))
  try:
    fig.savefig(path, dpi=100, format="png")
  finally:
    plt.close(fig)
