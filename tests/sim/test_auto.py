"""`auto`: the stage-ahead depth sized each step by core.sizing.Sizer's rule, proven in the
simulator's virtual time (deterministic) on four patterns (examples/), as shipped and with three
what-ifs: auto's median step within 1 % of the best fixed depth 1..4 (the bounds at their
defaults), its mean within 2 % (each fixed depth's device bound its depth), its peak staged
micro-batches within its budget and no more than pays (the peak rule below), its first steps at
the fixed default's depth, and on the fast-wire pattern depth 1 once a step is measured.
docs/simulate.md "auto" has the tables.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from tunix_stage_plugin.core import sizing
from tunix_stage_plugin.lab.sim import run as run_lib
from tunix_stage_plugin.lab.sim import trace as trace_lib

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
PATTERNS = ("upstream_pattern", "upstream_spikes", "slow_wire", "fast_wire")
BUDGET = run_lib.AUTO_BUDGET  # micro-batches


@functools.lru_cache(maxsize=None)
def simulated(pattern, mode, device=1, what_if=()):
  """One mode over a pattern (with --what_if's factors), run once for every test that asks."""
  trace = trace_lib.load(str(EXAMPLES / f"{pattern}.json")).scaled(dict(what_if))
  return run_lib.simulate(trace, mode, max_device_batches=device)


def fixed_and_auto(pattern):
  fixed = {n: simulated(pattern, f"depth{n}_prestage", n) for n in range(1, 5)}
  return fixed, simulated(pattern, "auto")


@pytest.mark.parametrize("pattern", PATTERNS)
def test_auto_is_within_2_percent_of_the_best_fixed_depth_and_within_its_budget(pattern):
  fixed, auto = fixed_and_auto(pattern)
  best = min(r.mean_step_s for r in fixed.values())
  assert auto.mean_step_s <= 1.02 * best, (auto.mean_step_s, {n: r.mean_step_s
                                                              for n, r in fixed.items()})
  assert auto.peak_staged <= BUDGET and max(auto.depths) <= BUDGET
  assert auto.fallbacks == 0
  # Its choice and reason each step; the fixed default before the first step's figures.
  assert len(auto.choices) == len(auto.depths) == len(auto.step_s) + 1
  assert auto.choices[0] == (f"depth 2: the default (no step measured yet); budget {BUDGET} "
                             "micro-batches, 2 micro-batches used")


# The cases auto is held to as the default (docs/simulate.md "auto as the default"): each example
# pattern as shipped and with a wire twice as slow, a wire three times as fast, a compute twice as
# fast; `tunix-stage simulate PATTERN --modes depth1_prestage,...,depth4_prestage,auto
# [--what_if W]`, the bounds at their defaults.
WHAT_IFS = ({}, {"wire": 2.0}, {"wire": 0.33}, {"compute": 0.5})


# What pays, in total time: fixed depths within this share of the best fixed total are as good.
PAYS = 0.005


def allowed_peak(fixed):
  """The most auto may hold staged at once: the default's 2, or the smallest peak among the fixed
  depths whose total time (every step) is within PAYS of the best fixed total."""
  best = min(r.total_s for r in fixed)
  return max(2, min(r.peak_staged for r in fixed if r.total_s <= (1 + PAYS) * best))


@pytest.mark.parametrize("what_if", WHAT_IFS, ids=lambda w: ",".join(f"{k}={v:g}x" for k, v in
                                                                     w.items()) or "shipped")
@pytest.mark.parametrize("pattern", PATTERNS)
def test_auto_is_never_worse_than_the_best_fixed_depth_and_holds_no_more_than_pays(pattern,
                                                                                   what_if):
  """Its median step at most 1 % over the best fixed depth 1..4 (prestaging, the bounds at their
  defaults), its first step at the fixed default's depth, its peak within its budget and at
  most the allowed peak, unless its own total beats the best fixed total by more than PAYS (then
  the memory paid)."""
  what_if = tuple(what_if.items())
  fixed = [simulated(pattern, f"depth{n}_prestage", what_if=what_if) for n in range(1, 5)]
  best = min(r.median_step_s for r in fixed)
  auto = simulated(pattern, "auto", what_if=what_if)
  assert auto.median_step_s <= 1.01 * best, (auto.median_step_s, best, auto.choices)
  assert auto.peak_staged <= BUDGET and auto.depths[0] == 2
  paid = auto.total_s < (1 - PAYS) * min(r.total_s for r in fixed)
  assert auto.peak_staged <= allowed_peak(fixed) or paid, (
      auto.peak_staged, allowed_peak(fixed), auto.total_s, [r.total_s for r in fixed],
      auto.choices)


def test_on_a_fast_wire_auto_goes_down_to_depth_1_once_a_step_is_measured():
  """It starts at the fixed default (2) and holds one micro-batch from its first measured step:
  a stage far shorter than a compute sits unused a second deep."""
  _, auto = fixed_and_auto("fast_wire")
  assert auto.depths[:2] == [2, 2] and auto.depths[2:] == [1] * (len(auto.depths) - 2)
  assert auto.choices[-1].startswith("depth 1: a micro-batch's stage ")


@pytest.mark.parametrize("what_if", [(), (("wire", 2.0),)], ids=["shipped", "wire=2x"])
def test_on_a_slow_wire_auto_holds_the_depth_that_keeps_the_wire_busy(what_if):
  """The wire (12 s, or 24 s) slower than the compute (10.35 s): depth 2 overlaps a crossing with
  the placement before it. The trainer waits mid-step every step, but the wire is busy nearly
  the whole step: one more staged micro-batch could remove too little of the wait to pay for
  its memory (depth 3 would save 0.3 % of the total as shipped, nothing at 2x)."""
  auto = simulated("slow_wire", "auto", what_if=what_if)
  assert auto.depths == [2] * len(auto.depths) and auto.peak_staged == 2
  assert any(c.startswith("depth 2: kept: input wait mid-step ") and
             "too little for one more" in c for c in auto.choices), auto.choices


def test_one_spike_s_wait_does_not_take_auto_deeper():
  """As shipped, one step of twelve waits mid-step (a 2x stage spike): 2.35 s a step over its
  window, under figures.SHARE of the step, so auto holds 2 (depth 3 would save 0.1 %)."""
  _, auto = fixed_and_auto("upstream_spikes")
  assert auto.depths == [2] * len(auto.depths) and auto.peak_staged == 2
  assert any("too little for one more" in c for c in auto.choices), auto.choices


@pytest.mark.parametrize("what_if", [(("wire", 2.0),), (("compute", 0.5),)],
                         ids=["wire=2x", "compute=0.5x"])
def test_spikes_take_auto_deeper_after_the_trainer_waited(what_if):
  """With the wire twice as slow, or the compute twice as fast, the spikes' waits are a fifth of
  a step: one deeper, one step at a time, on a measured mid-step wait."""
  auto = simulated("upstream_spikes", "auto", what_if=what_if)
  assert auto.depths[:2] == [2, 2] and max(auto.depths) > 2
  for depth, before, why in zip(auto.depths[1:], auto.depths, auto.choices[1:]):
    assert depth <= before or (depth == before + 1 and
                               why.startswith(f"depth {depth}: input wait mid-step ")), why


def test_a_depth_the_stages_cannot_fill_is_given_back():
  """The wire twice as slow on the spikes: auto climbs to 4 after the trainer waited at 3, but the
  stages never keep 4 ahead, so it goes back to 3 (peak 3, the best fixed depth's)."""
  auto = simulated("upstream_spikes", "auto", what_if=(("wire", 2.0),))
  assert max(auto.depths) == 4 and auto.depths[-1] == 3 and auto.peak_staged == 3
  assert any(c.startswith("depth 3: depth 4 was never filled in ") for c in auto.choices)


def test_the_sizer_never_exceeds_its_budget_in_bytes():
  sizer = sizing.Sizer(budget_bytes=3 * (5 << 30), microbatch_bytes=5 << 30)
  assert sizer.most == 3
  assert sizer.depth_for(0, 2) == 2
  assert sizer.choices[-1].reason == ("depth 2: the default (no step measured yet); budget "
                                      "15.00 GiB, 10.00 GiB used")
  # A budget of one and a half micro-batches: the default's depth 2 would exceed it.
  sizer = sizing.Sizer(budget_bytes=3 * (5 << 29), microbatch_bytes=5 << 30)
  assert sizer.depth_for(0, 2) == 1
  assert sizer.choices[-1].reason == ("depth 1: the budget decided (depth 2 asked: the "
                                      "default (no step measured yet)); budget 7.50 GiB, 5.00 GiB "
                                      "used")
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
