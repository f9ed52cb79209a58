"""`auto`: the stage-ahead depth sized each step by the one rule (core.telemetry.advice, through
core.sizing.Sizer), proven in the simulator's virtual time (deterministic) on four patterns
(examples/): auto's mean step within 2 % of the best fixed depth 1..4 (each prestaging, its device
bound its depth), its peak staged micro-batches within its budget, and on the fast-wire pattern no
more staged than depth 1 holds. docs/simulate.md "auto" has the table.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tunix_stage_plugin.core import sizing
from tunix_stage_plugin.lab.sim import run as run_lib
from tunix_stage_plugin.lab.sim import trace as trace_lib

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
PATTERNS = ("upstream_pattern", "upstream_spikes", "slow_wire", "fast_wire")
BUDGET = run_lib.AUTO_BUDGET  # micro-batches


def fixed_and_auto(pattern):
  trace = trace_lib.load(str(EXAMPLES / f"{pattern}.json"))
  fixed = {n: run_lib.simulate(trace, f"depth{n}_prestage", max_device_batches=n)
           for n in range(1, 5)}
  return fixed, run_lib.simulate(trace, "auto")


@pytest.mark.parametrize("pattern", PATTERNS)
def test_auto_is_within_2_percent_of_the_best_fixed_depth_and_within_its_budget(pattern):
  fixed, auto = fixed_and_auto(pattern)
  best = min(r.mean_step_s for r in fixed.values())
  assert auto.mean_step_s <= 1.02 * best, (auto.mean_step_s, {n: r.mean_step_s
                                                              for n, r in fixed.items()})
  assert auto.peak_staged <= BUDGET and max(auto.depths) <= BUDGET
  assert auto.fallbacks == 0
  # Its choice and reason each step; nothing measured before the first step's figures.
  assert len(auto.choices) == len(auto.depths) == len(auto.step_s) + 1
  assert auto.choices[0] == (f"depth 1: no step measured yet; budget {BUDGET} micro-batches, "
                             "1 micro-batch used")


def test_on_a_fast_wire_auto_holds_no_more_than_depth_1():
  fixed, auto = fixed_and_auto("fast_wire")
  assert auto.depths == [1] * len(auto.depths)
  assert auto.peak_staged <= fixed[1].peak_staged == 1


def test_on_a_slow_wire_auto_keeps_the_depth_that_keeps_the_wire_busy():
  """The wire (12 s) slower than the compute (10.35 s): depth 2 overlaps a crossing with the
  placement before it; no deeper depth can help, and auto says so."""
  _, auto = fixed_and_auto("slow_wire")
  assert auto.depths[2:] == [2] * (len(auto.depths) - 2)
  assert "the wire is the bound" in auto.choices[-1] and "no depth beyond 2" in auto.choices[-1]


def test_spikes_take_auto_deeper_after_the_trainer_waited():
  _, auto = fixed_and_auto("upstream_spikes")
  assert auto.depths[:2] == [1, 1] and max(auto.depths) > 2
  assert any("input wait mid-step" in c for c in auto.choices)


def test_the_sizer_never_exceeds_its_budget_in_bytes():
  sizer = sizing.Sizer(budget_bytes=3 * (5 << 30), microbatch_bytes=5 << 30)
  assert sizer.most == 3
  assert sizer.depth_for(0, 2) == 1
  assert sizer.choices[-1].reason == "depth 1: no step measured yet; budget 15.00 GiB, 5.00 GiB used"
  with pytest.raises(ValueError, match="holds no micro-batch"):
    sizing.Sizer(budget_bytes=1 << 30, microbatch_bytes=2 << 30)


def test_a_smaller_budget_caps_the_depth_where_the_rule_asks_for_more():
  trace = trace_lib.load(str(EXAMPLES / "upstream_spikes.json"))
  auto = run_lib.simulate(trace, "auto2")
  assert max(auto.depths) == 2 and auto.peak_staged <= 2
  assert all(c.endswith(("1 micro-batch used", "2 micro-batches used")) and
             "budget 2 micro-batches" in c for c in auto.choices)


def test_auto_goes_shallower_once_staged_micro_batches_would_sit_unused():
  """The wire near the compute for 5 steps (a cushion: depth 2), then far faster (depth 1 holds
  no more staged micro-batches than it needs)."""
  def step(wire):
    return trace_lib.StepTimes((trace_lib.MicroBatchTimes(wire, 1.0, 10.0),) * 4, 1.0, 5.0)
  trace = trace_lib.Trace(tuple(step(8.0) for _ in range(5)) + tuple(step(1.0)
                                                                   for _ in range(7)), "shift")
  auto = run_lib.simulate(trace, "auto")
  assert auto.depths[2:6] == [2, 2, 2, 2] and auto.depths[-3:] == [1, 1, 1]
  assert auto.choices[-1].startswith("depth 1: a micro-batch's stage ")
