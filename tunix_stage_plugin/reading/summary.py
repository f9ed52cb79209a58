"""A run's figures summed over its steps, by the one rule the report, `report A B`, the picture and
the bench's job-side line all use (RULE): a median of each figure over a run's judged steps (a
process's first step, which compiles and has no step before it, left out where there are others),
totals and counts over every step; what staging hid against an inline estimate; and the rule's
advice (core/advice.py) on the run's window. docs/observability.md "tunix-stage report".
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from tunix_stage_plugin.core import advice as advice_lib
from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.core import contract
from tunix_stage_plugin.core.telemetry import figures as figures_lib
from tunix_stage_plugin.reading import runs as runs_lib

RULE = ("medians per step leave a first step out (a process's compile) where there are others; "
        "totals are over every step")
FIRST = "first step (compile)"  # how a process's first step is said in place of its bound
FIRSTS = "first steps (compile)"
median = figures_lib.median  # the one median of a figure over steps (the advice rule's too)


def first_steps(steps: pd.DataFrame) -> np.ndarray:
  """Which rows are a process's first step: no step before it to measure its length from."""
  return steps["step_s"].isna().to_numpy()


def judged(steps: pd.DataFrame) -> np.ndarray:
  """The rows a median is taken over (RULE), as a mask."""
  first = first_steps(steps)
  return ~first if (~first).any() else np.ones(len(first), dtype=bool)


def estimated(steps: pd.DataFrame) -> np.ndarray:
  """Per trainer step, the input wait it would have had inline: its wait and what staging saved
  in it (figures' `saved_s`, an upper bound)."""
  return (steps["input_wait_s"] + steps["saved_s"].fillna(0.0)).to_numpy()


def _step_s(steps: pd.DataFrame) -> pd.Series:
  """Each step's length (a first step has none from the step before: its parts then)."""
  return steps["step_s"].fillna(steps["compute_s"] + steps["input_wait_s"] + steps["other_s"])


def transports(steps: pd.DataFrame, prefix: str) -> dict[str, dict[str, Any]]:
  """Per transport a run's steps crossed by, their calls, bytes and seconds summed, and the bytes
  over the seconds (`gib_s`)."""
  return figures_lib.transports(
      (name, int(steps[f"{prefix}_{name}_calls"].sum()), int(steps[f"{prefix}_{name}_bytes"].sum()),
       float(steps[f"{prefix}_{name}_s"].sum()))
      for name in figures_lib.TRANSPORTS if steps[f"{prefix}_{name}_calls"].sum())


def summary(trainer: pd.DataFrame, orchestrator: pd.DataFrame) -> dict[str, Any]:
  """A run's figures over its steps, what staging hid, the transports' speeds (RULE)."""
  out: dict[str, Any] = {"trainer_steps": len(trainer), "orchestrator_steps": len(orchestrator)}
  if len(trainer):
    rows = judged(trainer)
    t = trainer[rows]
    staged = t["placed_staged"].to_numpy() > 0
    wait = t["input_wait_s"].to_numpy()
    estimate = estimated(t)[staged]  # in the steps that staged (none: nothing to say)
    first = first_steps(trainer)
    bound = trainer["bound_by"][~first].astype(object)
    out["trainer"] = {
        "step_s": median(_step_s(t)),
        "compute_s": median(t["compute_s"]),
        "input_wait_s": median(wait),
        "mid_step_s": median(t["input_wait_mid_step_s"]),
        "boundary_s": median(t["input_wait_boundary_s"]),
        "other_s": median(t["other_s"]),
        "slowdown_s": median(t["slowdown_s"]),
        "bound_by": {cause: int((bound == cause).sum()) for cause in figures_lib.CAUSES},
        "first_steps": int(first.sum()),
        "only_first": not (~first).any(),
        "inline_wait_estimate_s": median(estimate),
        "hidden_s": median(t["saved_s"].to_numpy()[staged]),
        "received": transports(trainer, "received"),
        # A record holding both (a job run staged and inline, or stages that fell back): each
        # path's input wait apart, so staging's effect is read off the job itself.
        "by_path": {path: {"steps": int(group.sum()), "input_wait_s": median(wait[group])}
                    for path, group in (("staged", staged), ("inline", ~staged))},
    }
  if len(orchestrator):
    o = orchestrator
    out["orchestrator"] = {
        "staged": int(o["staged"].sum()), "inline": int(o["inline"].sum()),
        "prestaged": int(o["prestaged"].sum()), "fallbacks": int(o["fallbacks"].sum()),
        "fallbacks_by_kind": {k: int(o[f"fallbacks_{k}"].sum())
                              for k in figures_lib.FALLBACK_KINDS if o[f"fallbacks_{k}"].sum()},
        "stage_call_median_s": median(o["stage_call_median_s"][judged(o)]),
        "sent": transports(o, "sent"),
    }
  return out


STAGE = config_lib.SETTINGS_BY_FIELD["mode"]
TURN_ON = f"{STAGE.env}={config_lib.MODE_STAGE}"


def staging(run: runs_lib.Run) -> dict[str, Any]:
  """Whether the run staged (a micro-batch trained staged, or placed on the trainer's staging
  lane), and where it did not, what its records say of why (`said`: the processes by name), the
  role whose setting turns staging on and that setting (`turn_on`; None where staging was on and
  every stage fell back, which the advice rule judges)."""
  trainer, orchestrator = run.trainer_steps, run.orchestrator_steps
  out: dict[str, Any] = {"staged": bool(trainer["placed_staged"].sum()
                                        or orchestrator["staged"].sum()),
                         "said": None, "role": None, "turn_on": None}
  if out["staged"]:
    return out
  names = {role: ", ".join(p.name for p in run.processes if p.role == role)
           for role in (figures_lib.TRAINER, figures_lib.ORCHESTRATOR)}
  if len(orchestrator):
    trained = int(orchestrator["microbatches"].sum())
    fell = {k: int(orchestrator[f"fallbacks_{k}"].sum()) for k in figures_lib.FALLBACK_KINDS}
    kinds = ", ".join(f"{n} {k}" for k, n in fell.items() if n)
    where = f"orchestrator {names[figures_lib.ORCHESTRATOR]}"
    if fell[contract.StageStatus.UNSUPPORTED.value]:
      out.update(said=f"the trainer refused {where}'s stages as unsupported (staging is off on "
                 f"the trainer, or it runs without the plugin), so all {trained} micro-batches "
                 "trained inline", role=figures_lib.TRAINER)
    elif kinds:
      out["said"] = f"{where}'s stages all fell back inline ({kinds}); {trained} trained inline"
    else:
      out["said"] = f"{where} staged none of its {trained} micro-batches"
  else:
    inline = int(trainer["placed_inline"].sum())
    out.update(said=f"the orchestrator sent every micro-batch with its train call (staging off "
               "on it, or no plugin there: it wrote no record), and trainer "
               f"{names[figures_lib.TRAINER]} placed all {inline} inline",
               role=figures_lib.ORCHESTRATOR)
  if out["role"] == figures_lib.ORCHESTRATOR:
    out["turn_on"] = f"{TURN_ON} on the orchestrator"
  elif out["role"] == figures_lib.TRAINER:
    out["turn_on"] = f"{TURN_ON} on the trainer, with the plugin installed there"
  return out


def split(steps: pd.DataFrame) -> dict[str, Any]:
  """Where a trainer's steps went, the median of each part over every step given (the caller
  picks them: the bench its table's steps), and what bound most of them."""
  known = steps["slowdown_s"].notna().to_numpy()
  bounds = steps["bound_by"].astype(object).tolist()
  return {"steps": len(steps), "steps_with_slowdown": int(known.sum()),
          "compute_s": median(steps["compute_s"]),
          "mid_step_s": median(steps["input_wait_mid_step_s"]),
          "boundary_s": median(steps["input_wait_boundary_s"].fillna(0.0)),
          "slowdown_s": median(steps["slowdown_s"][known]),
          "alone_s": median(steps["alone_s"][known]),
          "bound_by": max(dict.fromkeys(bounds), key=bounds.count) if bounds else None}


def window(run: runs_lib.Run) -> advice_lib.Window | None:
  """The advice rule's window over a run: its trainer steps and orchestrator steps, with the
  settings they ran with (the orchestrator's last depth, whether it prestaged; the trainer's last
  bounds)."""
  trainer, orchestrator = run.trainer_steps, run.orchestrator_steps
  if not len(trainer):
    return None
  last = next(p for p in reversed(run.processes) if p.role == figures_lib.TRAINER).last
  ran = next((p for p in reversed(run.processes) if p.role == figures_lib.ORCHESTRATOR), None)
  settings = advice_lib.Settings(
      host=ran.host if ran is not None else str(last["host"]),
      depth=(int(orchestrator["depth"].iloc[-1]) if ran is not None
             else runs_lib.setting(last, "max_staged_batches")),
      prestage=bool(orchestrator["prestaged"].any()) if ran is not None else None,
      max_device_batches=runs_lib.setting(last, "max_device_batches"),
      max_host_batches=runs_lib.setting(last, "max_host_batches"))
  return advice_lib.Window.of(settings, trainer, orchestrator)
