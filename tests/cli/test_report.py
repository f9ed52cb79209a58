"""`tunix-stage report` over records the telemetry core wrote (core.telemetry: real files in a
real folder), and over bad input.

The records come from the aggregators fed spans of steps this test builds, so the figures the
report prints are checked against what each step was built to hold.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from tests.core.test_telemetry import compute
from tunix_stage_plugin.cli import main as cli_main
from tunix_stage_plugin.core import install_hint
from tunix_stage_plugin.core import tracks
from tunix_stage_plugin.core.telemetry import process
from tunix_stage_plugin.core.telemetry.recorder import Span
from tunix_stage_plugin.reading import records as records_lib
from tunix_stage_plugin.reading import report as report_cmd

MIB = 1 << 20


def write_trainer_job(folder, steps=4, boundary_wait=0.0, pool_waits=0, host_batches=1,
                      inline_from=None):
  """A trainer process's records: `steps` steps of 2 fwd_bwd (1.0 s each) and an update (0.2 s),
  each micro-batch received (0.4 s, 64 MiB) and placed (0.1 s) beside the computation before it;
  `boundary_wait` idle seconds before each step's first computation; `pool_waits` receive-pool
  waits of 0.3 s a step. From step `inline_from` on, the job runs inline: each micro-batch is
  received and placed in its own call, before its computation (0.5 s of input wait each)."""
  tel = process.Telemetry(process.Settings(
      host="tunix", metrics_dir=str(folder), log_every=0,
      shaping=(("max_device_batches", 1), ("max_host_batches", host_batches))))
  tel.trainer(lambda: (1, 1))
  t = 0.0
  for step in range(steps):
    t += boundary_wait
    spans = []
    inline = inline_from is not None and step >= inline_from
    for _ in range(2):
      spans += [Span(tracks.TRAINER_RECEIVE, "stage_batch", t, t + 0.4,
                     (("bytes", 64 * MIB), ("transport", "side"))),
                Span(tracks.TRAINER_H2D, "s-m", t + 0.4, t + 0.5,
                     (("bytes", 64 * MIB), ("lane", "inline" if inline else "staging")))]
      t += 0.5 if inline else 0.0
      spans.append(compute("fwd_bwd", t, t + 1.0))
      t += 1.0
    spans += [Span(tracks.TRAINER_POOL_WAIT, "pool wait", t - 0.5, t - 0.2,
                   (("bytes", 64 * MIB), ("over", False)))] * pool_waits
    spans.append(compute("update", t, t + 0.2))
    t += 0.2
    for span in spans:
      tel.recorder.add(span.track, span.name, span.start, span.end, **dict(span.args))
  tel.close()
  return [path for path, _ in records_lib.files([str(folder)])]


def report(*argv, check=True):
  """`tunix-stage report ARGV`, its output and exit code, run in this process by the CLI's own
  main (a process of its own costs ~0.5 s of imports a call; tests/reading/test_report_edges.py
  runs it as a process, for its signals)."""
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
      code = cli_main.main(["report", *argv])
    except SystemExit as e:  # argparse's refusal of bad flags
      code = e.code
  proc = subprocess.CompletedProcess(["tunix-stage", "report", *argv], code, out.getvalue(),
                                     err.getvalue())
  if check:
    assert proc.returncode == 0, proc.stderr
  return proc


def test_report_prints_each_step_and_what_held_staging_back(tmp_path):
  write_trainer_job(tmp_path, boundary_wait=0.5, pool_waits=1)
  out = report(str(tmp_path)).stdout
  assert "trainer " in out and "(tunix, 4 steps)" in out
  steps = [line.split() for line in out.splitlines() if line.startswith("  ") and
           line.split()[:1] in (["0"], ["1"], ["2"], ["3"])]
  assert [s[0] for s in steps] == ["0", "1", "2", "3"]
  # Each step after the first: 2.7 s long, 2.2 s of compute, 0.5 s of boundary wait.
  assert steps[1][1:6] == ["2.70", "2.20", "0.00", "0.50", "0.00"]
  # Totals count every step of the table they sum (the header says so); medians leave step 0 out.
  assert "totals are over every step" in out and "a first step out" in out
  # Step 0 (its compile) is shown as such and bounds nothing.
  assert "bound by: wire in 3, 1 first step (compile) not judged (steps)" in out
  assert steps[0][-3:] == ["first", "step", "(compile)"]
  assert "received by side channel: 8 calls, 512.0 MiB at 0.16 GiB/s" in out
  assert "TUNIX_STAGE_MAX_HOST_BATCHES=2" in out  # the pool waited: one more host batch


def test_report_json_carries_the_records_and_the_summary(tmp_path):
  write_trainer_job(tmp_path)
  data = json.loads(report(str(tmp_path), "--json").stdout)
  (run,) = data["runs"]  # one run: one job's records
  (proc,) = run["processes"]
  assert proc["role"] == "trainer" and [r["step"] for r in proc["records"]] == [0, 1, 2, 3]
  summary = run["summary"]["trainer"]
  assert summary["step_s"] == pytest.approx(2.2) and summary["input_wait_s"] == pytest.approx(0)
  assert summary["bound_by"] == {"compute": 3, "wire": 0, "shared cores": 0}
  assert summary["first_steps"] == 1 and not summary["only_first"]
  # Totals over every step, as the table: 4 steps of 2 receives of 64 MiB.
  assert summary["received"]["side"]["calls"] == sum(
      r["receive"]["calls"] for r in proc["records"]) == 8
  # Inline, each step's 2 micro-batches would have received (0.4 s) and been placed (0.1 s).
  assert summary["inline_wait_estimate_s"] == pytest.approx(1.0)
  assert summary["hidden_s"] == pytest.approx(1.0)
  assert run["summary"]["recommendations"] == [] and data["notes"] == []


def test_a_job_run_staged_then_inline_says_each_path_s_wait_and_judges_the_staged_steps(
    tmp_path):
  """Steps 0-2 staged, 3-5 inline (0.5 s of input wait before each fwd_bwd): the report says
  each path's wait apart, and recommends nothing for staging (its steps never waited)."""
  write_trainer_job(tmp_path, steps=6, inline_from=3)
  data = json.loads(report(str(tmp_path), "--json").stdout)["runs"][0]
  paths = data["summary"]["trainer"]["by_path"]
  # Step 0 has no step before it and is left out: 2 staged steps, 3 inline ones.
  assert paths["staged"] == {"steps": 2, "input_wait_s": pytest.approx(0.0)}
  # Inline: the first micro-batch's 0.5 s counts at the boundary, the second's mid-step.
  assert paths["inline"] == {"steps": 3, "input_wait_s": pytest.approx(1.0)}
  assert data["summary"]["recommendations"] == []
  # What staging hid: judged in the steps that staged (2 micro-batches of 0.4 + 0.1 s each).
  trainer = data["summary"]["trainer"]
  assert trainer["hidden_s"] == pytest.approx(1.0) and trainer["input_wait_s"] == pytest.approx(1.0)
  out = report(str(tmp_path)).stdout
  assert "input wait a step: 0.00 s staged (2 steps), 1.00 s inline (3 steps)" in out
  assert "staging hid 1.00 s a step of an inline estimate of 1.00 s of input wait (100%) (in " \
      "the steps that staged)" in out
  assert out.splitlines()[-1] == ("recommendation: nothing to change: staging kept the "
                                  "trainer's input ready")


def test_a_cut_last_line_is_a_note_and_the_rest_is_read(tmp_path):
  (path,) = write_trainer_job(tmp_path, steps=2)
  with open(path, "a", encoding="utf-8") as f:
    f.write('{"schema": "tunix-stage-metr')
  # Just written: still being written (a job still running), not a killed one.
  out = report(path).stdout
  assert out.startswith(f"note: {path}: its last line is still being written (the file changed "
                        ) and "2 steps" in out
  # Left so a minute: the process was killed while writing it.
  old = time.time() - 60
  os.utime(path, (old, old))
  out = report(path).stdout
  assert out.startswith(f"note: {path}: its last line is cut short (the process was killed "
                        "while writing it); read the 2 whole record(s) before it") and \
      "2 steps" in out


@pytest.mark.parametrize("content, message", [
    (None, "no such file or folder"),
    ("", "holds no record"),
    ('{"schema": "tunix-stage-metrics", "version": 3}\n', "schema version 3 is not one this"),
    ('{"a": 1}\n{"b": 2}\n', "not a tunix-stage-metrics record"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, content, message):
  path = tmp_path / "r.jsonl"
  if content is not None:
    path.write_text(content)
  proc = report(str(path), check=False)
  assert proc.returncode == 2 and proc.stdout == ""
  (line,) = proc.stderr.strip().splitlines()
  assert line.startswith("tunix-stage report: error: ") and message in line


def test_report_is_a_subcommand_that_needs_a_path():
  assert "report" in cli_main.subcommands()
  with pytest.raises(SystemExit) as e:
    cli_main.main(["report"])
  assert e.value.code == 2


def test_without_the_lab_the_advice_is_the_rule_s_marked_not_checked(tmp_path):
  """The report is production: with the lab and its libraries blocked (as tests/test_layout.py
  blocks them) it still prints the rule's advice, each marked not checked, and loads no lab
  module."""
  write_trainer_job(tmp_path, boundary_wait=0.5, pool_waits=1)
  code = textwrap.dedent(f"""
      import sys

      class Block:
        def find_spec(self, name, path=None, target=None):
          if any(name == b or name.startswith(b + ".") for b in
                 ("tunix_stage_plugin.lab", "optax", "looptime", "matplotlib")):
            raise ImportError(f"blocked: {{name}}")
          return None

      sys.meta_path.insert(0, Block())
      from tunix_stage_plugin.cli import main
      code = main.main(["report", {str(tmp_path)!r}])
      assert not [m for m in sys.modules if m.startswith("tunix_stage_plugin.lab")]
      sys.exit(code)
  """)
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  advice = [line for line in proc.stdout.splitlines() if line.startswith("recommendation: ")]
  assert advice and all(line.endswith("not checked (simulate needs the [bench] extra: "
                                      f"{install_hint.install_command('bench')})")
                        for line in advice), advice
  assert any(line.startswith("recommendation: TUNIX_STAGE_MAX_HOST_BATCHES=2: ")
             for line in advice), advice


def _step_rows(out):
  return [int(line.split()[0]) for line in out.splitlines()
          if line.startswith("  ") and line.split()[0].isdigit()]


def test_steps_shows_each_process_s_last_n_and_the_summary_is_over_every_step(tmp_path):
  write_trainer_job(tmp_path, steps=6, boundary_wait=0.5)
  every = report(str(tmp_path)).stdout  # 6 steps: fewer than the default, all shown
  assert _step_rows(every) == [0, 1, 2, 3, 4, 5] and "steps left out" not in every
  last = report(str(tmp_path), "--steps", "2").stdout
  assert _step_rows(last) == [4, 5]
  assert "  (the first 4 of its 6 steps left out: --steps N shows the last N, --steps 0 the " \
      "summary only)" in last
  summary_only = report(str(tmp_path), "--steps", "0").stdout
  assert _step_rows(summary_only) == [] and "steps left out" not in summary_only
  assert "trainer " in summary_only and "(tunix, 6 steps)" in summary_only
  tail = lambda out: out[out.index("overall"):]  # pylint: disable=unnecessary-lambda-assignment
  assert tail(every) == tail(last) == tail(summary_only)
  (run,) = json.loads(report(str(tmp_path), "--json", "--steps", "1").stdout)["runs"]
  (proc,) = run["processes"]
  assert proc["steps"] == 6 and [r["step"] for r in proc["records"]] == [5]
  (whole,) = json.loads(report(str(tmp_path), "--json").stdout)["runs"]
  assert run["summary"] == whole["summary"]


def test_a_long_record_s_table_shows_its_last_steps_by_default(tmp_path):
  steps = report_cmd.DEFAULT_STEPS + 3
  write_trainer_job(tmp_path, steps=steps)
  out = report(str(tmp_path)).stdout
  assert _step_rows(out) == list(range(3, steps))
  assert f"  (the first 3 of its {steps} steps left out: --steps N" in out


@pytest.mark.parametrize("value", ["-1", "abc", "1e3", str(report_cmd.MAX_STEPS + 1)])
def test_a_bad_steps_value_is_refused_saying_what_is_accepted(tmp_path, value):
  write_trainer_job(tmp_path, steps=1)
  proc = report(str(tmp_path), f"--steps={value}", check=False)
  assert proc.returncode == 2 and proc.stdout == ""
  assert proc.stderr.strip().splitlines()[-1].endswith(
      f"accepted: an integer >= 0 and <= {report_cmd.MAX_STEPS}")


def test_a_file_given_twice_is_read_once(tmp_path):
  (path,) = write_trainer_job(tmp_path, steps=2)
  out = report(str(tmp_path), path, str(tmp_path)).stdout
  assert "(tunix, 2 steps)" in out and out.count("run: ") == 1
