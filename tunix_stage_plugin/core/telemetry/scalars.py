"""A step's figures as named scalars: the trainer's for its own metrics logger (its TensorBoard,
W&B, OpenTelemetry), the orchestrator's for its process's jax.monitoring listeners. One table
of the names per side, all under `stage/` so they sort together, each read from the step's
figures (trainer.py, orchestrator.py) in one place. docs/observability.md "In your metrics
logger".
"""

from __future__ import annotations

from typing import Any, Callable

from tunix_stage_plugin.core.telemetry import analysis
from tunix_stage_plugin.core.telemetry import orchestrator as orchestrator_lib

PREFIX = "stage/"


def _received_gib_s(figures: dict[str, Any]) -> float | None:
  receive = figures["receive"]
  return receive["bytes"] / receive["seconds"] / analysis.GIB if receive["seconds"] else None


# name (under PREFIX) -> its value in a step's figures; None: not known this step (not logged).
TRAINER: dict[str, Callable[[dict[str, Any]], float | int | None]] = {
    "step_s": lambda f: f["step_s"],
    "compute_s": lambda f: f["compute_s"],
    "slowdown_s": lambda f: f["compute"]["slowdown_s"],
    "input_wait_mid_step_s": lambda f: f["input_wait_s"]["mid_step"],
    "input_wait_boundary_s": lambda f: f["input_wait_s"]["boundary"],
    "other_s": lambda f: f["other_s"],
    "received_gib_s": _received_gib_s,
    "staged": lambda f: f["place"]["staged"],
    "inline": lambda f: f["place"]["inline"],
    "pool_waits": lambda f: f["pool"]["waits"],
    "peak_device_batches": lambda f: f["staged"]["peak_device"],
    # The bound, one scalar per cause (1 for the cause that bounded the step, else 0).
    **{f"bound_by_{cause.replace(' ', '_')}": (lambda f, c=cause: int(f["bound_by"] == c))
       for cause in (analysis.COMPUTE, analysis.WIRE, analysis.SHARED_CORES)},
}


# The orchestrator's: name (under PREFIX) -> its value in a step's figures. staged, inline,
# prestaged, peak_staged and fallbacks are the names tunix's step result carries
# (core.pipeline.StepReport.metrics).
ORCHESTRATOR: dict[str, Callable[[dict[str, Any]], float | int | None]] = {
    "step_s": lambda f: f["step_s"],
    "microbatches": lambda f: f["microbatches"],
    "depth": lambda f: f["depth"],
    "staged": lambda f: f["staged"],
    "inline": lambda f: f["inline"],
    "prestaged": lambda f: f["prestaged"],
    "peak_staged": lambda f: f["peak_staged"],
    "fallbacks": lambda f: f["fallbacks"]["count"],
    # The fallbacks one scalar per kind (refused, failed, unsupported, unplaced).
    **{f"fallbacks_{kind.value}": (lambda f, k=kind.value: f["fallbacks"]["by_kind"].get(k, 0))
       for kind in orchestrator_lib.FALLBACK_KINDS},
    "stage_call_median_s": lambda f: f["stage_calls"]["median_s"],
}


def _named(table: dict[str, Callable[[dict[str, Any]], float | int | None]],
           figures: dict[str, Any]) -> dict[str, float | int]:
  values = ((name, read(figures)) for name, read in table.items())
  return {PREFIX + name: value for name, value in values if value is not None}


def trainer(figures: dict[str, Any]) -> dict[str, float | int]:
  """The trainer step's scalars that are known, by their full name (`stage/...`)."""
  return _named(TRAINER, figures)


def orchestrator(figures: dict[str, Any]) -> dict[str, float | int]:
  """The orchestrator step's scalars that are known, by their full name (`stage/...`)."""
  return _named(ORCHESTRATOR, figures)
