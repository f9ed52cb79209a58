"""The compact line a staging process prints every N steps (TUNIX_STAGE_LOG_EVERY, default 1;
0: none), on stderr like the activation line, so it shows whatever the job's logging level is.
Its figures are read by their names (figures.py). docs/observability.md "The per-step line".
"""

from __future__ import annotations

import sys
from typing import Any

from tunix_stage_plugin.core.telemetry import figures as figures_lib

_s = figures_lib.seconds


def _by_transport(values: dict[str, Any], prefix: str, *, calls: bool = False) -> str:
  """Per transport: how many micro-batches of what size, and the bytes' speed as they arrived
  (a trainer's receives) or, with `calls`, how long a call took (an orchestrator's sends: a
  call's time includes its wait on the trainer, so it is no transport's speed)."""
  parts = []
  for name, words in figures_lib.TRANSPORTS.items():
    n, nbytes, seconds = (values[f"{prefix}_{name}_{part}"] for part in ("calls", "bytes", "s"))
    if not n:
      continue
    if calls:
      rate = f", {seconds / n:.3f} s a call"
    else:
      rate = f" at {figures_lib.speed(nbytes / seconds)}" if seconds else ""
    parts.append(f"{n} x {figures_lib.size(nbytes / n)} by {words}{rate}")
  return ", ".join(parts)


def slowdown(seconds: float | None, beside_transfer: int) -> str:
  """The part of the compute that ran slower beside transfers, said inside the compute it is part
  of (" (0.05 of it slower beside transfers)"), so a step's sum reads as a sum; unknown where
  fwd_bwds ran beside transfers and none alone yet (no baseline to compare with)."""
  if figures_lib.known(seconds):
    return f" ({_s(seconds)} of it slower beside transfers)"
  return " (its slowdown beside transfers unknown)" if beside_transfer else ""


def trainer_line(figures: dict[str, Any]) -> str:
  """The trainer's receives are those it times as they arrive (side channel, chunked stream); a
  micro-batch that came inside a gRPC call is not among them (the orchestrator's line counts it)."""
  v = figures_lib.row(figures_lib.TRAINER, figures)
  received = _by_transport(v, "received") or "nothing by side channel or stream"
  # A first step compiles and has no step before it: nothing in it is judged.
  judged = (f"bound by {v['bound_by']}" if figures_lib.known(v["step_s"])
            else "not judged: a first step compiles")
  if figures_lib.known(v["saved_s"]):
    judged += f"; staging saved {_s(v['saved_s'])} s"
  return (f"tunix-stage: trainer step {figures['step']}: {_s(v['step_s'])} s = compute "
          f"{_s(v['compute_s'])}{slowdown(v['slowdown_s'], v['beside_transfer'])} + input wait "
          f"{_s(v['input_wait_mid_step_s'])} mid-step, {_s(v['input_wait_boundary_s'])} at the "
          f"boundary + other calls {_s(v['other_s'])}; received {received}; placed "
          f"{v['placed']} in {_s(v['placed_s'])} s; pool waits {v['pool_waits']} "
          f"({_s(v['pool_wait_s'])} s); {judged}{_sizing(v)}")


def orchestrator_line(figures: dict[str, Any]) -> str:
  v = figures_lib.row(figures_lib.ORCHESTRATOR, figures)
  kinds = "".join(f", {v[f'fallbacks_{k}']} {k}" for k in figures_lib.FALLBACK_KINDS
                  if v[f"fallbacks_{k}"])
  return (f"tunix-stage: step {figures['step']}: {v['microbatches']} micro-batches, "
          f"staged {v['staged']} ({v['prestaged']} across the boundary), inline "
          f"{v['inline']}, fallbacks {v['fallbacks']}{kinds}; sent "
          f"{_by_transport(v, 'sent', calls=True) or 'nothing'}; stage calls "
          f"{v['stage_calls']}, median {_s(v['stage_call_median_s'])} s{_sizing(v)}")


def _sizing(values: dict[str, Any]) -> str:
  """A sized depth or bound's choice and why (TUNIX_MAX_STAGED_BATCHES / _HOST_BATCHES=auto)."""
  return f"; {values['sizing']}" if values["sizing"] else ""


def say(step: int, every: int, line: str) -> None:
  """Prints `line` when `step` is one of every `every` (0: never)."""
  if every and step % every == 0:
    print(line, file=sys.stderr, flush=True)
