"""The spans: recorded from threads and kept (the bench's), idle arithmetic (the telemetry's),
moved onto one clock and exported as a Chrome trace (the bench's)."""

from __future__ import annotations

import json
import random
import threading

from tests.core.trace_check import partial_overlaps
from tunix_stage_plugin.core.telemetry.recorder import Recorder, Span, busy_time, idle_time
from tunix_stage_plugin.lab.bench.trace import (Kept, lane_track, shifted, to_chrome_trace,
                                                write_chrome_trace)


def test_busy_and_idle_count_overlaps_once_and_clip_to_the_window():
  spans = [Span("dev", "a", 0.0, 2.0), Span("dev", "b", 1.0, 3.0), Span("dev", "c", 5.0, 6.0),
           Span("dev", "d", 9.0, 12.0)]
  assert busy_time(spans, 0.0, 10.0) == 5.0  # [0,3] + [5,6] + [9,10]
  assert idle_time(spans, 0.0, 10.0) == 5.0
  assert idle_time([], 1.0, 4.0) == 3.0
  assert busy_time(spans, 3.0, 5.0) == 0.0


def test_spans_from_many_threads_are_all_recorded():
  tl = Kept()

  def work(i):
    for j in range(100):
      with tl.span(f"thread-{i}", f"w{j}", i=i):
        pass

  threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert len(tl.spans()) == 400 and len(tl.spans("thread-2")) == 100
  assert all(s.end >= s.start for s in tl.spans())
  assert dict(tl.spans("thread-3")[0].args) == {"i": 3}


def test_a_sink_taken_off_its_recorder_keeps_nothing_more():
  rec, tl = Recorder(), Kept()
  rec.add_sink(tl)
  rec.remove_sink(tl)
  with rec.span("t", "x"):
    pass
  rec.add("t", "y", 0, 1)
  assert tl.spans() == [] and not rec.enabled


def test_shift_and_chrome_trace(tmp_path):
  moved = shifted([Span("compute", "fwd", 1.0, 1.5, (("mb", 3),))], offset=10.0, prefix="dev/")
  assert moved == [Span("dev/compute", "fwd", 11.0, 11.5, (("mb", 3),))]
  path = tmp_path / "trace.json"
  write_chrome_trace(str(path), {"inline": moved, "depth2": [Span("stage", "s", 10.5, 10.75)]},
                     origin=10.0)
  events = json.loads(path.read_text())["traceEvents"]
  complete = [e for e in events if e["ph"] == "X"]
  assert [(e["pid"], e["name"], e["ts"], e["dur"]) for e in complete] == [
      (1, "fwd", 1e6, 5e5), (2, "s", 5e5, 2.5e5)]
  assert complete[0]["args"] == {"mb": 3}
  names = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "process_name"}
  assert names == {(1, "inline"), (2, "depth2")}


def _thread_names(trace):
  return {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
          if e["name"] == "thread_name"}


def test_the_checker_sees_a_partial_overlap():
  trace = {"traceEvents": [{"ph": "X", "name": "a", "pid": 1, "tid": 1, "ts": 0, "dur": 2},
                           {"ph": "X", "name": "b", "pid": 1, "tid": 1, "ts": 1, "dur": 2},
                           {"ph": "X", "name": "c", "pid": 1, "tid": 2, "ts": 1, "dur": 2},
                           {"ph": "X", "name": "d", "pid": 1, "tid": 1, "ts": 0.5, "dur": 1}]}
  assert [(a["name"], b["name"]) for a, b in partial_overlaps(trace)] == [("a", "b"),
                                                                         ("b", "d")]


def test_overlapping_spans_of_a_track_go_on_lanes_that_nest():
  spans = [
      Span("trainer/h2d", "s0-m0", 0.0, 2.0), Span("trainer/h2d", "s0-m1", 1.0, 3.0),
      Span("trainer/h2d", "s0-m2", 1.5, 2.5),  # overlaps s0-m0, inside s0-m1: lane 2
      Span("trainer/h2d", "s0-m3", 2.0, 4.0),  # touches s0-m0's end: back on lane 1
      Span("trainer/h2d", "inner", 2.5, 3.5),  # inside s0-m3
      Span("trainer/receive", "r", 0.5, 1.0), Span("device/compute", "fwd", 0.0, 9.0),
      Span("trainer/h2d", "late", 3.0, 5.0),  # overlaps s0-m3 (lane 1); lane 2 is free at 3.0
      Span("trainer/h2d", "tick", 1.00000000001, 1.00000000002),  # rounds to 0 us at 1 s
  ]
  trace = to_chrome_trace({"depth2": spans})
  assert partial_overlaps(trace) == []
  names = _thread_names(trace)
  lane = {e["name"]: names[e["pid"], e["tid"]] for e in trace["traceEvents"] if e["ph"] == "X"}
  assert lane == {"s0-m0": "trainer/h2d", "s0-m1": "trainer/h2d #2", "s0-m2": "trainer/h2d #2",
                  "s0-m3": "trainer/h2d", "inner": "trainer/h2d", "late": "trainer/h2d #2",
                  "tick": "trainer/h2d", "r": "trainer/receive", "fwd": "device/compute"}
  assert {lane_track(n) for n in names.values()} == {"trainer/h2d", "trainer/receive",
                                                    "device/compute"}
  assert lane_track("a #b") == "a #b" and lane_track("x #12") == "x"
  # the same spans written naively, one thread per track, are what the viewers reject
  naive = {"traceEvents": [{"ph": "X", "name": s.name, "pid": 1, "tid": hash(s.track),
                            "ts": s.start * 1e6, "dur": s.duration * 1e6} for s in spans]}
  assert partial_overlaps(naive)


def test_lanes_nest_for_random_spans():
  rng = random.Random(5)
  spans = []
  for i in range(300):
    start = rng.uniform(0, 10)
    spans.append(Span(rng.choice("ab"), f"s{i}", start, start + rng.expovariate(1.0)))
  trace = to_chrome_trace({"g": spans})
  assert partial_overlaps(trace) == []
  assert sum(e["ph"] == "X" for e in trace["traceEvents"]) == 300
  lanes = [n for n in _thread_names(trace).values() if lane_track(n) == "a"]
  assert len(lanes) > 1  # the test has overlaps to separate
