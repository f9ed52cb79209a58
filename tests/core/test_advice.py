"""The one rule of what to change (core/advice.py), row by row of docs/observability.md
"Reading the figures", over windows of step figures built here; the rule over real records and its
check against the simulator: tests/sim/test_advice.py.
"""

from __future__ import annotations

import dataclasses

import pytest

from tunix_stage_plugin.core import advice

SETTINGS = advice.Settings(host="tunix", depth=2, prestage=True, max_device_batches=2,
                           max_host_batches=1)


def window(steps=4, mid=0.0, boundary=0.0, pool=0.0, bound_by="compute", **kwargs):
  """`steps` steps of 2.0 s with the given waits in each (a tuple: one a step)."""
  per_step = lambda v: tuple(v) if isinstance(v, (tuple, list)) else (v,) * steps
  fields = dict(settings=SETTINGS, step_s=(2.0,) * steps, mid_step_s=per_step(mid),
                boundary_s=per_step(boundary), pool_wait_s=per_step(pool), over_bound=0,
                bound_by=per_step(bound_by), refused=(0,) * steps, depth_full=True, transfer_s=0.5,
                place_s=0.1, stage_s=0.6, compute_s=0.5, microbatch_bytes=16 << 20)
  fields.update(kwargs)
  return advice.Window(**fields)


def kinds(w):
  return [a.kind for a in advice.advise(w)]


def test_nothing_held_staging_back_gives_no_advice():
  assert advice.advise(window()) == [] and advice.advise(None) == []


def test_a_wire_slower_than_the_compute_gets_the_codec_or_bandwidth_and_never_the_depth():
  (a,) = advice.advise(window(mid=0.5, bound_by="wire", transfer_s=0.9, place_s=0.0, compute_s=0.5))
  assert a.kind == advice.WIRE and a.change == advice.Change(wire=0.5)
  assert a.setting.startswith("compress the payload (TUNIX_STAGE_CODEC=on")
  assert "no depth beyond 1 can hide it" in a.why and "0.90 s to cross against 0.50 s" in a.why
  assert a.figure == advice.Figure("input wait mid-step", 0.5, 4, 4)
  assert "decided by input wait mid-step 0.50 s a step (in 4 of 4 steps)" in a.line()


def test_a_mid_step_wait_with_the_depth_used_up_and_a_wire_that_keeps_up_gets_the_depth():
  found = advice.advise(window(mid=0.3, bound_by="wire", transfer_s=0.4, compute_s=0.5))
  assert [a.kind for a in found] == [advice.DEPTH, advice.WIRE]
  depth = found[0]
  assert depth.setting == "TUNIX_MAX_STAGED_BATCHES=3 with TUNIX_STAGE_MAX_DEVICE_BATCHES=3"
  assert depth.change == advice.Change(depth=3, max_device_batches=3)
  assert depth.cost == "16.0 MiB of device memory per micro-batch more"
  # The depth not used up (the stages could not keep it full): more depth would not be used.
  assert advice.DEPTH not in kinds(window(mid=0.3, transfer_s=0.4, compute_s=0.5,
                                          depth_full=False))


@pytest.mark.parametrize("host, setting, change", [
    ("tunix", "let the program prestage (max_staleness >= 1, and _prestage_across_boundary "
     "answering True)", advice.Change(prestage=True)),
    ("embedded", "TUNIX_MAX_STAGED_BATCHES=2 (the embedded job prestages at a depth of 2 or "
     "more)", advice.Change(prestage=True, depth=2)),
])
def test_a_boundary_wait_with_nothing_prestaged_names_the_host_s_own_knob(host, setting, change):
  settings = dataclasses.replace(SETTINGS, host=host, depth=1, prestage=False)
  (a,) = advice.advise(window(boundary=0.4, settings=settings))
  assert (a.kind, a.setting, a.change) == (advice.PRESTAGE, setting, change)
  assert a.figure.name == "input wait at the boundary"
  # Already prestaging, or not known (no orchestrator record): no prestage advice.
  for prestage in (True, None):
    assert advice.advise(window(boundary=0.4, settings=dataclasses.replace(
        settings, prestage=prestage))) == []


def test_a_cause_in_a_minority_of_the_steps_still_counts():
  """3 of 6 steps bound by the wire: their median wait hides them, the rule does not."""
  mid = (0.5, 0.0, 0.5, 0.0, 0.5, 0.0)
  bound = tuple("wire" if m else "compute" for m in mid)
  found = advice.advise(window(steps=6, mid=mid, bound_by=bound, transfer_s=0.7))
  assert [a.kind for a in found] == [advice.WIRE]
  assert str(found[0].figure) == "input wait mid-step 0.25 s a step (in 3 of 6 steps)"
  # One step of 6 is below the share a cause needs (advice.STEP_SHARE).
  mid = (0.5,) + (0.0,) * 5
  assert advice.advise(window(steps=6, mid=mid, bound_by=("wire",) + ("compute",) * 5,
                              transfer_s=0.7)) == []


def test_pool_waits_refusals_and_shared_cores():
  # Transfers that waited for a receive buffer while the trainer never waited cost nothing.
  assert advice.advise(window(pool=0.3)) == []
  a, = advice.advise(window(pool=0.3, boundary=0.3))
  assert (a.kind, a.setting, a.change) == (
      advice.HOST_BOUND, "TUNIX_STAGE_MAX_HOST_BATCHES=2", advice.Change(max_host_batches=2))
  assert [b.kind for b in advice.advise(window(over_bound=1))] == [advice.HOST_BOUND]
  assert a.cost == "one more receive buffer on the trainer: 16.0 MiB of host memory"
  a, = advice.advise(window(refused=(0, 3, 0, 0)))
  assert (a.kind, a.setting, str(a.figure)) == (
      advice.DEVICE_BOUND, "TUNIX_STAGE_MAX_DEVICE_BATCHES=3", "stages refused 3 (in 1 of 4 steps)")
  a, = advice.advise(window(bound_by="shared cores"))
  assert a.kind == advice.CORES and a.change is None  # nothing staging sets


def test_a_change_applies_to_the_settings_it_names_only():
  changed = advice.Change(depth=3, max_device_batches=3).applied(SETTINGS)
  assert changed == dataclasses.replace(SETTINGS, depth=3, max_device_batches=3)
  assert changed.mode == "depth3_prestage"
  assert advice.Change(wire=0.5).applied(SETTINGS) == SETTINGS


def test_where_the_wire_is_the_bound_the_depth_that_overlaps_it_with_the_placement_still_helps():
  """A crossing of 12 s and a placement of 3.9 s against 10.35 s of compute: at depth 1 they run
  one after the other (15.9 s a micro-batch); depth 2 overlaps them. The report's advice names no
  deeper one; a sizer tries one more only while the trainer waits with the depth used up (a
  jittery wire's fast crossings bank micro-batches), and a depth the stages cannot fill ends it."""
  settings = dataclasses.replace(SETTINGS, depth=1)
  w = window(mid=8.0, bound_by="wire", transfer_s=12.0, place_s=3.9, stage_s=15.9, compute_s=10.35,
             settings=settings, step_s=(110.0,) * 4)
  assert w.wire_depth == 2
  assert kinds(w) == [advice.DEPTH, advice.WIRE]
  assert "no depth beyond 2 can hide it" in advice.advise(w)[1].why
  assert advice.choose_depth(w, 4)[0] == 2
  at_two = dataclasses.replace(w, settings=dataclasses.replace(settings, depth=2))
  assert kinds(at_two) == [advice.WIRE] and advice.choose_depth(at_two, 4, 2)[0] == 3
  not_full = dataclasses.replace(at_two, depth_full=False)
  depth, why, _ = advice.choose_depth(not_full, 4, 2)
  assert depth == 2 and why.startswith("the wire is the bound")
  # Waiting with a depth not used up, never shallower: a shallower one waits longer.
  assert advice.choose_depth(not_full, 4, 3) == (3, "kept: input wait mid-step 8.00 s a step (in "
                                                 "4 of 4 steps), with the depth not used up", False)


def test_the_depth_chosen_is_the_stages_a_compute_spans_with_a_cushion_for_spikes():
  assert advice.choose_depth(None, 4) == (1, "no step measured yet", False)
  assert advice.choose_depth(None, 4, 2) == (2, "no step measured yet", False)  # the one in force
  fast = window(transfer_s=1.0, stage_s=1.5, compute_s=10.35)
  assert advice.choose_depth(fast, 4)[0] == 1  # 2 x 1.5 s fits in one compute
  assert advice.choose_depth(fast, 4, 2)[0] == 1  # shallower: the trainer did not wait
  near = window(transfer_s=5.5, stage_s=9.4, compute_s=10.35)
  depth, why, needed = advice.choose_depth(near, 4, 2)
  assert (depth, needed) == (2, False) and why.startswith("a micro-batch's stage 9.40 s against "
                                                          "10.35 s of compute, 2x spikes included")
  assert advice.choose_depth(near, 1, 2)[0] == 1  # the budget holds one
  # Deeper only on a measured wait: from depth 1, where no step waited, the cushion's 2 is said
  # and not taken (a climb costs a micro-batch's transfer and memory that bought nothing yet).
  depth, why, needed = advice.choose_depth(near, 4)
  assert (depth, needed) == (1, False) and why.startswith(
      "kept: no mid-step wait with the depth used up (a micro-batch's stage 9.40 s against "
      "10.35 s of compute, 2x spikes included")
  waited = window(mid=0.3, bound_by="wire", transfer_s=0.4, compute_s=0.5)
  assert advice.choose_depth(waited, 4) == (3, "input wait mid-step 0.30 s a step (in 4 of 4 "
                                            "steps)", True)
