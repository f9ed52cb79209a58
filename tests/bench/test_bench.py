"""`tunix-stage bench`: its arithmetic on made-up spans, its checks, and a tiny real run."""

from __future__ import annotations

import dataclasses
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time

import pytest

from tunix_stage_plugin.bench import metrics
from tunix_stage_plugin.bench import report
from tunix_stage_plugin.bench import runner
from tunix_stage_plugin.cli import main as cli_main
from tunix_stage_plugin.core import tracks
from tunix_stage_plugin.core.timeline import Span
from tunix_stage_plugin.embedded import data as data_lib


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


@pytest.mark.parametrize("inline, mode, resident, expected", [
    (10.0, 10.0, 4.0, 0.0), (10.0, 4.0, 4.0, 1.0), (10.0, 5.5, 4.0, 0.75),
    (10.0, 5.0, 10.0, None), (None, 5.0, 4.0, None)])
def test_hidden_fraction(inline, mode, resident, expected):
  assert metrics.hidden_fraction(inline, mode, resident) == expected


def test_the_step_limit_is_the_device_never_waiting():
  assert metrics.step_limit(9, 0.5, 0.03, 0.25) == pytest.approx(4.78)


def _run(mode, seconds, *, digest="d" * 64, order=None, peak=1, foreign=0.0, round_=0,
         stage_call_s=()):
  timings = [metrics.StepTiming(1, seconds, 0.1, 0.2, seconds - 0.3)]
  return runner.ModeRun(
      mode=mode, round=round_, timings=timings, fwd_bwd_s=[[1.7]], update_s=[0.1],
      stage_call_s=list(stage_call_s), fallbacks=0, fallback_reasons=[],
      peak_device_batches=peak, max_device_batches=2, peak_host_batches=1,
      trained_order=order or data_lib.expected_order(2, 2), param_digest=digest,
      step_foreign_cores=[foreign], spans=[], origin=0.0)


def _result(**overrides):
  options = runner.BenchOptions(rounds=1, steps=1, microbatches=2)
  runs = {"inline": _run("inline", 10.0), "depth1": _run("depth1", 7.0),
          "depth2": _run("depth2", 7.0), "depth2_prestage": _run("depth2_prestage", 4.1),
          "resident": _run("resident", 4.0)}
  runs.update(overrides)
  calibration = runner.Calibration(1.0, 0.1, 1 << 20, 1e6, 2e6, 0.5, 0.0, 0.0)
  return runner.BenchResult(options, calibration, list(runs.values()))


def _failing(result):
  summary = report.summarize(result)
  return [c.name for c in report.criteria(result, summary) if c.passed is False]


def test_criteria_pass_on_a_good_result_and_the_table_shows_every_mode():
  result = _result()
  summary = report.summarize(result)
  checks = report.criteria(result, summary)
  assert [c.passed for c in checks] == [True] * 6
  pre = summary["depth2_prestage"]
  assert pre.hidden_fraction == pytest.approx(5.9 / 6)
  # limit = 2 x 1.7 fwd_bwd + 0.1 update + 0.5 weight sync = 4.0 s
  assert pre.limit_s == pytest.approx(4.0) and pre.step_over_limit == pytest.approx(4.1 / 4.0)
  table = report.format_table(result, summary)
  for mode in runner.MODES:
    assert mode in table
  assert "limit" in table.splitlines()[0] and "1.025" in table
  text = report.format_report(result, summary, checks)
  assert text.count("PASS") == 6 and "FAIL" not in text
  assert "stage calls:" not in text  # no stage call was recorded


def test_the_report_states_the_stage_calls_against_compute():
  result = _result(depth2_prestage=_run("depth2_prestage", 4.1, stage_call_s=[0.8, 0.8]))
  summary = report.summarize(result)
  text = report.format_report(result, summary, report.criteria(result, summary))
  assert "stage calls: 0.800 s each (median, measured; the wire alone is 1.049 s emulated)" in \
      text
  assert "peak received host buffers 1 of 1" in text


@pytest.mark.parametrize("override, failing", [
    ({"resident": _run("resident", 3.9)}, "depth2_prestage hidden"),  # 0.967 < 0.97
    ({"depth2_prestage": _run("depth2_prestage", 4.15)}, "depth2_prestage step"),  # 1.04 x
    ({"depth2": _run("depth2", 8.0)}, "inline / depth2"),
    ({"depth1": _run("depth1", 7.0, digest="e" * 64)}, "same param_digest"),
    ({"depth2": _run("depth2", 7.0, order=["s0-m1", "s0-m0", "s1-m0", "s1-m1"])},
     "expected trained_order"),
    ({"depth2": _run("depth2", 7.0, peak=3)}, "peak staged"),
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
  parser = cli_main.build_parser()
  subparsers = next(a for a in parser._actions if a.dest == "command")
  return subparsers.choices["bench"]


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
      "--rounds '0': accepted: an integer from 1 to 1000000",
      "--steps '99999999999999999999999': accepted: an integer from 1 to 1000000",
      "--retries '-1': accepted: an integer from 0 to 1000000",
      "--modes 'inline,fast': accepted: a comma-separated subset of",
      "--microbatches '٣': accepted: an integer from 1 to 1000000",
      "--payload_mib '1e-30': accepted: a size in MiB from 1/1024 (1 KiB)",
      "--wire_ratio '-1': accepted: a number > 0",
      "--h2d_ratio 'nan': accepted: a number > 0",
      "--sync_ratio '-0.5': accepted: a number >= 0",
      "--stage_max_device_batches '1_0': accepted: an integer from 1 to 1000000",
      "--seed '-1': accepted: an integer from 0 to 4294967295",
      f"--json '{tmp_path}': is a directory",
      "--png '/proc/no/such.png': cannot create anything in /proc",
      f"--trace '{a_file / 'trace.json'}': {a_file} is not a directory",
  ]
  assert len(err) == len(expected), err
  for line, want in zip(err, expected):
    assert line.startswith(f"tunix-stage bench: error: {want}"), (line, want)
  assert not out.exists()  # --out is not needed (every file was named) and nothing was made


@pytest.mark.parametrize("args, message", [
    (["--out", "/proc/x"], "--out '/proc/x': cannot create anything in /proc"),
    (["--seed", str(2**32)], "accepted: an integer from 0 to 4294967295"),
    (["--payload_mib", "65536"], "held at once (12 resident on the trainer, 9 built ahead or "
     "staged) need 1344.0 GiB, more than the"),
    (["--png", "", "--trace", "", "--json", "{tmp}/a/b/../b.json", "--modes", "inline,inline"],
     "--modes 'inline,inline': accepted: a comma-separated subset of inline,depth1,depth2,"
     "depth2_prestage,resident, each at most once"),
])
def test_a_bad_option_exits_2_with_one_line(args, message, tmp_path, capsys):
  args = [a.replace("{tmp}", str(tmp_path)) for a in args]
  assert cli_main.main(["bench", "--out", str(tmp_path / "out"), *args]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and message in err, err
  assert list(tmp_path.iterdir()) == []


def test_tiny_marks_the_timing_checks_not_applicable():
  result = _result(depth2=_run("depth2", 11.0))  # a negative hidden fraction
  result.options = dataclasses.replace(result.options, tiny=True)
  summary = report.summarize(result)
  checks = report.criteria(result, summary)
  assert [c.verdict for c in checks] == ["n/a (tiny)"] * 3 + ["PASS"] * 3
  assert [c.passed for c in checks if c.kind == report.TIMING] == [None] * 3
  assert checks[2].detail == f"{10 / 11:.3f}"  # the figure is still shown
  table = report.format_table(result, summary)
  assert "-0.17 (n/a)" in table and "1.00 (n/a)" in table
  text = report.format_report(result, summary, checks)
  assert "FAIL" not in text and "n/a (tiny): --tiny's model is too small" in text
  as_json = report.to_json(result, summary, checks, {})
  assert [c["verdict"] for c in as_json["criteria"]][:3] == ["n/a (tiny)"] * 3


def test_a_partial_result_summarizes_the_runs_that_finished():
  result = runner.BenchResult(runner.BenchOptions(rounds=2, steps=1, microbatches=2))
  result.interrupted = "SIGTERM"
  as_json = report.to_json(result, report.summarize(result), report.criteria(
      result, report.summarize(result)), {"json": "x"})
  assert as_json["interrupted"] is True and as_json["interrupted_by"] == "SIGTERM"
  assert as_json["calibration"] is None and as_json["runs"] == [] and as_json["modes"] == {}
  assert [c["passed"] for c in as_json["criteria"]] == [None] * 6
  result.calibration = _result().calibration
  result.runs = [_run("inline", 10.0), _run("depth1", 7.0)]
  summary = report.summarize(result)
  assert list(summary) == ["inline", "depth1"]
  assert [c.passed for c in report.criteria(result, summary)] == [None, None, None, True, True,
                                                                  True]


def test_batch_prefetch_builds_a_bounded_window_in_training_order():
  sizes, steps, m = data_lib.TINY_SIZES, 50, 3
  before = threading.active_count()
  with runner.BatchPrefetch(sizes, 7, steps, m) as batch_for:
    assert threading.active_count() == before + 1
    for s in range(steps):
      for i in range(m):
        batch = batch_for(s, i)
        want = data_lib.make_batch(sizes, 7, s, i)
        assert batch.mb_id == want.mb_id
        assert all((batch.arrays[k] == want.arrays[k]).all() for k in want.arrays)
        assert batch_for.waiting <= runner.PREFETCH_STEPS * m
  with runner.BatchPrefetch(sizes, 7, steps, m) as batch_for:
    with pytest.raises(ValueError, match="more than 2 steps ahead"):
      batch_for(runner.PREFETCH_STEPS, 0)
  assert threading.active_count() == before


def test_tiny_quick_run_writes_json_png_and_trace(tmp_path):
  out = tmp_path / "out"
  cmd = [sys.executable, "-m", "tunix_stage_plugin.cli.main", "bench", "--tiny", "--quick",
         "--steps", "1", "--microbatches", "3", "--payload_mib", "0.05", "--out", str(out)]
  result = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
  assert result.returncode == 0, result.stdout + result.stderr
  for mode in runner.MODES:  # progress on stderr, the table on stdout
    assert f"round 1/1 {mode}" in result.stderr
    assert mode in result.stdout
  assert "PASS  same param_digest in every mode and round" in result.stdout
  report_json = json.loads((out / "bench.json").read_text())
  expected = data_lib.expected_order(2, 3)  # one warm-up step + one timed step
  assert report_json["expected_trained_order"] == expected
  assert set(report_json["modes"]) == set(runner.MODES)
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
  assert names == {f"{m} (round 1)" for m in runner.MODES}
  thread_names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
  assert {tracks.DEVICE_COMPUTE, tracks.TRAINER_H2D, tracks.ORCHESTRATOR_STAGE} <= thread_names


def _trainer_children(pid: int) -> list[int]:
  """trainer_main processes whose parent is `pid` (from /proc)."""
  found = []
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/stat", encoding="ascii") as f:
        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
      with open(f"/proc/{entry}/cmdline", "rb") as f:
        cmdline = f.read()
    except (OSError, ValueError, IndexError):
      continue
    if ppid == pid and b"tunix_stage_plugin.embedded.trainer_main" in cmdline:
      found.append(int(entry))
  return found


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
    trainers = _trainer_children(proc.pid)
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
  slow = runner.transfer_slowdown("bursty", 0, 9)
  factors = {(s, i): slow(data_lib.Batch(s, i, {})) for s in range(40) for i in range(9)}
  assert all(f >= 1.6 for (s, i), f in factors.items() if i < 3)  # the first third of a step
  assert all(f in (1.0, 2.0) for (s, i), f in factors.items() if i >= 3)
  spikes = sum(f in (2.0, 3.2) for f in factors.values()) / len(factors)
  assert 0.1 < spikes < 0.3  # about a fifth
  again = runner.transfer_slowdown("bursty", 0, 9)
  assert all(again(data_lib.Batch(s, i, {})) == f for (s, i), f in factors.items())  # seeded
  assert runner.transfer_slowdown("steady", 0, 9) is None


def test_the_bursty_scenario_judges_depth2_against_depth1():
  result = _result()
  result.options = dataclasses.replace(result.options, scenario="bursty")
  assert _failing(result) == ["bursty: depth2 beats depth1 (depth1 / depth2 median step > 1)"]
  result = _result(depth2=_run("depth2", 6.5))
  result.options = dataclasses.replace(result.options, scenario="bursty")
  assert _failing(result) == []
