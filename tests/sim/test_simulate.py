"""`tunix-stage simulate`: the real core pipeline in virtual time against the resource model.

Times here are virtual (looptime's event-loop clock), so the predictions are exact arithmetic and
can be asserted; nothing here measures wall time.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tunix_stage_plugin.cli import main as cli_main
from tunix_stage_plugin.lab.sim import command as simulate_cmd
from tunix_stage_plugin.core.telemetry.recorder import Span
from tunix_stage_plugin.lab.bench.trace import to_chrome_trace
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
    ("{}", 'bad.json is invalid: no steps list; accepted: a JSON object with a "steps" list'),
    ('{"steps": []}', "bad.json is invalid: 0 step(s); accepted: at least 2 steps"),
    ('{"steps": [{"microbatches": [{"wire_s": -1, "h2d_s": 0, "compute_s": 1}]}]}',
     "bad.json step 0 micro-batch 0 wire_s='-1' is invalid; accepted: a finite number of "
     "seconds >= 0 and <= 1e+07"),
    ("not json", "bad.json is invalid: not JSON (Expecting value at line 1); accepted: "),
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
  assert "--what_if='disk=2x' is invalid; accepted: RESOURCE=F" in err
  assert "--what_if='wire=0' is invalid; accepted: RESOURCE=F" in err
  assert "--modes='inline,warp' is invalid: unknown mode 'warp'; accepted: inline," in err
  assert ("--stage_max_device_batches='0' is invalid; accepted: an integer >= 1 and <= 1024"
          in err)  # the settings table's range, as `tunix-stage config` says it


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


def test_check_predicts_a_tiny_bench_run(tiny_run):
  """Structure only: a --tiny run's steps last milliseconds, so its accuracy means nothing.
  (tiny_run: `bench --tiny --quick --steps 1 --microbatches 3`, tests/conftest.py.)"""
  bench, out = tiny_run
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
  spans = []
  for step in range(2):  # (a trace has 2 steps at least: the first fills the pipeline)
    t = 2.0 * step
    spans += [Span("trainer/receive", f"s{step}-m0", t + 0.0, t + 0.3),
              Span("trainer/receive", f"s{step}-m1", t + 0.2, t + 0.5),
              Span("trainer/h2d", f"s{step}-m0", t + 0.3, t + 0.5),
              Span("trainer/h2d", f"s{step}-m1", t + 0.4, t + 0.7),
              Span("device/compute", f"s{step}-m0", t + 0.5, t + 1.0,
                   (("kind", "fwd_bwd"), ("step", step))),
              Span("device/compute", f"s{step}-m1", t + 1.0, t + 1.5,
                   (("kind", "fwd_bwd"), ("step", step))),
              Span("device/compute", "update", t + 1.5, t + 1.6,
                   (("kind", "update"), ("step", step)))]
  data = to_chrome_trace({"inline (round 1)": spans})
  lanes = {e["args"]["name"] for e in data["traceEvents"] if e["name"] == "thread_name"}
  assert {"trainer/receive #2", "trainer/h2d #2"} <= lanes  # the overlaps were split
  trace = trace_lib.from_chrome_trace(data, "t.json")
  for step in trace.steps:
    assert [(mb.wire_s, mb.h2d_s, mb.compute_s) for mb in step.microbatches] == [
        pytest.approx((0.3, 0.2, 0.5)), pytest.approx((0.3, 0.3, 0.5))]
    assert step.update_s == pytest.approx(0.1)
  assert len(trace.steps) == 2


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


def with_a_rerun(bench, mode, factor=3.0):
  """`bench` as the runner leaves it where `mode`'s run of round 0 had no quiet step: that run
  (its recorded times `factor` times longer, as another process's load makes them) kept before
  its re-run, and the mode's summary over both runs' steps, its median over the quiet ones."""
  out = copy.deepcopy(bench)
  at, run = next((i, r) for i, r in enumerate(out["runs"]) if r["mode"] == mode)
  noisy = copy.deepcopy(run)
  for key in ("step_s", "update_s"):
    noisy[key] = [v * factor for v in noisy[key]]
  noisy["fwd_bwd_s"] = [[v * factor for v in step] for step in noisy["fwd_bwd_s"]]
  noisy["step_quiet"] = [False] * len(noisy["step_s"])
  noisy["other_processes_cores"] = [1.5] * len(noisy["step_s"])
  out["runs"].insert(at, noisy)
  summary = out["modes"][mode]
  summary["step_s"] = noisy["step_s"] + summary["step_s"]
  summary["step_quiet"] = noisy["step_quiet"] + summary["step_quiet"]
  return out, at


def _check_json(capsys, path):
  code = cli_main.main(["simulate", "--check", str(path), "--json", "-"])
  return code, json.loads(capsys.readouterr().out)


def test_check_measures_against_the_steps_the_bench_counted(tmp_path, capsys):
  """A bench JSON holding a re-run: depth2's run of round 0 had no quiet step, so the bench ran
  it again and took its median over the re-run's quiet steps. --check predicts from those same
  steps: the busy run is left out, and said, and every prediction is the one on the JSON without
  it. (The re-run is written into a real bench JSON as the runner leaves one: a busy machine
  cannot be had on demand.)"""
  bench = json.loads(TINY_BENCH.read_text())
  rerun, at = with_a_rerun(bench, "depth2")
  paths = {}
  for name, data in (("bench", bench), ("rerun", rerun)):
    paths[name] = tmp_path / f"{name}.json"
    paths[name].write_text(json.dumps(data))
  _, plain = _check_json(capsys, paths["bench"])
  _, checked = _check_json(capsys, paths["rerun"])
  for mode, figures in checked["modes"].items():
    assert figures["predicted_median_step_s"] == plain["modes"][mode]["predicted_median_step_s"]
    assert figures["measured_median_step_s"] == bench["modes"][mode]["median_step_s"]
  assert checked["modes"]["depth2"]["counted"] == {"runs": [at + 1], "left_out": [at],
                                                   "steps": [0], "over": "quiet steps"}
  assert checked["modes"]["inline"]["counted"] == {"runs": [0], "left_out": [], "steps": [0],
                                                   "over": "quiet steps"}
  # Counted, the busy run would have moved the prediction: the selection is what keeps it.
  rerun["runs"][at]["step_quiet"] = [True]
  paths["rerun"].write_text(json.dumps(rerun))
  _, counted = _check_json(capsys, paths["rerun"])
  assert counted["modes"]["depth2"]["predicted_median_step_s"] > \
      plain["modes"]["depth2"]["predicted_median_step_s"]
  assert counted["modes"]["depth2"]["counted"]["left_out"] == []
  # The table says which runs and steps it used where a run was left out, and only there.
  rerun["runs"][at]["step_quiet"] = [False]
  paths["rerun"].write_text(json.dumps(rerun))
  assert cli_main.main(["simulate", "--check", str(paths["rerun"])]) == 0
  out = capsys.readouterr().out.splitlines()
  assert out[0].startswith(f"tunix-stage simulate --check {paths['rerun']}: predicted vs "
                           "measured median step, each over the steps the bench's median "
                           "counted")
  assert out[-1] == (f"depth2: quiet steps of runs[{at + 1}], timed steps 0; left out: "
                     f"runs[{at}] (no quiet step: re-run)")
  assert not [line for line in out if line.startswith(("inline:", "depth1:", "resident:"))]


def test_with_no_quiet_step_check_counts_every_step_as_the_bench_did(tmp_path, capsys):
  """The bench's re-runs spent and still no quiet step: its medians are over every step, and so
  is --check's trace (the busy run's times among them), said."""
  rerun, at = with_a_rerun(json.loads(TINY_BENCH.read_text()), "depth1")
  rerun["runs"][at + 1]["step_quiet"] = [False]
  path = tmp_path / "bench.json"
  path.write_text(json.dumps(rerun))
  _, checked = _check_json(capsys, path)
  assert checked["modes"]["depth1"]["counted"] == {
      "runs": [at, at + 1], "left_out": [], "steps": [0], "over": "every step (no quiet one)"}
  busy, quiet = (trace_lib.bench_trace(rerun, "depth1", "b")[0].steps[1].microbatches,
                 trace_lib.bench_trace(json.loads(TINY_BENCH.read_text()), "depth1",
                                       "b")[0].steps[1].microbatches)
  assert [m.compute_s for m in busy] == pytest.approx([2 * m.compute_s for m in quiet])


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
  assert captured.err == (f"tunix-stage simulate: error: {path} is invalid: not UTF-8 text (byte "
                          f"0xe9 at offset 26); accepted: {trace_lib.ACCEPTED_INPUT}\n")


def test_check_of_a_missing_file_is_one_line(tmp_path, capsys):
  path = tmp_path / "nope.json"
  assert cli_main.main(["simulate", "--check", str(path)]) == 2
  err = capsys.readouterr().err
  assert err == (f"tunix-stage simulate: error: {path} is invalid: no such file; accepted: "
                 f"{trace_lib.ACCEPTED_INPUT}\n")


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
  assert captured.err == (f"tunix-stage simulate: error: --step='99' is invalid; accepted: a step "
                          f"from 1 to {steps} (the trace's steps after the fill, step 0)\n")


# --- what a newcomer may give it (issue #35): refused in one line, or recorded where it shaped -


def _simulate(capsys, *argv: str) -> tuple[int, str, str]:
  code = cli_main.main(["simulate", *argv])
  captured = capsys.readouterr()
  return code, captured.out, captured.err


CSV_HEADER = "step,microbatch,wire_s,h2d_s,compute_s,update_s,boundary_s"


@pytest.mark.parametrize("rows, message", [
    ([], "t.csv is invalid: a header and no row; accepted: a row per micro-batch under the header"),
    (["0,0,1,1,1,,", "0,0,1,1,1,,", "1,0,1,1,1,,"],
     "t.csv line 3 is invalid: step 0 micro-batch 0 again (line 2); accepted: one row per "
     "micro-batch"),
    (["0,0,1,1,1,0.1,", "0,1,1,1,1,0.2,", "1,0,1,1,1,,"],
     "t.csv line 3 update_s='0.2' is invalid: step 0 has 0.1 on line 2; accepted: one value per "
     "step"),
    (["0,0,1,1,1,,", "0,2,1,1,1,,", "1,0,1,1,1,,"],
     "t.csv step 0 is invalid: no micro-batch 1; accepted: micro-batches numbered 0, 1, ..."),
])
def test_a_csv_trace_that_says_two_things_is_refused(tmp_path, capsys, rows, message):
  path = tmp_path / "t.csv"
  path.write_text("\n".join([CSV_HEADER, *rows]) + "\n")
  code, out, err = _simulate(capsys, str(path))
  assert (code, out, err.count("\n")) == (2, "", 1), err
  assert err.startswith(f"tunix-stage simulate: error: {tmp_path}/{message}"), err


@pytest.mark.parametrize("name, content, message", [
    ("t.csv", "step,microbatch,wire_s,h2d_s,compute_s,update\n0,0,1,1,1,1\n",
     "t.csv column 'update' is invalid: a column nothing reads; accepted: the columns "),
    ("t.json", '{"steps": [{"microbatches": [{"wire_s": 1, "h2d_s": 1, "compute_s": 1}], '
     '"boundary": 2}] }', "t.json step 0 key 'boundary' is invalid: a key nothing reads; "
     "accepted: microbatches, update_s, boundary_s"),
])
def test_a_key_or_column_nothing_reads_is_refused_not_ignored(tmp_path, capsys, name, content,
                                                              message):
  path = tmp_path / name
  path.write_text(content)
  code, _, err = _simulate(capsys, str(path))
  assert code == 2 and err.startswith(f"tunix-stage simulate: error: {tmp_path}/{message}"), err


def _resident(bench):
  """The bench's first resident run: what `simulate BENCH.json` reads."""
  return next(r for r in bench["runs"] if r["mode"] == "resident")


@pytest.mark.parametrize("edit, message", [
    (lambda b: _resident(b)["fwd_bwd_s"].append(["x"]), "] is invalid: its steps differ"),
    (lambda b: _resident(b).update(update_s=None), "].update_s='null' is invalid; accepted: a "
     "JSON list"),
    (lambda b: b["calibration"].pop("wire_s"), "calibration.wire_s is invalid: missing"),
    (lambda b: b["runs"].insert(0, 3), "runs[0]='3' is invalid; accepted: a JSON object"),
    (lambda b: _resident(b).update(step_quiet=["yes"]), "].step_quiet='[\"yes\"]' is invalid; "
     "accepted: one true or false per timed step (1)"),
])
def test_a_hand_edited_bench_json_is_one_line_naming_the_place(tmp_path, capsys, edit, message):
  bench = json.loads(TINY_BENCH.read_text())
  edit(bench)
  path = tmp_path / "bench.json"
  path.write_text(json.dumps(bench))
  code, _, err = _simulate(capsys, str(path))
  assert code == 2 and err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize("edit, message", [
    (lambda b: b["modes"]["inline"].update(median_step_s=0), "modes.inline.median_step_s='0' is "
     "invalid; accepted: a number of seconds > 0"),
    (lambda b: b["options"].update(max_device_batches=0), "options.max_device_batches='0' is "
     "invalid; accepted: an integer >= 1 and <= 1024"),
])
def test_check_of_a_hand_edited_bench_json_is_one_line_naming_the_place(tmp_path, capsys, edit,
                                                                         message):
  bench = json.loads(TINY_BENCH.read_text())
  edit(bench)
  path = tmp_path / "bench.json"
  path.write_text(json.dumps(bench))
  code, _, err = _simulate(capsys, "--check", str(path))
  assert code == 2 and err.count("\n") == 1 and message in err, err


def test_a_bench_trace_with_an_event_edited_is_one_line(tmp_path, capsys):
  spans = [Span("device/compute", f"s{s}-m0", s, s + 0.5, (("kind", "fwd_bwd"), ("step", s)))
           for s in range(2)]
  data = to_chrome_trace({"inline (round 1)": spans})
  del next(e for e in data["traceEvents"] if e["ph"] == "X")["dur"]
  path = tmp_path / "trace.json"
  path.write_text(json.dumps(data))
  code, _, err = _simulate(capsys, str(path))
  assert code == 2 and err.count("\n") == 1 and "].dur is invalid: missing" in err, err


def test_what_if_is_recorded_in_the_table_the_json_and_the_picture(tmp_path, capsys):
  out, png = tmp_path / "new" / "sim.json", tmp_path / "pictures" / "step.png"
  code, table, err = _simulate(capsys, str(EXAMPLE), "--what_if", "wire=0.5x", "--what_if",
                               "h2d=2x", "--modes", "inline,depth2", "--json", str(out), "--png",
                               str(png))
  assert code == 0, err
  assert "; what if wire x0.5, h2d x2; " in table.splitlines()[0]
  assert json.loads(out.read_text())["what_if"] == {"wire": 0.5, "h2d": 2.0}
  assert b"what if wire x0.5, h2d x2" in png.read_bytes()  # the picture's title (PNG text chunk)
  code, table, _ = _simulate(capsys, str(EXAMPLE), "--modes", "inline", "--json", "-")
  assert code == 0 and json.loads(table)["what_if"] == {}


@pytest.mark.parametrize("argv, message", [
    (["--what_if", "wire=0.5x", "--what_if", "wire=2x"],
     "--what_if='wire=2x' is invalid: wire is scaled already (--what_if wire=0.5x); accepted: one "
     "--what_if per resource"),
    (["--step", "2"], "--step='2' is invalid: it picks the step --png draws, and no --png is "
     "given; accepted: --step with --png"),
])
def test_an_input_that_would_change_nothing_is_refused(capsys, argv, message):
  code, out, err = _simulate(capsys, str(EXAMPLE), *argv)
  assert (code, out) == (2, "") and err == f"tunix-stage simulate: error: {message}\n"


@pytest.mark.parametrize("argv, message", [
    (["--what_if", "wire=0.5x"], "--what_if='wire=0.5x' is invalid: --check compares each "
     "prediction with the bench's measured run, which nothing scaled; accepted: --what_if "
     "without --check"),
    (["--stage_max_device_batches", "2"], "--stage_max_device_batches='2' is invalid: --check "
     "runs each mode with the bounds the bench ran with (its options); accepted: "
     "--stage_max_device_batches without --check"),
])
def test_check_refuses_what_would_compare_unlike_with_unlike(capsys, argv, message):
  code, out, err = _simulate(capsys, "--check", str(TINY_BENCH), *argv)
  assert (code, out) == (2, "") and err == f"tunix-stage simulate: error: {message}\n"


def test_a_bench_json_simulates_with_its_first_timed_step_as_the_fill(capsys):
  assert json.loads(TINY_BENCH.read_text())["options"]["steps"] == 1  # one timed step
  code, table, err = _simulate(capsys, str(TINY_BENCH), "--json", "-")
  assert code == 0, err
  assert json.loads(table)["steps"] == 2


def test_a_job_s_metrics_record_is_an_input(tmp_path):
  """A record the telemetry core wrote (tests/cli/test_report.py's job: 2 micro-batches a step,
  each 1.0 s of compute, received in 0.4 s and placed in 0.1 s) simulates; its steps are the
  trainer's, as measured."""
  from tests.cli.test_report import write_trainer_job  # pylint: disable=import-outside-toplevel

  write_trainer_job(tmp_path, steps=3)
  trace = trace_lib.load(str(tmp_path))
  assert len(trace.steps) == 3
  mb = trace.steps[1].microbatches
  assert len(mb) == 2 and mb[0].compute_s == pytest.approx(1.0)
  assert mb[0].wire_s == pytest.approx(0.4) and mb[0].h2d_s == pytest.approx(0.1)
  assert trace.steps[1].update_s == pytest.approx(0.2)
  proc = subprocess.run([sys.executable, "-m", "tunix_stage_plugin", "simulate", str(tmp_path)],
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert "depth2_prestage" in proc.stdout


def test_the_trainer_bounds_come_from_their_variables_as_a_job_reads_them(tmp_path, capsys,
                                                                          monkeypatch):
  """TUNIX_STAGE_MAX_DEVICE_BATCHES / _HOST_BATCHES in the environment are the bounds a job runs
  with: simulate reads them (its flags win), refuses a bad one in the settings' one line, and with
  --check (the bench's own bounds) says it does not read them."""
  out = tmp_path / "sim.json"
  monkeypatch.setenv("TUNIX_STAGE_MAX_DEVICE_BATCHES", "3")
  assert cli_main.main(["simulate", str(EXAMPLE), "--json", str(out)]) == 0
  assert json.loads(out.read_text())["max_device_batches"] == 3
  assert cli_main.main(["simulate", str(EXAMPLE), "--json", str(out),
                        "--stage_max_device_batches", "2"]) == 0
  assert json.loads(out.read_text())["max_device_batches"] == 2
  monkeypatch.setenv("TUNIX_STAGE_MAX_HOST_BATCHES", "abc")
  capsys.readouterr()
  assert cli_main.main(["simulate", str(EXAMPLE)]) == 2
  err = capsys.readouterr().err
  assert "TUNIX_STAGE_MAX_HOST_BATCHES='abc' is invalid" in err, err
  monkeypatch.delenv("TUNIX_STAGE_MAX_HOST_BATCHES")
  assert cli_main.main(["simulate", "--check", str(TINY_BENCH)]) == 0
  assert ("note: TUNIX_STAGE_MAX_DEVICE_BATCHES=3 is not read with --check"
          in capsys.readouterr().err)


def test_a_host_bound_at_auto_is_replayed_at_its_default_and_said(tmp_path, capsys, monkeypatch):
  """The trainer sizes a host bound at auto each step; the simulator replays it at its start (the
  default), said once in one line."""
  out = tmp_path / "sim.json"
  monkeypatch.setenv("TUNIX_STAGE_MAX_HOST_BATCHES", "auto")
  capsys.readouterr()
  assert cli_main.main(["simulate", str(EXAMPLE), "--json", str(out)]) == 0
  assert json.loads(out.read_text())["max_host_batches"] == 1
  assert capsys.readouterr().err.count(
      "tunix-stage simulate: note: TUNIX_STAGE_MAX_HOST_BATCHES=auto is replayed at 1 (the "
      "simulator does not size the trainer's host bound)") == 1
