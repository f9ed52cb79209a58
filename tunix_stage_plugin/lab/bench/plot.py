"""The timeline picture: per mode, what the device computed and when micro-batches were staged."""

from __future__ import annotations

from typing import Sequence

from tunix_stage_plugin.lab.bench import results
from tunix_stage_plugin.core.telemetry import recorder as recorder_lib
from tunix_stage_plugin.core import tracks

# (row label, track): the rows drawn, top to bottom.
ROWS = (("device compute", tracks.DEVICE_COMPUTE), ("weight sync", tracks.DEVICE_SYNC),
        ("host-to-device", tracks.TRAINER_H2D), ("decode (trainer)", tracks.TRAINER_DECODE),
        ("wire in (trainer)", tracks.TRAINER_RECEIVE),
        ("receive pool wait", tracks.TRAINER_POOL_WAIT), ("stage call", tracks.ORCHESTRATOR_STAGE))
COLOURS = {
    "inline": "#d62728", "staged": "#2ca02c", "resident": "#1f77b4", "update": "#444444",
    tracks.DEVICE_SYNC: "#bbbbbb", "h2d/staging": "#ff7f0e", "h2d/inline": "#d62728",
    tracks.TRAINER_RECEIVE: "#9467bd", tracks.ORCHESTRATOR_STAGE: "#8c564b",
    tracks.TRAINER_DECODE: "#17becf", tracks.TRAINER_POOL_WAIT: "#e377c2",
}
LEGEND = (
    ("fwd_bwd, payload sent inline", "inline"), ("fwd_bwd, staged", "staged"),
    ("fwd_bwd, resident", "resident"), ("update", "update"), ("weight sync", tracks.DEVICE_SYNC),
    ("H2D on the staging thread", "h2d/staging"), ("H2D inline (compute thread)", "h2d/inline"),
    ("compressed payload decoded", tracks.TRAINER_DECODE),
    ("payload received", tracks.TRAINER_RECEIVE),
    ("bytes waiting for the trainer's receive pool", tracks.TRAINER_POOL_WAIT),
    ("stage call (wire; answered once received)", tracks.ORCHESTRATOR_STAGE),
)


class PlotUnavailable(RuntimeError):
  """matplotlib is not installed (the 'bench' extra)."""


def _colour(span: recorder_lib.Span) -> str:
  args = dict(span.args)
  if span.track == tracks.DEVICE_COMPUTE:
    return COLOURS["update" if args.get("kind") == tracks.UPDATE else args.get("source", "inline")]
  if span.track == tracks.TRAINER_H2D:
    return COLOURS[f"h2d/{args.get('lane', 'inline')}"]
  return COLOURS.get(span.track, "#7f7f7f")


def write_timeline_png(path: str, runs: Sequence[results.ModeRun], title: str = "") -> None:
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    from matplotlib import patches  # pylint: disable=import-outside-toplevel
    from matplotlib import pyplot as plt  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    from tunix_stage_plugin.core import install_hint  # pylint: disable=import-outside-toplevel
    raise PlotUnavailable(f"the timeline PNG needs matplotlib ({e}); install the 'bench' extra: "
                          f"{install_hint.install_command('bench')}") from None
  if not runs:
    raise ValueError("no mode runs to plot")
  end = max((s.end - r.origin for r in runs for s in r.spans), default=1.0)
  fig, axes = plt.subplots(len(runs), 1, figsize=(14, 1.2 + 1.15 * len(runs)), sharex=True,
                           squeeze=False)
  for ax, run in zip(axes[:, 0], runs):
    for row, (_, track) in enumerate(ROWS):
      spans = [s for s in run.spans if s.track == track]
      ax.broken_barh([(s.start - run.origin, s.duration) for s in spans], (row - 0.4, 0.8),
                     facecolors=[_colour(s) for s in spans], edgecolor="white", linewidth=0.8)
    ax.set_yticks(range(len(ROWS)), [label for label, _ in ROWS], fontsize=7)
    ax.set_ylim(len(ROWS) - 0.5, -0.5)
    ax.set_xlim(0, end)
    steps = " ".join(f"{t.seconds:.2f}" for t in run.timings)
    ax.set_title(f"{run.mode}  (timed steps {steps} s; round {run.round + 1})", fontsize=9,
                 loc="left")
    ax.grid(axis="x", linewidth=0.3)
  axes[-1, 0].set_xlabel("seconds since the mode run started (first step is the warm-up)")
  handles = [patches.Patch(color=COLOURS[key], label=label) for label, key in LEGEND]
  fig.legend(handles=handles, loc="lower center", ncol=5, fontsize=7, frameon=False)
  if title:
    fig.suptitle(title, fontsize=10)
  fig.tight_layout(rect=(0, 0.06, 1, 0.97 if title else 1))
  fig.savefig(path, dpi=110, metadata={"Title": title} if title else None)  # (readable as text)
  plt.close(fig)
