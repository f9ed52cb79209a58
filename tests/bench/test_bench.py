"""`tunix-stage bench`: its arithmetic on made-up spans, its checks, and a tiny real run."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import random
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tunix_stage_plugin
from tests import procs
from tests.bench import split_oracle
from tests.core.trace_check import partial_overlaps
from tunix_stage_plugin.core.telemetry import record as record_lib
from tunix_stage_plugin.core.inputs import echo
from tunix_stage_plugin.lab.bench import meta as meta_lib
from tunix_stage_plugin.lab.bench import metrics
from tunix_stage_plugin.lab.bench import modes as modes_lib
from tunix_stage_plugin.lab.bench import report
from tunix_stage_plugin.lab.bench import results
from tunix_stage_plugin.lab.bench import runner
from tunix_stage_plugin.lab.bench import command as bench_cmd
from tunix_stage_plugin.cli import main as cli_main
from tunix_stage_plugin.core import codec as codec_lib
from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.core import tracks
from tunix_stage_plugin.core.telemetry.figures import size as figures_size
from tunix_stage_plugin.core.telemetry.recorder import Span
from tunix_stage_plugin.lab.bench.trace import lane_track
from tunix_stage_plugin.lab.embedded import bench as embedded_bench
from tunix_stage_plugin.lab.embedded import data as data_lib


def _compute(step, start, end, kind="fwd_bwd"):
  return Span(tracks.DEVICE_COMPUTE, f"{kind} s{step}", start, end, (("kind", kind), ("step", step)))


def test_step_timings_split_a_step_into_boundary_idle_mid_step_idle_and_compute():
  spans = [
      _compute(0, 0.0, 1.0), _compute(0, 1.0, 1.5, "update"),
      # step 1: 0.5 s boundary, fwd 2.0-3.0, a 0.25 s gap, fwd 3.25-4.0, update 4.0-4.5
      _compute(1, 2.0, 3.0), _compute(1, 3.25, 4.0), _compute(1, 4.0, 4.5, "update"),
      Span(tracks.DEVICE_SYNC, "weight sync", 1.5, 1.8),  # not compute: part of the boundary
  ]
  (t,) = metrics.step_timings(spans, [1])
  assert (t.step, t.seconds, t.boundary_idle, t.mid_step_idle, t.compute) == (
      1, 3.0, 0.5, 0.25, 2.25)
  assert t.seconds == pytest.approx(t.boundary_idle + t.mid_step_idle + t.compute)
  with pytest.raises(ValueError, match="no device compute spans for step 0"):
    metrics.step_timings(spans, [0])


def test_the_bench_s_split_is_the_oracle_s_on_random_steps():
  """The trainer's split (what metrics.step_timings reads) against the oracle, on steps of
  random computations, gaps and weight syncs at the boundary (the sync, a compute-lane call,
  adds to the oracle's boundary idle and is the split's boundary wait plus other calls)."""
  rng = random.Random(7)
  for _ in range(50):
    spans, t = [], 0.0
    steps = rng.randint(2, 6)
    for step in range(steps):
      for _ in range(rng.randint(1, 5)):
        t += rng.choice([0.0, rng.uniform(0.0, 0.3)])
        spans.append(_compute(step, t, t + rng.uniform(0.01, 1.0)))
        t = spans[-1].end
      spans.append(_compute(step, t, t + rng.uniform(0.01, 0.2), "update"))
      t = spans[-1].end
      if rng.random() < 0.5:  # it holds the compute lane: the next step starts after it
        spans.append(Span(tracks.DEVICE_SYNC, "weight sync", t, t + rng.uniform(0.0, 0.5)))
        t = spans[-1].end
      t += rng.uniform(0.0, 0.5)
    rng.shuffle(spans)
    timings = metrics.step_timings(spans, range(1, steps))
    assert [(x.step, x.seconds, x.mid_step_idle, x.boundary_idle, x.compute) for x in timings] \
        == [pytest.approx(o, abs=1e-9) for o in split_oracle.step_timings(spans, range(1, steps))]


@pytest.mark.parametrize("inline, mode, resident, expected", [
    (10.0, 10.0, 4.0, 0.0), (10.0, 4.0, 4.0, 1.0), (10.0, 5.5, 4.0, 0.75),
    (10.0, 5.0, 10.0, None), (None, 5.0, 4.0, None)])
def test_hidden_fraction(inline, mode, resident, expected):
  assert metrics.hidden_fraction(inline, mode, resident) == expected


def test_the_step_limit_is_the_device_never_waiting():
  assert metrics.step_limit(9, 0.5, 0.03, 0.25) == pytest.approx(4.78)


MIB = 1 << 20


def _run(mode, seconds, *, digest="d" * 64, order=None, peak=1, foreign=0.0, round_=0,
         stage_call_s=(), grown_mib=None, job_side=((0.105, 0.19, 0.0),)):
  """A mode run of one timed step (0.1 s mid-step and 0.2 s boundary idle on the bench's clock);
  `job_side`: the trainer's own record of it (mid-step, boundary, other calls), None: none."""
  timings = [metrics.StepTiming(1, seconds, 0.1, 0.2, seconds - 0.3)]
  if grown_mib is None:  # what each mode may hold, in 1 MiB payloads (docs/bench.md, the checks)
    grown_mib = {"inline": 2, "resident": 3}.get(mode, 4)
  return results.ModeRun(
      mode=mode, round=round_, timings=timings, fwd_bwd_s=[[1.7]], update_s=[0.1],
      stage_call_s=list(stage_call_s), fallbacks=0, fallback_reasons=[],
      peak_device_batches=peak, max_device_batches=2, peak_host_batches=1,
      trained_order=order or data_lib.expected_order(2, 2), param_digest=digest,
      step_foreign_cores=[foreign], spans=[], origin=0.0,
      trainer_rss={"baseline": 900 * MIB, "peak": (900 + grown_mib) * MIB},
      orchestrator_rss={"baseline": 100 * MIB, "peak": 120 * MIB},
      job_side=None if job_side is None else [
          _record(mid, boundary, other, seconds - 0.3) for mid, boundary, other in job_side])


def _record(mid, boundary, other, compute):
  """A trainer's record of the timed step (as its telemetry writes one, core.telemetry.record):
  its input wait, other calls and compute."""
  figures = {"step": 1, "host_step": None, "step_s": compute + mid + boundary + other,
             "compute_s": compute, "input_wait_s": {"mid_step": mid, "boundary": boundary},
             "other_s": other, "microbatches": 2,
             "compute": {"fwd_bwd_median_s": 1.7, "update_s": 0.1, "alone_s": 1.7,
                         "beside_transfer": 2, "slowdown_s": None},
             "receive": {"calls": 0, "bytes": 0, "seconds": 0.0, "by_transport": {}},
             "place": {"count": 2, "seconds": 0.1, "bytes": 2 * MIB, "staged": 2, "inline": 0},
             "pool": {"waits": 0, "wait_s": 0.0, "over_bound": 0},
             "staged": {"peak_device": 1, "peak_host": 1}, "bound_by": "wire"}
  return record_lib.make(record_lib.TRAINER, "embedded", figures, {}, record_lib.new_run())


def _result(**overrides):
  options = results.BenchOptions(rounds=1, steps=1, microbatches=2)
  runs = {"inline": _run("inline", 10.0), "depth1": _run("depth1", 7.0),
          "depth2": _run("depth2", 7.0), "depth2_prestage": _run("depth2_prestage", 4.1),
          "resident": _run("resident", 4.0)}
  runs.update(overrides)
  calibration = results.Calibration(1.0, 0.1, 1 << 20, 1e6, 2e6, 0.5, 0.0, 0.0)
  return results.BenchResult(options, calibration, list(runs.values()))


def _failing(result):
  summary = report.summarize(result)
  return [c.name for c in report.criteria(result, summary) if c.passed is False]


def test_criteria_pass_on_a_good_result_and_the_table_shows_every_mode():
  result = _result()
  summary = report.summarize(result)
  checks = report.criteria(result, summary)
  assert [c.passed for c in checks] == [True] * 9
  pre = summary["depth2_prestage"]
  assert pre.hidden_fraction == pytest.approx(5.9 / 6)
  # limit = 2 x 1.7 fwd_bwd + 0.1 update + 0.5 weight sync = 4.0 s
  assert pre.limit_s == pytest.approx(4.0) and pre.step_over_limit == pytest.approx(4.1 / 4.0)
  table = report.format_table(result, summary)
  for mode in modes_lib.DEFAULT_MODES:
    assert mode in table
  assert "limit" in table.splitlines()[0] and "1.025" in table
  text = report.format_report(result, summary, checks)
  assert text.count("PASS") == 9 and "FAIL" not in text
  inline = table.splitlines()[2].split()
  assert inline[-2:] == ["0.88", "0.12"]  # trainer and orchestrator peaks, GiB
  assert "stage calls:" not in text  # no stage call was recorded
  # Where each mode's step went, by the trainer's own records.
  assert ("where the trainer's step went, by its own records (medians per step): inline compute "
          "9.700 s, input wait 0.105 mid-step + 0.190 at the boundary, slowdown beside "
          "transfers n/a (no fwd_bwd ran alone), bound by wire") in text


def test_the_job_side_figures_must_agree_with_the_bench_s():
  """Within 10 % or 20 ms per step: a record 50 ms off the bench's boundary idle fails, one 15 ms
  off passes; the weight sync (other calls) the record keeps apart counts in the boundary."""
  off = _result(depth2=_run("depth2", 7.0, job_side=((0.1, 0.25, 0.0),)))
  (check,) = [c for c in report.criteria(off, report.summarize(off)) if "job-side" in c.name]
  assert check.passed is False and check.value == 1
  assert "depth2 s1: mid 0.100 vs 0.100 s, boundary 0.250 vs 0.200 s" in check.detail
  near = _result(depth2=_run("depth2", 7.0, job_side=((0.1, 0.085, 0.1),)))
  (check,) = [c for c in report.criteria(near, report.summarize(near)) if "job-side" in c.name]
  assert check.passed is True and check.detail.startswith("5 of 5 steps agree")
  none = _result(inline=_run("inline", 10.0, job_side=None))
  (check,) = [c for c in report.criteria(none, report.summarize(none)) if "job-side" in c.name]
  assert check.passed is True and "no record where the trainer has no plugin: inline" in check.detail


def test_where_the_trainer_s_step_went_is_taken_over_the_table_s_steps():
  """The job-side split (the reading layer's medians of the trainer's own records) takes the
  steps the table takes: a mode's quiet steps where there are any, never a noisy re-run's."""
  quiet = _run("depth2", 7.0, job_side=((0.1, 0.2, 0.0),))
  noisy = _run("depth2", 9.0, foreign=1.0, round_=1, job_side=((0.9, 0.2, 0.0),))
  result = _result()
  result.runs = [r for r in result.runs if r.mode != "depth2"] + [quiet, noisy]
  summary = report.summarize(result)
  assert summary["depth2"].median_step_s == 7.0  # the table: the quiet step only
  split = report.job_side_split(result)["depth2"]
  assert split["steps"] == 1 and split["mid_step_s"] == pytest.approx(0.1)
  # Every step noisy: the table and the split both take them all.
  result.runs = [r for r in result.runs if r is not quiet]
  assert report.job_side_split(result)["depth2"]["mid_step_s"] == pytest.approx(0.9)


def test_the_report_states_the_stage_calls_against_compute():
  result = _result(depth2_prestage=_run("depth2_prestage", 4.1, stage_call_s=[0.8, 0.8]))
  summary = report.summarize(result)
  text = report.format_report(result, summary, report.criteria(result, summary))
  assert "stage calls: 0.800 s each (median, measured; the wire alone is 1.049 s emulated)" in \
      text
  assert "peak received host buffers 1 of 1" in text


def test_the_report_takes_the_pool_wait_out_of_the_stage_calls_verdict():
  """tunix's host: a stage call's bytes may wait for the trainer's bounded receive pool; the
  report says how long, and judges the rest against compute (1.2 s call, 0.9 s of it waiting)."""
  run = dataclasses.replace(_run("depth2_prestage", 4.1, stage_call_s=[1.2, 1.2]),
                            stage_wait_s=[0.9, 0.9])
  result = _result(depth2_prestage=run)
  summary = report.summarize(result)
  assert summary["depth2_prestage"].stage_wait_s == pytest.approx(0.9)
  assert summary["depth2_prestage"].to_json()["median_stage_wait_s"] == pytest.approx(0.9)
  text = report.format_report(result, summary, report.criteria(result, summary))
  assert ("0.900 s of it its bytes waited for the trainer's receive pool, whose bound counts the "
          "micro-batches still computing") in text
  assert "so the step can reach its limit" in text and "bound by the wire" not in text
  unwaited = _result(depth2_prestage=_run("depth2_prestage", 4.1, stage_call_s=[1.2, 1.2]))
  summary = report.summarize(unwaited)
  assert summary["depth2_prestage"].stage_wait_s is None
  text = report.format_report(unwaited, summary, report.criteria(unwaited, summary))
  assert "bound by the wire" in text and "receive pool" not in text


@pytest.mark.parametrize("override, failing", [
    ({"resident": _run("resident", 3.9)}, "depth2_prestage hidden"),  # 0.967 < 0.97
    ({"depth2_prestage": _run("depth2_prestage", 4.15)}, "depth2_prestage step"),  # 1.04 x
    ({"depth2": _run("depth2", 8.0)}, "inline / depth2"),
    ({"depth1": _run("depth1", 7.0, digest="e" * 64)}, "same param_digest"),
    ({"depth2": _run("depth2", 7.0, order=["s0-m1", "s0-m0", "s1-m0", "s1-m1"])},
     "expected trained_order"),
    ({"depth2": _run("depth2", 7.0, peak=3)}, "peak staged"),
    # payload 1 MiB: inline may grow 2 x 1 MiB + the 64 MiB runtime allowance; a staged mode
    # (inline's 2 MiB + 2 bounds x 1 MiB) x 1.1 + 64 MiB = 68.4 MiB
    ({"inline": _run("inline", 10.0, grown_mib=67)}, "trainer memory: inline"),
    ({"depth1": _run("depth1", 7.0, grown_mib=69)}, "trainer memory: staged"),
])
def test_each_criterion_fails_on_its_own(override, failing):
  failed = _failing(_result(**override))
  assert len(failed) == 1 and failed[0].startswith(failing), failed


def test_noisy_steps_are_left_out_of_the_medians():
  result = _result()
  result.runs.append(_run("resident", 9.0, foreign=0.9))  # a retry under outside load
  summary = report.summarize(result)["resident"]
  assert summary.step_s == [4.0, 9.0] and summary.step_quiet == [True, False]
  assert summary.median_step_s == 4.0 and not summary.noisy
  only_noisy = _result(resident=_run("resident", 9.0, foreign=0.9))
  assert report.summarize(only_noisy)["resident"].noisy


def test_an_inline_step_no_slower_than_resident_has_nothing_to_hide():
  result = _result(inline=_run("inline", 3.0))
  check = report.criteria(result, report.summarize(result))[0]
  assert (check.passed, check.verdict) == (None, "SKIP")
  assert check.detail == "inline was not slower than resident: nothing to hide"


def test_criteria_skip_what_the_chosen_modes_cannot_measure():
  result = _result()
  result.options = dataclasses.replace(result.options, modes=("inline", "depth2"))
  result.runs = [r for r in result.runs if r.mode in ("inline", "depth2")]
  summary = report.summarize(result)
  verdicts = {c.name: c.passed for c in report.criteria(result, summary)}
  assert verdicts["depth2_prestage hidden fraction >= 0.97"] is None
  assert verdicts["depth2_prestage step <= 1.03 x limit"] is None
  assert verdicts["inline / depth2 median step ratio >= 1.3"] is True


def _bench_parser():
  return cli_main.subcommands()["bench"]


def test_help_explains_every_option():
  for action in _bench_parser()._actions:
    assert action.help and len(action.help) > 10, action.dest


def test_every_bad_option_is_reported_at_once_before_anything_starts(tmp_path, capsys):
  a_file = tmp_path / "file"
  a_file.write_text("x")
  out = tmp_path / "out"
  code = cli_main.main([
      "bench", "--modes", "inline,fast", "--rounds", "0", "--steps", "99999999999999999999999",
      "--retries", "-1", "--microbatches", "٣", "--payload_mib", "1e-30", "--wire_ratio", "-1",
      "--h2d_ratio", "nan", "--sync_ratio", "-0.5", "--stage_max_device_batches", "1_0",
      "--seed", "-1", "--json", str(tmp_path), "--png", "/proc/no/such.png",
      "--trace", str(a_file / "trace.json"), "--out", str(out)])
  assert code == 2
  err = capsys.readouterr().err.splitlines()
  expected = [
      "--rounds='0' is invalid; accepted: an integer >= 1 and <= 1000000",
      "--steps='99999999999999999999999' is invalid; accepted: an integer >= 1 and <= 1000000",
      "--retries='-1' is invalid; accepted: an integer >= 0 and <= 1000000",
      "--modes='inline,fast' is invalid; accepted: a comma-separated subset of",
      "--microbatches='٣' is invalid; accepted: an integer >= 1 and <= 1000000",
      "--payload_mib='1e-30' is invalid; accepted: a size in MiB from 1/1024 (1 KiB)",
      "--wire_ratio='-1' is invalid; accepted: a number > 0",
      "--h2d_ratio='nan' is invalid; accepted: a number > 0",
      "--sync_ratio='-0.5' is invalid; accepted: a number >= 0",
      # the settings table's range and words, as `tunix-stage config` says them
      "--stage_max_device_batches='1_0' is invalid; accepted: an integer >= 1 and <= 1024",
      "--seed='-1' is invalid; accepted: an integer >= 0 and <= 4294967295",
      # (paths too are cut to inputs.MAX_ECHO characters; the reason names the folder at fault)
      f"--json={echo(str(tmp_path))} is invalid: a directory; accepted: a file path",
      "--png='/proc/no/such.png' is invalid: cannot create anything in /proc",
      f"--trace={echo(str(a_file / 'trace.json'))} is invalid: {a_file} is not a directory",
  ]
  assert len(err) == len(expected), err
  for line, want in zip(err, expected):
    assert line.startswith(f"tunix-stage bench: error: {want}"), (line, want)
  assert not out.exists()  # --out is not needed (every file was named) and nothing was made


@pytest.mark.parametrize("args, message", [
    (["--out", "/proc/x"], "--out='/proc/x' is invalid: cannot create anything in /proc"),
    (["--seed", str(2**32)], "accepted: an integer >= 0 and <= 4294967295"),
    (["--stage_max_host_batches", "1025"],
     "--stage_max_host_batches='1025' is invalid; accepted: auto, or an integer >= 1 and <= 1024"),
    (["--png", "{tmp}/timeline.svg"], "is invalid: not a .png name; accepted: a file path "
     "ending in .png"),
    (["--payload_mib", "65536"], "held at once (4 built once on the orchestrator (one per "
     "position of a step), up to 4 on the trainer) need 512.0 GiB, more than the"),
    (["--host", "tunix", "--wire_ratio", "0.8", "--scenario", "steady"],
     "--host='tunix' is invalid: --wire_ratio, --scenario set the embedded host's emulated "
     "links; accepted: with --host tunix, none of them (tunix's links are its own)"),
    (["--host", "maxtext"], "--host='maxtext' is invalid; accepted: embedded | tunix"),
    (["--png", "", "--trace", "", "--json", "{tmp}/a/b/../b.json", "--modes", "inline,inline"],
     "--modes='inline,inline' is invalid; accepted: a comma-separated subset of inline,depth1,depth2,"
     "depth2_prestage,resident,depth2_prestage_codec,auto, each at most once"),
])
def test_a_bad_option_exits_2_with_one_line(args, message, tmp_path, capsys):
  args = [a.replace("{tmp}", str(tmp_path)) for a in args]
  assert cli_main.main(["bench", "--out", str(tmp_path / "out"), *args]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and message in err, err
  assert list(tmp_path.iterdir()) == []


def test_host_tunix_without_tunix_says_what_to_install_in_one_line(tmp_path, capsys,
                                                                      monkeypatch):
  """Where tunix's experimental stack is not importable (this venv: tunix is not installed, or
  the import is blocked for the test where it is), one line names it and the docs page."""
  monkeypatch.setitem(sys.modules, bench_cmd.TUNIX_PROGRAM, None)  # import raises ImportError
  assert cli_main.main(["bench", "--host", "tunix", "--out", str(tmp_path / "out")]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1, err
  assert err.startswith("tunix-stage bench: error: --host='tunix' is invalid: tunix's "
                        "experimental stack is not importable here (")
  assert 'docs/tunix.md "Tests against real tunix"' in err
  assert list(tmp_path.iterdir()) == []


def test_tiny_marks_the_timing_checks_not_applicable():
  result = _result(depth2=_run("depth2", 11.0))  # a negative hidden fraction
  result.options = dataclasses.replace(result.options, tiny=True)
  summary = report.summarize(result)
  checks = report.criteria(result, summary)
  assert [c.verdict for c in checks] == ["n/a (tiny)"] * 3 + ["PASS"] * 6
  assert [c.passed for c in checks if c.kind == report.TIMING] == [None] * 3
  assert checks[2].detail == f"{10 / 11:.3f}"  # the figure is still shown
  table = report.format_table(result, summary)
  assert "-0.17 (n/a)" in table and "1.00 (n/a)" in table
  text = report.format_report(result, summary, checks)
  assert "FAIL" not in text and "n/a (tiny): --tiny's model is too small" in text
  as_json = report.to_json(result, summary, checks, {})
  assert [c["verdict"] for c in as_json["criteria"]][:3] == ["n/a (tiny)"] * 3


def test_a_partial_result_summarizes_the_runs_that_finished():
  result = results.BenchResult(results.BenchOptions(rounds=2, steps=1, microbatches=2))
  result.interrupted = "SIGTERM"
  as_json = report.to_json(result, report.summarize(result), report.criteria(
      result, report.summarize(result)), {"json": "x"})
  assert as_json["interrupted"] is True and as_json["interrupted_by"] == "SIGTERM"
  assert as_json["calibration"] is None and as_json["runs"] == [] and as_json["modes"] == {}
  assert [c["passed"] for c in as_json["criteria"]] == [None] * 9
  result.calibration = _result().calibration
  result.runs = [_run("inline", 10.0), _run("depth1", 7.0)]
  summary = report.summarize(result)
  assert list(summary) == ["inline", "depth1"]
  assert [c.passed for c in report.criteria(result, summary)] == [None, None, None, True, True,
                                                                  True, True, True, True]


# tiny_run: one real tiny quick run (--microbatches 3), tests/conftest.py.


def test_tiny_quick_run_writes_json_png_and_trace(tiny_run):
  result, out = tiny_run
  assert result.returncode == 0, result.stdout + result.stderr
  for mode in modes_lib.DEFAULT_MODES:  # progress on stderr, the table on stdout
    assert f"round 1/1 {mode}" in result.stderr
    assert mode in result.stdout
  assert "PASS  same param_digest in every mode and round" in result.stdout
  report_json = json.loads((out / "bench.json").read_text())
  expected = data_lib.expected_order(2, 3)  # one warm-up step + one timed step
  assert report_json["expected_trained_order"] == expected
  assert set(report_json["modes"]) == set(modes_lib.DEFAULT_MODES)
  digests = set()
  for mode, m in report_json["modes"].items():
    assert len(m["step_s"]) == 1 and m["median_step_s"] == m["step_s"][0]
    assert set(m["idle_s"]) == {"mid_step", "boundary"}
    assert m["trained_order"] == expected and m["fallbacks"] == 0
    assert m["peak_device_batches"] <= m["max_device_batches"] == 1
    digests.add(m["param_digest"])
  assert len(digests) == 1 and len(digests.pop()) == 64
  # Tiny steps last milliseconds: resident's hidden fraction is 1.0, or None when inline's step
  # happened not to be slower; either way the timing checks are not judged.
  assert report_json["modes"]["resident"]["hidden_fraction"] in (1.0, None)
  assert [c["verdict"] for c in report_json["criteria"] if c["kind"] == "timing"] == [
      "n/a (tiny)"] * 3
  assert "FAIL" not in result.stdout
  assert report_json["trainer_exit_code"] == 0
  assert (out / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  trace = json.loads((out / "trace.json").read_text())
  names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
  assert names == {f"{m} (round 1)" for m in modes_lib.DEFAULT_MODES}
  thread_names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
  assert {tracks.DEVICE_COMPUTE, tracks.TRAINER_H2D, tracks.ORCHESTRATOR_STAGE} <= thread_names
  assert partial_overlaps(trace) == []  # every thread's events nest: Perfetto draws them right
  assert sum(e["ph"] == "X" for e in trace["traceEvents"]) > 0
  assert all(lane_track(n) == n or lane_track(n) in thread_names for n in thread_names)


def test_the_tiny_run_s_step_figures_are_the_oracle_s_over_its_own_spans(tiny_run):
  """Each run's step figures (the trainer's own split, which the bench reads) against the split
  oracle (tests/bench/split_oracle.py) over the same run's device spans, read back from its
  trace (times to 0.1 us)."""
  result, out = tiny_run
  assert result.returncode == 0, result.stdout + result.stderr
  report_json = json.loads((out / "bench.json").read_text())
  events = json.loads((out / "trace.json").read_text())["traceEvents"]
  modes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
  threads = {(e["pid"], e["tid"]): lane_track(e["args"]["name"]) for e in events
             if e["name"] == "thread_name"}
  for run in report_json["runs"]:
    (pid,) = [p for p, name in modes.items() if name == f"{run['mode']} (round 1)"]
    spans = [Span(threads[pid, e["tid"]], e["name"], e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6,
                  tuple(e["args"].items())) for e in events if e["ph"] == "X" and e["pid"] == pid]
    expected = split_oracle.step_timings(spans, range(1, 1 + len(run["step_s"])))
    assert expected and [list(t[1:4]) for t in expected] == [
        pytest.approx([s, m, b], abs=1e-6) for s, m, b in zip(
            run["step_s"], run["mid_step_idle_s"], run["boundary_idle_s"])], run["mode"]


def test_the_tiny_run_records_its_context_and_checks_as_numbers(tiny_run):
  result, out = tiny_run
  assert result.returncode == 0, result.stdout + result.stderr
  report_json = json.loads((out / "bench.json").read_text())
  meta = report_json["meta"]
  assert meta["plugin_version"] == tunix_stage_plugin.__version__
  assert meta["git_commit"] is None or len(meta["git_commit"]) == 40
  assert meta["date_utc"].endswith("+00:00") and meta["hostname"]
  assert meta["cpu_count"] == os.cpu_count()
  assert meta["python"] == platform.python_version()
  assert all(isinstance(meta[p], str) for p in ("jax", "jaxlib", "grpcio", "numpy"))
  assert meta["options"]["tiny"] is True and meta["options"]["steps"] == 1
  assert meta["options"]["microbatches"] == 3 and meta["options"]["modes"] == list(modes_lib.DEFAULT_MODES)
  by_name = {c["name"]: c for c in report_json["criteria"]}
  digest = by_name["same param_digest in every mode and round"]
  assert (digest["value"], digest["comparison"], digest["threshold"]) == (1, "<=", 1)
  assert digest["passed"] is True
  ratio = by_name["inline / depth2 median step ratio >= 1.3"]
  assert isinstance(ratio["value"], float) and ratio["threshold"] == 1.3
  assert ratio["passed"] is None  # tiny: not judged, the figure still a number
  modes = report_json["modes"]
  assert ratio["value"] == pytest.approx(modes["inline"]["median_step_s"]
                                         / modes["depth2"]["median_step_s"])
  # The trainer's own per-step records (what a job writes) agree with the bench's idle, in
  # every mode: the embedded trainer stages in each, so each run has them.
  (job_side,) = [c for c in report_json["criteria"] if c["name"].startswith("job-side")]
  assert job_side["passed"] is True and job_side["value"] == 0, job_side
  for run in report_json["runs"]:
    (step,) = run["job_side"]
    assert step["agrees"] and step["bench_mid_s"] == run["mid_step_idle_s"][0], run


def test_the_tiny_run_says_run_k_of_n_and_the_time_left(tiny_run):
  result, _ = tiny_run
  lines = [l for l in result.stderr.splitlines() if "round 1/1" in l]
  assert len(lines) == len(modes_lib.DEFAULT_MODES), result.stderr
  for k, line in enumerate(lines[:-1], start=1):
    assert f"; run {k} of 5, about " in line and " left (" in line, line
  assert lines[-1].endswith("; run 5 of 5, the last"), lines[-1]


def test_the_time_left_is_the_mean_run_times_the_runs_left():
  assert runner.time_left_line([10.0, 20.0], 6) == (
      "run 2 of 6, about 1 min 00 s left (4 run(s) of 15.0 s on average)")
  assert runner.time_left_line([2.0], 2) == "run 1 of 2, about 2 s left (1 run(s) of 2.0 s on " \
      "average)"
  assert runner.time_left_line([3000.0], 3) == (
      "run 1 of 3, about 1 h 40 min left (2 run(s) of 3000.0 s on average)")
  assert runner.time_left_line([1.0, 1.0], 2) == "run 2 of 2, the last"


def _compare(capsys, *paths):
  code = cli_main.main(["bench", "--compare", *map(str, paths)])
  captured = capsys.readouterr()
  return code, captured.out, captured.err


def test_compare_puts_two_real_runs_side_by_side(tiny_run, tmp_path, capsys):
  result, out = tiny_run
  assert result.returncode == 0, result.stdout + result.stderr
  a = json.loads((out / "bench.json").read_text())
  b = json.loads(json.dumps(a))
  b["meta"]["git_commit"] = "f" * 40
  for figures in b["modes"].values():
    figures["median_step_s"] *= 2
    figures["step_over_limit"] *= 0.5
  b["modes"]["depth2"]["fallbacks"] = 3
  b["modes"]["inline"]["hidden_fraction"] = 0.25
  a["modes"]["inline"]["hidden_fraction"] = 0.0
  del b["modes"]["depth1"]
  b["modes"]["depth3"] = dict(b["modes"]["depth2"])
  (tmp_path / "a.json").write_text(json.dumps(a))
  (tmp_path / "b.json").write_text(json.dumps(b))
  code, text, err = _compare(capsys, tmp_path / "a.json", tmp_path / "b.json")
  assert code == 0 and err == ""
  lines = text.splitlines()
  assert lines[0].startswith(f"A = {tmp_path / 'a.json'} ({a['meta']['date_utc']}, ")
  assert "commit ffffffffff" in lines[1] and "tiny" in lines[1]
  header = lines[3].split()
  assert header[:4] == ["mode", "step", "s", "A"]
  rows = {l.split()[0]: l.split() for l in lines[5:] if not l.startswith("only in")}
  assert list(rows) == ["inline", "depth2", "depth2_prestage", "resident"]
  for mode, row in rows.items():
    assert row[1] == f"{a['modes'][mode]['median_step_s']:.3f}"
    assert row[3] == "2.000x" and row[9] == "0.500x"
  assert rows["inline"][4:7] == ["0.00", "0.25", "+0.25"]
  assert rows["depth2"][10:] == ["0", "3", "+3"] and rows["resident"][12] == "+0"
  assert lines[-2:] == ["only in A: depth1", "only in B: depth3"]


@pytest.mark.parametrize("content, message", [
    (None, "no such file"),
    ("{not json", "not JSON"),
    ('{"runs": []}', 'not a tunix-stage bench JSON (no "modes" object)'),
    ('[1, 2]', 'not a tunix-stage bench JSON (no "modes" object)'),
    ('{"modes": {}}', 'no mode finished in this run ("modes" is empty)'),
    ('{"modes": {"inline": 3}}', "modes.inline is not an object"),
])
def test_compare_refuses_a_file_it_cannot_compare_with_one_line(content, message, tmp_path,
                                                                 capsys, monkeypatch):
  monkeypatch.chdir(tmp_path)
  good = tmp_path / "good.json"
  good.write_text('{"modes": {"inline": {"median_step_s": 1.0}}}')
  bad = tmp_path / "bad.json"
  if content is not None:
    bad.write_text(content)
  for paths in ((good, bad), (bad, good)):
    code, text, err = _compare(capsys, *paths)
    assert code == 2 and text == ""
    assert err.count("\n") == 1, err
    assert err.startswith(f"tunix-stage bench: error: --compare={echo(str(bad))} is invalid: "
                          f"{message}"), err
  assert sorted(os.listdir(tmp_path)) == sorted(["good.json"] + (["bad.json"] if content else []))


def _bench_files(argv):
  args = cli_main.build_parser().parse_args(["bench", *argv])
  options, files, problems = bench_cmd._check(args)  # pylint: disable=protected-access
  assert options is not None, problems
  return args, files


def test_the_default_folder_is_not_overwritten_silently(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  say = bench_cmd._say_overwrite  # pylint: disable=protected-access
  say(*_bench_files([]))
  assert capsys.readouterr().err == ""  # nothing there yet
  os.mkdir("bench-out")
  with open("bench-out/bench.json", "w", encoding="utf-8") as f:
    json.dump({"meta": {"date_utc": "2026-01-02T03:04:05+00:00"}, "modes": {}}, f)
  say(*_bench_files([]))
  assert capsys.readouterr().err == ("tunix-stage bench: overwriting bench-out/ from "
                                     "2026-01-02T03:04:05+00:00; use --out DIR to keep it\n")
  with open("bench-out/bench.json", "w", encoding="utf-8") as f:
    f.write("{}")  # an older JSON without meta: the file's time
  os.utime("bench-out/bench.json", (0, 86400))
  say(*_bench_files(["--quiet"]))
  assert capsys.readouterr().err == ("tunix-stage bench: overwriting bench-out/ from "
                                     "1970-01-02T00:00:00+00:00; use --out DIR to keep it\n")
  say(*_bench_files(["--out", "elsewhere"]))
  say(*_bench_files(["--json", "other.json"]))
  assert capsys.readouterr().err == ""


def test_meta_never_fails(tmp_path, monkeypatch):
  assert meta_lib.git_commit(str(tmp_path)) is None  # not a checkout
  monkeypatch.setenv("PATH", str(tmp_path))  # no git at all
  assert meta_lib.git_commit() is None and meta_lib.git_dirty() is None
  meta = meta_lib.run_meta(results.BenchOptions())
  assert meta["git_commit"] is None and meta["git_dirty"] is None
  assert meta["options"]["modes"] == list(modes_lib.DEFAULT_MODES)
  assert meta_lib.version("no-such-package-here") is None
  assert meta_lib.run_date(str(tmp_path / "missing.json")) == "an unknown date"


def test_criteria_hold_their_figures_as_numbers_and_the_table_is_unchanged():
  result = _result(depth2_prestage=_run("depth2_prestage", 4.15))
  summary = report.summarize(result)
  checks = report.criteria(result, summary)
  as_json = report.to_json(result, summary, checks, {})["criteria"]
  assert [(c["value"], c["comparison"], c["threshold"], c["passed"]) for c in as_json] == [
      (pytest.approx(5.85 / 6), ">=", 0.97, True),
      (pytest.approx(4.15 / 4.0), "<=", 1.03, False),
      (pytest.approx(10 / 7), ">=", 1.3, True),
      (1, "<=", 1, True), (0, "<=", 0, True), (1, "<=", 2, True),
      (0, "<=", 0, True),  # job-side figures: no step off
      # memory: inline 2 MiB above baseline <= 2 x 1 MiB + 64 MiB; staged 4 MiB <= (2 + 2 x 1)
      # x 1.1 + 64 MiB
      (2 * MIB, "<=", 66 * MIB, True),
      (4 * MIB, "<=", pytest.approx(4 * MIB * 1.1 + 64 * MIB), True)]
  assert [c["detail"] for c in as_json][:3] == [f"{5.85 / 6:.3f}", "1.038", f"{10 / 7:.3f}"]
  text = report.format_report(result, summary, checks)
  assert "FAIL  depth2_prestage step <= 1.03 x limit: 1.038" in text


def _read_until(proc: subprocess.Popen, pattern: str, timeout_s: float) -> str:
  """stderr lines up to the first that holds `pattern` (a bounded wait on the pipe)."""
  seen = []
  deadline = time.monotonic() + timeout_s
  with selectors.DefaultSelector() as sel:
    sel.register(proc.stderr, selectors.EVENT_READ)
    while time.monotonic() < deadline:
      if not sel.select(deadline - time.monotonic()):
        continue
      line = proc.stderr.readline()
      if not line:
        break
      seen.append(line)
      if pattern in line:
        return "".join(seen)
  raise AssertionError(f"no line with {pattern!r} within {timeout_s} s: {''.join(seen)}")


@pytest.mark.parametrize("sig, code, whole_group", [
    (signal.SIGTERM, 143, False),  # e.g. `kill PID`: the trainer must not be left without parent
    (signal.SIGINT, 130, True),  # Ctrl-C in a terminal: the trainer gets it as well
])
def test_a_signal_stops_the_bench_cleanly_with_a_partial_json(sig, code, whole_group, tmp_path):
  out = tmp_path / "out"
  cmd = [sys.executable, "-m", "tunix_stage_plugin.cli.main", "bench", "--tiny", "--rounds",
         "100000", "--steps", "1", "--microbatches", "2", "--payload_mib", "0.01", "--out",
         str(out)]
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True)
  try:
    _read_until(proc, "round 1/100000 inline", 120)
    trainers = procs.children(proc.pid, b"tunix_stage_plugin.lab.embedded.trainer_main")
    assert len(trainers) == 1
    if whole_group:
      os.killpg(proc.pid, sig)
    else:
      proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=60)
    deadline = time.monotonic() + 20
    while os.path.exists(f"/proc/{trainers[0]}") and time.monotonic() < deadline:
      time.sleep(0.05)  # polling /proc with a deadline, not synchronising on a sleep
    trainer_left = os.path.exists(f"/proc/{trainers[0]}")
  finally:  # whatever failed, leave nothing of the group behind (the trainer shares it)
    try:
      os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
    proc.wait()
  assert proc.returncode == code, stderr
  lines = stderr.strip().splitlines()
  assert lines[-1].startswith(f"tunix-stage bench: interrupted by {sig.name}; wrote "), stderr
  assert "Traceback" not in stderr and "UNAVAILABLE" not in stderr, stderr
  assert stdout == ""
  report_json = json.loads((out / "bench.json").read_text())
  assert report_json["interrupted"] is True and report_json["interrupted_by"] == sig.name
  assert len(report_json["runs"]) >= 1 and report_json["calibration"] is not None
  assert report_json["runs"][0]["mode"] == "inline"
  assert (out / "trace.json").exists()
  assert not trainer_left, "the trainer outlived the bench"


def test_bursty_slows_each_steps_head_and_random_spikes_alike_in_every_mode():
  slow = embedded_bench.transfer_slowdown("bursty", 0, 9)
  factors = {(s, i): slow(data_lib.Batch(s, i, {})) for s in range(40) for i in range(9)}
  assert all(f >= 1.6 for (s, i), f in factors.items() if i < 3)  # the first third of a step
  assert all(f in (1.0, 2.0) for (s, i), f in factors.items() if i >= 3)
  spikes = sum(f in (2.0, 3.2) for f in factors.values()) / len(factors)
  assert 0.1 < spikes < 0.3  # about a fifth
  again = embedded_bench.transfer_slowdown("bursty", 0, 9)
  assert all(again(data_lib.Batch(s, i, {})) == f for (s, i), f in factors.items())  # seeded
  assert embedded_bench.transfer_slowdown("steady", 0, 9) is None


def test_the_bursty_scenario_judges_depth2_against_depth1():
  result = _result()
  result.options = dataclasses.replace(result.options, scenario="bursty")
  assert _failing(result) == ["bursty: depth2 beats depth1 (depth1 / depth2 median step > 1)"]
  result = _result(depth2=_run("depth2", 6.5))
  result.options = dataclasses.replace(result.options, scenario="bursty")
  assert _failing(result) == []


def test_the_codec_mode_runs_only_when_named_and_compresses_with_on_by_default(monkeypatch):
  assert "depth2_prestage_codec" in modes_lib.MODES
  assert "depth2_prestage_codec" not in results.BenchOptions().modes == modes_lib.DEFAULT_MODES
  monkeypatch.setattr(codec_lib, "installed", lambda name: True)
  options = results.BenchOptions(modes=("depth2_prestage", "depth2_prestage_codec"))
  assert options.codec_for("depth2_prestage") is None
  assert str(options.codec_for("depth2_prestage_codec")) == "blosc2-zstd:1"
  chosen = dataclasses.replace(options, codec="blosc2-lz4:3")  # --stage_codec: every mode
  assert [str(chosen.codec_for(m)) for m in chosen.modes] == ["blosc2-lz4:3", "blosc2-lz4:3"]


def test_the_report_says_what_the_codec_did_to_the_stage_calls(monkeypatch):
  monkeypatch.setattr(codec_lib, "installed", lambda name: True)
  wire = lambda sent: {"stages": 2, "stage_raw_bytes": 8 << 20, "stage_sent_bytes": sent,
                       "inline": 0, "inline_bytes": 0, "encode_s": 0.01}
  plain = dataclasses.replace(_run("depth2_prestage", 4.6, stage_call_s=[1.4, 1.4]),
                              wire=wire(8 << 20))
  packed = dataclasses.replace(_run("depth2_prestage_codec", 4.05, stage_call_s=[0.3, 0.3]),
                               wire=wire(1 << 20))
  result = _result(depth2_prestage=plain, depth2_prestage_codec=packed)
  result.options = dataclasses.replace(
      result.options, modes=modes_lib.DEFAULT_MODES + ("depth2_prestage_codec",))
  summary = report.summarize(result)
  text = report.format_report(result, summary, report.criteria(result, summary))
  assert "the step is bound by the wire" in text  # 1.4 s stage calls against 1.0 s of compute
  assert ("stage calls with the codec (blosc2-zstd:1, depth2_prestage_codec): 0.300 s each "
          "(median), under the 1.000 s of compute; staged payloads 8.00x smaller") in text


def test_the_codec_mode_without_the_codec_is_one_clear_line(monkeypatch, tmp_path, capsys):
  monkeypatch.setattr(codec_lib, "installed", lambda name: False)
  assert cli_main.main(["bench", "--out", str(tmp_path / "out"),
                        "--modes", "inline,depth2_prestage_codec"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1, err
  assert ("--modes='inline,depth2_prestage_codec' is invalid: depth2_prestage_codec compresses "
          "with on (--stage_codec is off), and codec blosc2-zstd needs the Python package blosc2, "
          f"which is not installed ({codec_lib.extra_hint()}); accepted: modes that do not "
          "compress, or the codec's library installed") in err
  assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not codec_lib.installed(codec_lib.DEFAULT_CODEC),
                    reason=f"{codec_lib.DEFAULT_CODEC} is not installed ({codec_lib.EXTRA})")
def test_one_run_compares_staging_with_and_without_the_codec(tmp_path):
  out = tmp_path / "out"
  cmd = [sys.executable, "-m", "tunix_stage_plugin.cli.main", "bench", "--tiny", "--quick",
         "--steps", "1", "--microbatches", "3", "--payload", "rl", "--payload_mib", "0.5",
         "--modes", "inline,depth2_prestage,depth2_prestage_codec", "--png", "", "--trace", "",
         "--out", str(out)]
  result = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
  assert result.returncode == 0, result.stdout + result.stderr
  report_json = json.loads((out / "bench.json").read_text())
  modes, wire = report_json["modes"], report_json["wire"]
  assert len({m["param_digest"] for m in modes.values()}) == 1
  assert [wire[m]["codec"] for m in modes] == ["off", "off", "blosc2-zstd:1"]
  assert wire["depth2_prestage"]["stage_ratio"] == 1.0
  assert wire["depth2_prestage_codec"]["stage_ratio"] > 2
  assert all(m["fallbacks"] == 0 for m in modes.values())
  assert "stage calls with the codec (blosc2-zstd:1, depth2_prestage_codec)" in result.stdout


def test_the_inline_memory_bound_counts_the_compute_working_set_measured_at_calibration():
  result = _result(inline=_run("inline", 10.0, grown_mib=120))
  assert "trainer memory: inline" in _failing(result)[0]
  result.calibration = dataclasses.replace(result.calibration, compute_memory_bytes=100 * MIB)
  assert not _failing(result)  # 120 MiB <= 2 x 1 MiB + 100 MiB + 64 MiB


def test_real_host_to_device_copies_run_on_cpu_devices_and_are_recorded(tmp_path):
  """--h2d real on this CPU machine: the trainer's own device_put onto its CPU devices, measured,
  with nothing emulated; the JSON names the devices and keeps each mode's measured copy time."""
  out = tmp_path / "real"
  cmd = [sys.executable, "-m", "tunix_stage_plugin.cli.main", "bench", "--tiny", "--quick",
         "--h2d", "real", "--steps", "1", "--microbatches", "2", "--payload_mib", "2",
         "--modes", "inline,depth2_prestage,resident", "--out", str(out), "--png", "",
         "--trace", ""]
  result = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
  assert result.returncode == 0, result.stdout + result.stderr
  report_json = json.loads((out / "bench.json").read_text())
  calibration = report_json["calibration"]
  assert calibration["h2d"] == "real" and calibration["h2d_bytes_per_s"] is None
  assert calibration["platform"] == "cpu" and calibration["devices"]
  assert calibration["h2d_s"] == report_json["modes"]["inline"]["median_h2d_s"]
  for mode in ("inline", "depth2_prestage"):
    m = report_json["modes"][mode]
    assert m["median_h2d_s"] is not None and 0 < m["median_h2d_s"] < 1.0  # no emulated sleep
    assert m["device_memory"] is None  # the CPU backend keeps no allocator figures
  assert 0.0 <= report_json["modes"]["depth2_prestage"]["placement_overlapped_compute"] <= 1.0
  assert "H2D real on cpu (" in result.stdout
  assert "device memory: n/a (the cpu backend keeps no allocator figures)" in result.stdout
  assert "PASS  same param_digest in every mode and round" in result.stdout


def test_the_device_check_refuses_a_python_without_an_accelerator(tmp_path):
  script = Path(__file__).resolve().parents[2] / "tools" / "device_check.sh"
  result = subprocess.run(["bash", str(script), str(tmp_path / "out")], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHON": sys.executable})
  assert result.returncode == 2
  assert result.stderr.strip().splitlines() == [
      f"device_check: error: {sys.executable}'s JAX sees no accelerator (jax.default_backend() is "
      "cpu); accepted: a machine with a GPU or TPU and a JAX built for it"]


def test_the_report_says_when_the_links_were_sized_for_another_compute():
  result = _result()  # calibrated 1.0 s per micro-batch; every mode measured fwd_bwd 1.7 s
  summary = report.summarize(result)
  text = report.format_report(result, summary, report.criteria(result, summary))
  assert ("WARNING: the links were sized for another compute: calibrated 1.000 s per "
          "micro-batch, the modes measured 1.700 s (1.70 x, margin 25%)") in text
  drift = report.to_json(result, summary, [], {})["compute_vs_calibration"]
  assert drift["sized_for_another_compute"] and drift["ratio"] == pytest.approx(1.7)
  result.calibration = dataclasses.replace(result.calibration, compute_s=1.6)  # within 25%
  text = report.format_report(result, summary, report.criteria(result, summary))
  assert "sized for another compute" not in text
  assert not report.compute_drift(result, summary)["sized_for_another_compute"]


def test_a_bench_beside_a_busy_core_calibrates_again_and_says_it_stayed_noisy(tmp_path):
  """A process spinning on one core for the whole run: every calibration sees it, so the bench
  tries CALIBRATION_TRIES times, keeps the quietest, and says (progress, report, JSON) that it
  stayed noisy. Real trainer process, real /proc load accounting."""
  busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
  try:
    out = tmp_path / "busy"
    # The default model (not --tiny): its calibration steps last long enough (> 0.5 s, one
    # micro-batch each beside the busy core) for /proc's load accounting to judge them. One mode
    # run after it, with no weight sync to emulate: what is checked is the calibration.
    cmd = [sys.executable, "-m", "tunix_stage_plugin.cli.main", "bench", "--quick",
           "--steps", "1", "--microbatches", "1", "--payload_mib", "1", "--retries", "0",
           "--modes", "resident", "--sync_ratio", "0", "--out", str(out), "--png", "",
           "--trace", ""]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
  finally:
    busy.kill()
    busy.wait(30)
  assert result.returncode == 0, result.stdout + result.stderr
  calibration = json.loads((out / "bench.json").read_text())["calibration"]
  assert calibration["tries"] == runner.CALIBRATION_TRIES and calibration["noisy"] is True
  assert calibration["foreign_cores"] > 0.2
  progress = result.stdout + result.stderr
  assert progress.count("calibrating again: other processes used") == runner.CALIBRATION_TRIES - 1
  assert "calibration stayed noisy: other processes used" in progress
  assert "note: calibration stayed noisy" in result.stdout


def test_the_report_says_when_inline_is_within_noise_of_resident():
  """A host path that hardly shows in the step (inline 2 % above resident): the hidden fractions
  divide noise by noise, and the report says so; a real gap gets no such note."""
  near = _result(inline=_run("inline", 4.08), depth2_prestage=_run("depth2_prestage", 4.05))
  summary = report.summarize(near)
  text = report.format_report(near, summary, report.criteria(near, summary))
  assert "note: inline's step is within 2.0% of resident's" in text
  far = _result()  # inline 10 s, resident 4 s
  summary = report.summarize(far)
  assert "is within" not in report.format_report(far, summary, report.criteria(far, summary))


def test_a_tunix_run_is_judged_by_the_tunix_checks_and_reports_real_links():
  """--host tunix: links are real (no wire time), no weight sync; the one timing check is the
  step's distance from its limit (1.15), and tunix's inline memory allows 6 payloads."""
  result = _result()
  result.options = dataclasses.replace(result.options, host="tunix")
  result.calibration = dataclasses.replace(result.calibration, wire_bytes_per_s=None, sync_s=0.0)
  summary = report.summarize(result)
  checks = report.criteria(result, summary)
  timing = [c.name for c in checks if c.kind == report.TIMING]
  assert timing == ["depth2_prestage step <= 1.15 x limit"]
  assert any(c.name.startswith("trainer memory: inline peak <= baseline + compute + 6 x")
             for c in checks)
  text = report.format_report(result, summary, checks)
  assert "tunix's own links on 127.0.0.1 (nothing emulated)" in text and "no weight sync" in text
  assert report.to_json(result, summary, checks, {})["options"]["host"] == "tunix"


def test_the_auto_mode_sizes_the_depth_only_when_named():
  """`auto` (TUNIX_MAX_STAGED_BATCHES=auto, prestaging as depth2_prestage does) is a mode of the
  one table, run only when --modes names it, its budget the bench's (TUNIX_STAGE_MEMORY_BUDGET);
  simulate replays it as its own auto."""
  from tunix_stage_plugin.lab.embedded import bench as embedded_bench  # pylint: disable=import-outside-toplevel
  from tunix_stage_plugin.lab.sim import run as sim_run  # pylint: disable=import-outside-toplevel
  assert "auto" in modes_lib.MODES and "auto" not in modes_lib.DEFAULT_MODES
  plan = embedded_bench.plan_for("auto", 3, 4, 0.0, budget_bytes=64 << 20)
  assert (plan.kind, plan.auto, plan.prestage, plan.budget_bytes) == ("staged", True, True,
                                                                     64 << 20)
  assert sim_run.plan_of("auto").kind == "auto"


def test_the_auto_mode_says_what_it_chose_as_a_job_does(tmp_path):
  """An auto run (the default settings: the depth and the host bound sized) says each step's
  choice and why in the orchestrator's per-step line, one line per auto run in the report, and
  each step's depth and host bound with why in bench.json; the fixed mode beside it says none.
  A real bench: the embedded trainer process and its orchestrator."""
  out = tmp_path / "out"
  cmd = [sys.executable, "-m", "tunix_stage_plugin.cli.main", "bench", "--tiny", "--quick",
         "--steps", "2", "--microbatches", "3", "--payload_mib", "1",
         "--modes", "depth2_prestage,auto", "--png", "", "--trace", "", "--out", str(out)]
  env = {k: v for k, v in os.environ.items() if not k.startswith("TUNIX_")}
  result = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
  assert result.returncode == 0, result.stdout + result.stderr
  lines = [line for line in result.stderr.splitlines() if line.startswith("tunix-stage: step ")]
  assert len(lines) == 3  # the auto run's steps (the fixed run has no orchestrator line)
  assert lines[0].endswith("; depth 2: the default (no step measured yet); budget "
                           f"{figures_size(config_lib.SETTINGS_BY_FIELD['memory_budget'].default)}"
                           ", a micro-batch's size not known yet")
  report_json = json.loads((out / "bench.json").read_text())
  assert report_json["options"]["size_host_bound"] is True
  runs = {r["mode"]: r for r in report_json["runs"]}
  assert runs["depth2_prestage"]["choices"] == []
  choices = runs["auto"]["choices"]
  assert [c["step"] for c in choices] == [0, 1, 2]
  for c in choices:
    assert c["depth_why"].startswith(f"depth {c['depth']}: ")
    assert c["host_bound_why"].startswith(f"host bound {c['host_bound']}: ")
  (said,) = [line for line in result.stdout.splitlines() if line.startswith("auto round 1 chose")]
  assert said.startswith("auto round 1 chose, step by step: depth "
                         + " ".join(str(c["depth"]) for c in choices) + ", host bound ")
