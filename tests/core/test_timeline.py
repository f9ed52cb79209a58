"""Timeline: span recording from threads, idle arithmetic, Chrome trace export."""

from __future__ import annotations

import json
import threading

from tunix_stage_plugin.core.timeline import (Span, Timeline, busy_time, idle_time, shifted,
                                              write_chrome_trace)


def test_busy_and_idle_count_overlaps_once_and_clip_to_the_window():
  spans = [Span("dev", "a", 0.0, 2.0), Span("dev", "b", 1.0, 3.0), Span("dev", "c", 5.0, 6.0),
           Span("dev", "d", 9.0, 12.0)]
  assert busy_time(spans, 0.0, 10.0) == 5.0  # [0,3] + [5,6] + [9,10]
  assert idle_time(spans, 0.0, 10.0) == 5.0
  assert idle_time([], 1.0, 4.0) == 3.0
  assert busy_time(spans, 3.0, 5.0) == 0.0


def test_spans_from_many_threads_are_all_recorded():
  tl = Timeline()

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


def test_disabled_timeline_records_nothing():
  tl = Timeline(enabled=False)
  with tl.span("t", "x"):
    pass
  tl.add("t", "y", 0, 1)
  assert tl.spans() == []


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
