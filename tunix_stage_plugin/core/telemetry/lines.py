"""The compact line a staging process prints every N steps (TUNIX_STAGE_LOG_EVERY, default 1;
0: none), on stderr like the activation line, so it shows whatever the job's logging level is.
docs/observability.md "The per-step line".
"""

from __future__ import annotations

import sys
from typing import Any

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
TRANSPORT_NAMES = {"side": "side channel", "stream": "chunked stream", "unary": "gRPC call"}


def _s(seconds: float | None) -> str:
  return "-" if seconds is None else f"{seconds:.2f}"


def size(nbytes: float) -> str:
  """Bytes in the unit that shows them (never a micro-batch of 50 KiB as "0.0 MiB")."""
  if nbytes >= GIB:
    return f"{nbytes / GIB:.2f} GiB"
  if nbytes >= MIB:
    return f"{nbytes / MIB:.1f} MiB"
  return f"{nbytes / KIB:.1f} KiB"


def speed(bytes_per_s: float) -> str:
  """A speed in GiB/s, or in MiB/s and KiB/s below a tenth of one (never "0.00 GiB/s")."""
  if bytes_per_s >= GIB / 10:
    return f"{bytes_per_s / GIB:.2f} GiB/s"
  if bytes_per_s >= MIB:
    return f"{bytes_per_s / MIB:.1f} MiB/s"
  return f"{bytes_per_s / KIB:.1f} KiB/s"


def _by_transport(by_transport: dict[str, dict[str, Any]], *, calls: bool = False) -> str:
  """Per transport: how many micro-batches of what size, and the bytes' speed as they arrived
  (a trainer's receives) or, with `calls`, how long a call took (an orchestrator's sends: a
  call's time includes its wait on the trainer, so it is no transport's speed)."""
  parts = []
  for name, t in by_transport.items():
    if calls:
      rate = f", {t['seconds'] / t['calls']:.3f} s a call"
    else:
      rate = f" at {speed(t['bytes'] / t['seconds'])}" if t["seconds"] else ""
    parts.append(f"{t['calls']} x {size(t['bytes'] / t['calls'])} by "
                 f"{TRANSPORT_NAMES.get(name, name)}{rate}")
  return ", ".join(parts)


def slowdown(seconds: float | None, beside_transfer: int) -> str:
  """The part of the compute that ran slower beside transfers, said inside the compute it is part
  of (" (0.05 of it slower beside transfers)"), so a step's sum reads as a sum; unknown where
  fwd_bwds ran beside transfers and none alone yet (no baseline to compare with)."""
  if seconds is not None:
    return f" ({_s(seconds)} of it slower beside transfers)"
  return " (its slowdown beside transfers unknown)" if beside_transfer else ""


def trainer_line(figures: dict[str, Any]) -> str:
  """The trainer's receives are those it times as they arrive (side channel, chunked stream); a
  micro-batch that came inside a gRPC call is not among them (the orchestrator's line counts it)."""
  wait, compute = figures["input_wait_s"], figures["compute"]
  slower = slowdown(compute["slowdown_s"], compute["beside_transfer"])
  received = (_by_transport(figures["receive"]["by_transport"])
              or "nothing by side channel or stream")
  pool = figures["pool"]
  return (f"tunix-stage: trainer step {figures['step']}: {_s(figures['step_s'])} s = compute "
          f"{_s(figures['compute_s'])}{slower} + input wait {_s(wait['mid_step'])} mid-step, "
          f"{_s(wait['boundary'])} at the boundary + other calls {_s(figures['other_s'])}; "
          f"received {received}; placed "
          f"{figures['place']['count']} in {_s(figures['place']['seconds'])} s; pool waits "
          f"{pool['waits']} ({_s(pool['wait_s'])} s); bound by {figures['bound_by']}"
          f"{_sizing(figures)}")


def orchestrator_line(figures: dict[str, Any]) -> str:
  fallbacks = figures["fallbacks"]
  kinds = "".join(f", {n} {k}" for k, n in fallbacks["by_kind"].items())
  calls = figures["stage_calls"]
  return (f"tunix-stage: step {figures['step']}: {figures['microbatches']} micro-batches, "
          f"staged {figures['staged']} ({figures['prestaged']} across the boundary), inline "
          f"{figures['inline']}, fallbacks {fallbacks['count']}{kinds}; sent "
          f"{_by_transport(figures['sent'], calls=True) or 'nothing'}; stage calls "
          f"{calls['count']}, median {_s(calls['median_s'])} s{_sizing(figures)}")


def _sizing(figures: dict[str, Any]) -> str:
  """A sized depth or bound's choice and why (TUNIX_MAX_STAGED_BATCHES / _HOST_BATCHES=auto)."""
  return f"; {figures['sizing']}" if figures.get("sizing") else ""


def say(step: int, every: int, line: str) -> None:
  """Prints `line` when `step` is one of every `every` (0: never)."""
  if every and step % every == 0:
    print(line, file=sys.stderr, flush=True)

