"""The step figures, one table: each figure's name, role, place in a step's figures, unit, how a
step and a run sum it, and whether it is a scalar; what bounds a step; the one formatter of
seconds, sizes and speeds. The line, the record, the scalars and `tunix-stage report` all read it.
A name means one thing in either role. docs/observability.md "The steps as a DataFrame".
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from tunix_stage_plugin.core import contract
from tunix_stage_plugin.core import tracks

TRAINER, ORCHESTRATOR = "trainer", "orchestrator"
ROLES = (TRAINER, ORCHESTRATOR)
PREFIX = "stage/"  # the scalars' names: stage/<name>
KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30

# Units. A count and bytes are integers; seconds and GiB/s numbers; a cause one of CAUSES.
SECONDS, BYTES, COUNT, RATE, TEXT, CAUSE = "s", "bytes", "count", "GiB/s", "text", "cause"
# How a step's value sums what it measured (its micro-batches, its calls), and how a run's
# summary sums its steps: the median of its judged steps (a first step, which compiles and has
# no step before it, left out where there are others) or the total over every step.
SUM, MEDIAN, MAX, ONE = "sum", "median", "max", "one"
TOTAL = "total"

# What bounds a trainer step (`bound_by`): a part counts once it is at least SHARE of the step and
# at least FLOOR_S.
COMPUTE, WIRE, SHARED_CORES = "compute", "wire", "shared cores"
CAUSES = (COMPUTE, WIRE, SHARED_CORES)
SHARE = 0.05
FLOOR_S = 0.02

# The transports a micro-batch crosses by, and how the lines name them.
TRANSPORTS = {"side": "side channel", "stream": "chunked stream", "unary": "gRPC call"}
FALLBACK_KINDS = tuple(s.value for s in contract.StageStatus if s is not contract.StageStatus.STAGED)

Get = Callable[[str], Any]

# The spans these figures are measured from, as a trainer's tunix PerfTracer shows them (its own
# timelines, tunix-style names: hosts/tunix/peft.py): the received, placed and pool figures'
# spans, and a placement that fell back.
SPANS = {tracks.TRAINER_RECEIVE: "stage_receive", tracks.TRAINER_H2D: "stage_place",
         tracks.TRAINER_POOL_WAIT: "stage_pool_wait", tracks.TRAINER_FALLBACK: "stage_fallback"}


@dataclasses.dataclass(frozen=True)
class Figure:
  """One step figure of one role. `path`: where a step's figures dict (the aggregator's, the
  record's body) holds it, () for one derived from others by `derive` (given the step's figures
  by name). `within`: how a step's value sums what it measured; `over`: how a run sums its steps
  (MEDIAN over the judged steps, TOTAL over every step; None: not summed). `null`: the step may
  not know it (its first step's boundary, a slowdown with no baseline); `optional`: a record may
  lack it (older records, a setting not on)."""

  name: str
  role: str
  path: tuple[str, ...]
  unit: str
  within: str
  over: str | None
  what: str
  null: bool = False
  optional: bool = False
  scalar: bool = False  # stage/<name> in the metrics logger (tunix's, MaxText's, jax.monitoring)
  compared: bool = False  # one of `report A B`'s figures
  derive: Callable[[Get], Any] | None = None
  absent: Any = None  # its value in a step that lacks it (0 for a family's name not seen)
  family: tuple[str, ...] | None = None  # the path of the object holding one entry per name

  @property
  def first(self) -> bool:
    """Whether a run's first step counts in its summary (in a total it does, in a median not)."""
    return self.over == TOTAL


def median(values: Any) -> float | None:
  """The median of the known values (NaN: not known), or None where none is: how the report, the
  advice rule and the sizer take a figure's median over steps."""
  values = np.asarray(values, dtype=np.float64)
  values = values[~np.isnan(values)]
  return float(np.median(values)) if len(values) else None


def each(total: Any, count: Any) -> np.ndarray:
  """Per step, a total's share of one of its `count` items (seconds of its receives, bytes of
  its placements): total / count where count > 0, else 0."""
  count = np.asarray(count)
  return np.where(count > 0, total / np.where(count > 0, count, 1), 0.0)


def _per(a: Any, b: Any, scale: float = 1.0) -> Any:
  """a / (b x scale) where b > 0, else NaN (numbers or arrays alike)."""
  with np.errstate(divide="ignore", invalid="ignore"):
    return np.where(b > 0, a / (np.where(b > 0, b, 1) * scale), math.nan)


def _saved(g: Get) -> Any:
  """A step's input wait that staging saved: its staged placements, each as long as a receive
  and a placement of the step (their means), which inline would have run between two
  computations (an upper bound: tunix answers a call once its computation is queued). NaN where
  the step staged none."""
  staged = g("placed_staged")
  each_s = each(g("received_s"), g("received")) + each(g("placed_s"), g("placed"))
  return np.where(staged > 0, staged * each_s, math.nan)


def _t(name: str, path: str, unit: str, within: str, over: str | None, what: str,
       **kwargs: Any) -> Figure:
  return Figure(name, TRAINER, tuple(path.split(".")) if path else (), unit, within, over, what,
                **kwargs)


def _o(name: str, path: str, unit: str, within: str, over: str | None, what: str,
       **kwargs: Any) -> Figure:
  return Figure(name, ORCHESTRATOR, tuple(path.split(".")) if path else (), unit, within, over,
                what, **kwargs)


def _transfers(role: str, prefix: str, path: str, what: str, rate: bool) -> list[Figure]:
  """A family of figures per transport (a step's receives or sends by TRANSPORTS): 0 in a step
  that sent none by it."""
  out = []
  family = tuple(path.split("."))
  for transport in TRANSPORTS:
    base = (*family, transport)
    out += [Figure(f"{prefix}_{transport}_calls", role, (*base, "calls"), COUNT, SUM, TOTAL,
                   f"{what} by {TRANSPORTS[transport]}: calls", absent=0, family=family),
            Figure(f"{prefix}_{transport}_bytes", role, (*base, "bytes"), BYTES, SUM, TOTAL,
                   f"{what} by {TRANSPORTS[transport]}: bytes", absent=0, family=family),
            Figure(f"{prefix}_{transport}_s", role, (*base, "seconds"), SECONDS, SUM, TOTAL,
                   f"{what} by {TRANSPORTS[transport]}: seconds", absent=0.0,
                   family=family)]
    if rate:
      out.append(Figure(f"{prefix}_{transport}_gib_s", role, (*base, "gib_s"), RATE, ONE, None,
                        f"{what} by {TRANSPORTS[transport]}: bytes over its calls' time",
                        null=True, optional=True, family=family))
  return out


FIGURES: tuple[Figure, ...] = (
    # The trainer's (core/telemetry/recorder.py's TrainerSteps makes them).
    _t("host_step", "host_step", COUNT, ONE, None, "the trainer's own step count after the "
       "step's update (tunix's train_steps, the step its loss is logged at)", null=True,
       optional=True),
    _t("step_s", "step_s", SECONDS, ONE, MEDIAN, "the previous step's update end to this one's",
       null=True, scalar=True, compared=True),
    _t("compute_s", "compute_s", SECONDS, SUM, MEDIAN, "the device computing", scalar=True,
       compared=True),
    _t("input_wait_mid_step_s", "input_wait_s.mid_step", SECONDS, SUM, MEDIAN,
       "the device idle mid-step, waiting for its input", scalar=True, compared=True),
    _t("input_wait_boundary_s", "input_wait_s.boundary", SECONDS, ONE, MEDIAN,
       "the device idle at the step boundary, waiting for its input", null=True, scalar=True,
       compared=True),
    _t("input_wait_s", "", SECONDS, SUM, MEDIAN, "the input wait, mid-step and at the boundary",
       compared=True, derive=lambda g: g("input_wait_mid_step_s")
       + np.nan_to_num(g("input_wait_boundary_s"))),
    _t("other_s", "other_s", SECONDS, SUM, MEDIAN, "the compute lane's own calls (weight sync, "
       "...)", scalar=True, compared=True),
    _t("microbatches", "microbatches", COUNT, SUM, TOTAL, "fwd_bwd computations"),
    _t("fwd_bwd_median_s", "compute.fwd_bwd_median_s", SECONDS, MEDIAN, MEDIAN,
       "a fwd_bwd computation", null=True),
    _t("update_s", "compute.update_s", SECONDS, ONE, MEDIAN, "the update's computation"),
    _t("alone_s", "compute.alone_s", SECONDS, MEDIAN, MEDIAN, "a recent fwd_bwd with no transfer "
       "beside it", null=True),
    _t("beside_transfer", "compute.beside_transfer", COUNT, SUM, TOTAL,
       "fwd_bwd computations that ran beside a transfer"),
    _t("slowdown_s", "compute.slowdown_s", SECONDS, SUM, MEDIAN, "how much longer the fwd_bwds "
       "beside a transfer took than those alone", null=True, scalar=True, compared=True),
    _t("received", "receive.calls", COUNT, SUM, TOTAL, "micro-batches received by side channel "
       "or stream"),
    _t("received_bytes", "receive.bytes", BYTES, SUM, TOTAL, "the received micro-batches' bytes"),
    _t("received_s", "receive.seconds", SECONDS, SUM, TOTAL, "the receives' time"),
    _t("received_gib_s", "", RATE, ONE, MEDIAN, "the step's received bytes over its receives' "
       "time", null=True, scalar=True, compared=True,
       derive=lambda g: _per(g("received_bytes"), g("received_s"), GIB)),
    *_transfers(TRAINER, "received", "receive.by_transport", "received", rate=False),
    _t("placed", "place.count", COUNT, SUM, TOTAL, "placements (staging and inline lanes)"),
    _t("placed_s", "place.seconds", SECONDS, SUM, TOTAL, "the placements' time"),
    _t("placed_bytes", "place.bytes", BYTES, SUM, TOTAL, "the placements' bytes"),
    _t("placed_staged", "place.staged", COUNT, SUM, TOTAL, "placements on the staging lane",
       scalar=True, compared=True),
    _t("placed_inline", "place.inline", COUNT, SUM, TOTAL, "placements inline (in the train "
       "call)", scalar=True, compared=True),
    _t("saved_s", "", SECONDS, SUM, MEDIAN, "the input wait staging saved: the staged "
       "micro-batches' receives and placements, which inline would have run between two "
       "computations (none where none staged)", null=True, scalar=True, compared=True,
       derive=_saved),
    _t("pool_waits", "pool.waits", COUNT, SUM, TOTAL, "transfers that waited for a receive "
       "buffer", scalar=True, compared=True),
    _t("pool_wait_s", "pool.wait_s", SECONDS, SUM, TOTAL, "the pool waits' time"),
    _t("pool_over_bound", "pool.over_bound", COUNT, SUM, TOTAL, "pool waits that ran out of time"),
    _t("peak_device_batches", "staged.peak_device", COUNT, MAX, MAX, "the most staged "
       "micro-batches held on the device at once", null=True, scalar=True, compared=True),
    _t("peak_host_batches", "staged.peak_host", COUNT, MAX, MAX, "the most held in host buffers "
       "at once", null=True),
    _t("bound_by", "bound_by", CAUSE, ONE, TOTAL, "what bounded the step: compute, wire or "
       "shared cores"),
    *(_t(f"bound_by_{cause.replace(' ', '_')}", "", COUNT, ONE, TOTAL,
         f"1 where the step was bound by {cause}, else 0", scalar=True,
         derive=lambda g, c=cause: (g("bound_by") == c) * 1) for cause in CAUSES),
    _t("sizing", "sizing", TEXT, ONE, None, "the host bound in force and why, where it is auto",
       null=True, optional=True),
    # The orchestrator's (core/telemetry/recorder.py's OrchestratorSteps).
    _o("host_step", "host_step", COUNT, ONE, None, "the trainer's step count its last update "
       "answered", null=True, optional=True),
    _o("step_s", "step_s", SECONDS, ONE, MEDIAN, "between this step's end and the one before's",
       null=True, scalar=True, compared=True),
    _o("microbatches", "microbatches", COUNT, SUM, TOTAL, "micro-batches trained", scalar=True,
       compared=True),
    _o("depth", "depth", COUNT, ONE, MEDIAN, "the stage-ahead depth", scalar=True,
       compared=True),
    _o("staged", "staged", COUNT, SUM, TOTAL, "micro-batches trained staged", scalar=True,
       compared=True),
    _o("inline", "inline", COUNT, SUM, TOTAL, "micro-batches trained inline", scalar=True,
       compared=True),
    _o("prestaged", "prestaged", COUNT, SUM, TOTAL, "staged across the step boundary",
       scalar=True, compared=True),
    _o("peak_staged", "peak_staged", COUNT, MAX, MAX, "the most staged ahead at once",
       scalar=True, compared=True),
    _o("fallbacks", "fallbacks.count", COUNT, SUM, TOTAL, "stages that fell back inline",
       scalar=True, compared=True),
    *(_o(f"fallbacks_{kind}", f"fallbacks.by_kind.{kind}", COUNT, SUM, TOTAL,
         f"stages that fell back: {kind}", scalar=True, compared=True, absent=0,
         family=("fallbacks", "by_kind")) for kind in FALLBACK_KINDS),
    *_transfers(ORCHESTRATOR, "sent", "sent", "sent (a call's time holds its wait on the "
                "trainer)", rate=True),
    _o("stage_calls", "stage_calls.count", COUNT, SUM, TOTAL, "stage calls"),
    _o("stage_calls_s", "stage_calls.seconds", SECONDS, SUM, TOTAL, "the stage calls' time"),
    _o("stage_call_median_s", "stage_calls.median_s", SECONDS, MEDIAN, MEDIAN,
       "a stage call's latency", null=True, scalar=True, compared=True),
    _o("stage_call_max_s", "stage_calls.max_s", SECONDS, MAX, MAX, "the longest stage call",
       null=True),
    _o("sizing", "sizing", TEXT, ONE, None, "the depth and why, where it is auto", null=True,
       optional=True),
)
BY_ROLE: dict[str, dict[str, Figure]] = {
    role: {f.name: f for f in FIGURES if f.role == role} for role in ROLES}


def value(figure: Figure, step: Mapping[str, Any]) -> Any:
  """`figure`'s value in a step's figures (or record) as written: None where not known, its
  `absent` value where the step lacks it."""
  at: Any = step
  for key in figure.path:
    if not isinstance(at, Mapping) or key not in at:
      return figure.absent
    at = at[key]
  return at


def row(role: str, step: Mapping[str, Any]) -> dict[str, Any]:
  """A step's figures (as its aggregator made them) by name, derived ones included; a number not
  known in the step is NaN (as in report's DataFrame)."""
  out: dict[str, Any] = {}
  for f in BY_ROLE[role].values():
    if f.derive is None:
      v = value(f, step)
      out[f.name] = math.nan if v is None and f.unit not in (TEXT, CAUSE) else v
  for f in BY_ROLE[role].values():
    if f.derive is not None:
      v = f.derive(out.__getitem__)
      out[f.name] = v.item() if isinstance(v, np.ndarray | np.generic) else v
  return out


def known(value: Any) -> bool:
  """A figure's value that is known (not null, not NaN)."""
  return value is not None and value == value


def scalars(role: str, step: Mapping[str, Any]) -> dict[str, float | int]:
  """A step's scalars (the figures marked `scalar`) that are known, by their full name
  (`stage/...`): what the metrics logger and jax.monitoring are told."""
  values = row(role, step)
  return {PREFIX + f.name: values[f.name] for f in BY_ROLE[role].values()
          if f.scalar and known(values[f.name])}


def significant(seconds: float | None, step_s: float) -> bool:
  return known(seconds) and seconds >= max(SHARE * step_s, FLOOR_S)


def bound_by(step_s: float, input_wait: float, slowdown_s: float | None) -> str:
  """What bounds a trainer step of `step_s`: WIRE (the device waited for its input: the host path
  was on the critical path), SHARED_CORES (the compute ran slower while transfers ran beside it
  on the same cores), else COMPUTE."""
  if significant(input_wait, step_s):
    return WIRE
  if significant(slowdown_s, step_s):
    return SHARED_CORES
  return COMPUTE


def wire_bound(transfer_s: float | None, compute_s: float | None, step_s: float | None) -> bool:
  """A micro-batch takes as long to cross as to compute, and its crossing is no noise in the
  step (`significant`): no depth keeps the device fed. The sizer and the advice judge so."""
  return (known(transfer_s) and known(compute_s) and known(step_s)
          and transfer_s >= compute_s and significant(transfer_s, step_s))


def transports(parts: Iterable[tuple[str, int, int, float]], *, rate: bool = True
               ) -> dict[str, dict[str, Any]]:
  """Per transport, the (transport, calls, bytes, seconds) of `parts` summed: a step's receives
  or sends, or a run's steps; with `rate`, their bytes over their seconds (`gib_s`)."""
  total: dict[str, dict[str, Any]] = {}
  for name, calls, nbytes, seconds in parts:
    t = total.setdefault(name, {"calls": 0, "bytes": 0, "seconds": 0.0})
    t["calls"] += calls
    t["bytes"] += nbytes
    t["seconds"] += seconds
  if rate:
    for t in total.values():
      t["gib_s"] = t["bytes"] / t["seconds"] / GIB if t["seconds"] > 0 else None
  return total


def seconds(value: float | None) -> str:
  """Seconds as the lines and tables print them ("-": not known)."""
  return f"{value:.2f}" if known(value) else "-"


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
