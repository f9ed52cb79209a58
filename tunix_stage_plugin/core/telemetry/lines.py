"""The compact line a staging process prints every N steps (TUNIX_STAGE_LOG_EVERY, default 1;
0: none), on stderr like the activation line, so it shows whatever the job's logging level is.
docs/observability.md "The per-step line".
"""

from __future__ import annotations

import sys
from typing import Any

MIB = 1 << 20
GIB = 1 << 30
TRANSPORT_NAMES = {"side": "side channel", "stream": "chunked stream", "unary": "tunix's call"}


def _s(seconds: float | None) -> str:
  return "-" if seconds is None else f"{seconds:.2f}"


def _by_transport(by_transport: dict[str, dict[str, Any]], *, calls: bool = False) -> str:
  """Per transport: how many micro-batches of what size, and the bytes' speed as they arrived
  (a trainer's receives) or, with `calls`, how long a call took (an orchestrator's sends: a
  call's time includes its wait on the trainer, so it is no transport's speed)."""
  parts = []
  for name, t in by_transport.items():
    if calls:
      rate = f", {t['seconds'] / t['calls']:.3f} s a call"
    else:
      rate = f" at {t['bytes'] / t['seconds'] / GIB:.2f} GiB/s" if t["seconds"] else ""
    parts.append(f"{t['calls']} x {t['bytes'] / t['calls'] / MIB:.1f} MiB by "
                 f"{TRANSPORT_NAMES.get(name, name)}{rate}")
  return ", ".join(parts) or "nothing"


def trainer_line(figures: dict[str, Any]) -> str:
  wait, compute = figures["input_wait_s"], figures["compute"]
  if compute["slowdown_s"] is not None:
    slowdown = f", {_s(compute['slowdown_s'])} slower beside transfers"
  elif compute["beside_transfer"]:  # no fwd_bwd ran alone yet: no baseline to compare with
    slowdown = ", slowdown beside transfers unknown"
  else:
    slowdown = ""
  pool = figures["pool"]
  return (f"tunix-stage: trainer step {figures['step']}: {_s(figures['step_s'])} s = compute "
          f"{_s(figures['compute_s'])}{slowdown} + input wait {_s(wait['mid_step'])} mid-step, "
          f"{_s(wait['boundary'])} at the boundary + other calls {_s(figures['other_s'])}; "
          f"received {_by_transport(figures['receive']['by_transport'])}; placed "
          f"{figures['place']['count']} in {_s(figures['place']['seconds'])} s; pool waits "
          f"{pool['waits']} ({_s(pool['wait_s'])} s); bound by {figures['bound_by']}")


def orchestrator_line(figures: dict[str, Any]) -> str:
  fallbacks = figures["fallbacks"]
  kinds = "".join(f", {n} {k}" for k, n in fallbacks["by_kind"].items())
  calls = figures["stage_calls"]
  return (f"tunix-stage: step {figures['step']}: {figures['microbatches']} micro-batches, "
          f"staged {figures['staged']} ({figures['prestaged']} across the boundary), inline "
          f"{figures['inline']}, fallbacks {fallbacks['count']}{kinds}; sent "
          f"{_by_transport(figures['sent'], calls=True)}; stage calls {calls['count']}, median "
          f"{_s(calls['median_s'])} s")


def say(step: int, every: int, line: str) -> None:
  """Prints `line` when `step` is one of every `every` (0: never)."""
  if every and step % every == 0:
    print(line, file=sys.stderr, flush=True)

