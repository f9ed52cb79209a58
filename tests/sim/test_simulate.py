"""`tunix-stage simulate`: the real core pipeline in virtual time against the resource model.

Times here are virtual (looptime's event-loop clock), so the predictions are exact arithmetic and
can be asserted; nothing here measures wall time.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tunix_stage_plugin.cli import main as cli_main
from tunix_stage_plugin.lab.sim import command as simulate_cmd
from tunix_stage_plugin.core.timeline import Span, to_chrome_trace
from tunix_stage_plugin.lab.sim import run as run_lib
from tunix_stage_plugin.lab.sim import trace as trace_lib

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "upstream_pattern.json"


def uniform(steps=3, m=4, wire=0.8, h2d=0.4, compute=1.0, update=0.1, boundary=0.5):
  mb = trace_lib.MicroBatchTimes(wire, h2d, compute)
  return trace_lib.Trace(tuple(trace_lib.StepTimes((mb,) * m, update, boundary)
                               for _ in range(steps)), "uniform")


def test_inline_and_resident_are_the_arithmetic_of_their_resources():
  trace = uniform()
  inline = run_lib.simulate(trace, "inline")
  resident = run_lib.simulate(trace, "resident")
  # inline: each micro-batch's wire, copy and compute one after another, then update, boundary
  assert inline.step_s == pytest.approx([4 * (0.8 + 0.4 + 1.0) + 0.1 + 0.5] * 2)
  assert resident.step_s == pytest.approx([4 * 1.0 + 0.1 + 0.5] * 2)
  assert resident.mid_step_idle_s == pytest.approx([0.0, 0.0])


def test_staging_with_prestage_reaches_resident_when_each_resource_is_below_compute():
  trace = uniform(m=9)
  results = {m: run_lib.simulate(trace, m) for m in ("inline", "depth1", "depth2",
                                                     "depth2_prestage", "resident")}
  steps = {m: r.median_step_s for m, r in results.items()}
  assert steps["inline"] > steps["depth1"] > steps["depth2"] > steps["depth2_prestage"]
  assert steps["depth2_prestage"] == pytest.approx(steps["resident"])
  assert run_lib.hidden_fractions(results)["depth2_prestage"] == pytest.approx(1.0)
  assert all(r.fallbacks == 0 for r in results.values())


def test_a_wire_slower_than_compute_bounds_the_step_and_what_if_lifts_it():
  slow = uniform(m=9, wire=1.2)
  staged = run_lib.simulate(slow, "depth2_prestage").median_step_s
  assert staged >= 9 * 1.2  # bound by the wire
  faster = run_lib.simulate(slow.scaled({"wire": 0.5}), "depth2_prestage").median_step_s
  assert faster == pytest.approx(run_lib.simulate(slow, "resident").median_step_s)


def test_other_depths_are_modes_and_unknown_ones_are_refused():
  assert run_lib.plan_of("depth3_prestage") == run_lib.Plan("staged", 3, True)
  with pytest.raises(ValueError, match="depthN / depthN_prestage"):
    run_lib.plan_of("deep")
  with pytest.raises(ValueError, match="does not model a codec.*--what_if wire=Fx"):
    run_lib.plan_of("depth2_prestage_codec")


def test_the_trace_formats_load_the_same_times(tmp_path):
  rows = ["step,microbatch,wire_s,h2d_s,compute_s,update_s,boundary_s"]
  rows += [f"{s},{i},0.8,0.4,1.0,0.1,0.5" for s in range(3) for i in range(4)]
  (tmp_path / "t.csv").write_text("\n".join(rows))
  from_csv = trace_lib.load(str(tmp_path / "t.csv"))
  as_json = {"steps": [{"update_s": 0.1, "boundary_s": 0.5, "microbatches": [
      {"wire_s": 0.8, "h2d_s": 0.4, "compute_s": 1.0}] * 4}] * 3}
  (tmp_path / "t.json").write_text(json.dumps(as_json))
  assert from_csv.steps == trace_lib.load(str(tmp_path / "t.json")).steps == uniform().steps


@pytest.mark.parametrize("content, message", [
    ("{}", "expected a JSON object with a 'steps' list"),
    ('{"steps": []}', "no step"),
    ('{"steps": [{"microbatches": [{"wire_s": -1, "h2d_s": 0, "compute_s": 1}]}]}',
     "step 0 micro-batch 0 wire_s: -1 is not a time"),
    ("not json", "not JSON"),
])
def test_a_bad_trace_is_one_clear_error_and_exit_2(tmp_path, capsys, content, message):
  path = tmp_path / "bad.json"
  path.write_text(content)
  assert cli_main.main(["simulate", str(path)]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and message in err, err


def test_bad_options_are_all_reported_before_simulating(capsys):
  code = cli_main.main(["simulate", str(EXAMPLE), "--what_if", "disk=2x", "--what_if",
                        "wire=0", "--modes", "inline,warp", "--stage_max_device_batches", "0"])
  err = capsys.readouterr().err
  assert code == 2 and err.count("\n") == 4, err
  assert "--what_if 'disk=2x'" in err and "--what_if 'wire=0'" in err
  assert "unknown mode 'warp'" in err and "--stage_max_device_batches '0'" in err


def test_the_example_of_the_upstream_pattern_runs_and_writes_json(tmp_path, capsys):
  out = tmp_path / "sim.json"
  assert cli_main.main(["simulate", str(EXAMPLE), "--json", str(out)]) == 0
  table = capsys.readouterr().out
  assert "depth2_prestage" in table and "saved s" in table
  report = json.loads(out.read_text())
  modes = report["modes"]
  assert set(modes) == {"inline", "depth1", "depth2", "depth2_prestage", "resident"}
  assert modes["inline"]["saved_s"] == 0
  assert modes["inline"]["total_s"] > modes["depth2_prestage"]["total_s"] > \
      modes["resident"]["total_s"]
  assert modes["depth2_prestage"]["predicted_median_step_s"] == pytest.approx(
      modes["resident"]["predicted_median_step_s"])


def test_check_predicts_a_tiny_bench_run(tmp_path):
  """Structure only: a --tiny run's steps last milliseconds, so its accuracy means nothing."""
  out = tmp_path / "b"
  bench = subprocess.run(
      [sys.executable, "-m", "tunix_stage_plugin.cli.main", "bench", "--tiny", "--quick",
       "--steps", "1", "--microbatches", "3", "--payload_mib", "0.05", "--out", str(out),
       "--png", ""], capture_output=True, text=True, timeout=300)
  assert bench.returncode == 0, bench.stderr[-3000:]
  check = subprocess.run(
      [sys.executable, "-m", "tunix_stage_plugin.cli.main", "simulate", "--check",
       str(out / "bench.json"), "--json", "-"], capture_output=True, text=True, timeout=120)
  assert check.returncode == 0, check.stderr  # a --tiny bench is not judged
  report = json.loads(check.stdout)
  assert report["check"] is True and report["tiny"] is True and set(report["modes"]) == {
      "inline", "depth1", "depth2", "depth2_prestage", "resident"}
  for figures in report["modes"].values():
    assert figures["predicted_median_step_s"] > 0 and figures["measured_median_step_s"] > 0
    assert figures["within_tolerance"] is None

  # Its Chrome trace is an input too: the inline run's own spans, micro-batch by micro-batch.
  trace = trace_lib.load(str(out / "trace.json"))
  assert [len(step.microbatches) for step in trace.steps] == [3, 3]  # warm-up + timed step
  # (its payloads are under 1 MiB: one message each, so no receive span and no wire time)
  assert all(mb.wire_s == 0 and mb.h2d_s >= 0 and mb.compute_s > 0 for step in trace.steps
             for mb in step.microbatches)


def test_a_bench_trace_whose_track_was_split_into_lanes_reads_as_one_track():
  spans = [Span("trainer/receive", "s0-m0", 0.0, 0.3),
           Span("trainer/receive", "s0-m1", 0.2, 0.5),
           Span("trainer/h2d", "s0-m0", 0.3, 0.5), Span("trainer/h2d", "s0-m1", 0.4, 0.7),
           Span("device/compute", "s0-m0", 0.5, 1.0, (("kind", "fwd_bwd"), ("step", 0))),
           Span("device/compute", "s0-m1", 1.0, 1.5, (("kind", "fwd_bwd"), ("step", 0))),
           Span("device/compute", "update", 1.5, 1.6, (("kind", "update"), ("step", 0)))]
  data = to_chrome_trace({"inline (round 1)": spans})
  lanes = {e["args"]["name"] for e in data["traceEvents"] if e["name"] == "thread_name"}
  assert {"trainer/receive #2", "trainer/h2d #2"} <= lanes  # the overlaps were split
  trace = trace_lib.from_chrome_trace(data, "t.json")
  (step,) = trace.steps
  assert [(mb.wire_s, mb.h2d_s, mb.compute_s) for mb in step.microbatches] == [
      pytest.approx((0.3, 0.2, 0.5)), pytest.approx((0.3, 0.3, 0.5))]
  assert step.update_s == pytest.approx(0.1)


TINY_BENCH = EXAMPLE.parent / "bench_tiny_a.json"  # a shipped --tiny bench JSON


def test_check_on_a_tiny_bench_judges_nothing_and_exits_0(capsys):
  assert json.loads(TINY_BENCH.read_text())["options"]["tiny"] is True
  assert cli_main.main(["simulate", "--check", str(TINY_BENCH)]) == 0
  out = capsys.readouterr().out
  rows = [l for l in out.splitlines() if l.split()[:1] and l.split()[0] in (
      "inline", "depth1", "depth2", "depth2_prestage", "resident")]
  assert len(rows) == 5 and all(r.endswith(simulate_cmd.TINY_NA) for r in rows), out
  assert "OFF" not in out and "--tiny bench" in out.splitlines()[0]


def test_check_judges_the_same_figures_when_the_bench_is_not_tiny(tmp_path, capsys):
  # The same recorded times without the --tiny mark: the predictions are off by ~40 % and fail.
  bench = json.loads(TINY_BENCH.read_text())
  bench["options"]["tiny"] = False
  path = tmp_path / "bench.json"
  path.write_text(json.dumps(bench))
  assert cli_main.main(["simulate", "--check", str(path)]) == 1
  out = capsys.readouterr().out
  assert "OFF by more than 5%" in out and simulate_cmd.TINY_NA not in out


def test_the_tiny_label_is_the_bench_s():
  from tunix_stage_plugin.lab.bench import report  # pylint: disable=import-outside-toplevel
  assert simulate_cmd.TINY_NA == report.TINY_NA


@pytest.mark.parametrize("check", [False, True], ids=["trace", "check"])
def test_a_file_that_is_not_utf8_is_one_line_naming_it(tmp_path, capsys, check):
  path = tmp_path / "latin1.json"
  path.write_bytes(b'{"steps": [], "note": "caf\xe9"}')
  assert cli_main.main(["simulate", *(["--check"] if check else []), str(path)]) == 2
  captured = capsys.readouterr()
  assert captured.out == ""
  assert captured.err == (f"tunix-stage simulate: error: {path}: not UTF-8 text (byte 0xe9 at "
                          f"offset 26); accepted: {trace_lib.ACCEPTED_INPUT}\n")


def test_check_of_a_missing_file_is_one_line(tmp_path, capsys):
  path = tmp_path / "nope.json"
  assert cli_main.main(["simulate", "--check", str(path)]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and f"{path}: cannot read it (No such file or directory)" in err


def test_a_csv_with_a_byte_order_mark_reads_as_without_it(tmp_path):
  rows = ["step,microbatch,wire_s,h2d_s,compute_s,update_s,boundary_s"]
  rows += [f"{s},{i},0.8,0.4,1.0,0.1,0.5" for s in range(3) for i in range(4)]
  path = tmp_path / "t.csv"
  path.write_bytes(b"\xef\xbb\xbf" + "\n".join(rows).encode())
  assert trace_lib.load(str(path)).steps == uniform().steps


@pytest.mark.parametrize("check", [False, True], ids=["trace", "check"])
def test_a_step_past_the_trace_is_refused_before_simulating(tmp_path, capsys, monkeypatch, check):
  def simulated(*args, **kwargs):
    raise AssertionError("simulated before the --step check")

  monkeypatch.setattr(run_lib, "simulate", simulated)
  png = tmp_path / "p.png"
  source = TINY_BENCH if check else EXAMPLE
  steps = len(json.loads(source.read_text())["runs"][0]["fwd_bwd_s"]) if check else 3
  code = cli_main.main(["simulate", *(["--check"] if check else []), str(source), "--step",
                        "99", "--png", str(png)])
  captured = capsys.readouterr()
  assert code == 2 and captured.out == "" and not png.exists()
  assert captured.err == (f"tunix-stage simulate: error: --step 99: accepted: a step from 1 to "
                          f"{steps} (the trace's steps after the fill, step 0)\n")
