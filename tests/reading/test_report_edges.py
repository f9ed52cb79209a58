"""`tunix-stage report` at its edges, a new user's: a signal while it reads a long record, a job
whose only step is its compile, a picture asked in each format matplotlib writes (and in none),
the picture's per-bar counts, and the bench's line of where the trainer's steps went taking the
same steps as its table. Records: the telemetry core's (tests/cli/test_report.py's job), a long
one through the record's own writer (tools/measure_report_size.py's), a real embedded job's
(tests/data/embedded_job).
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys

import pytest

from tests.cli.test_report import report, write_trainer_job
from tests.core.test_telemetry import compute
from tunix_stage_plugin.core import tracks
from tunix_stage_plugin.core.pipeline import StepReport
from tunix_stage_plugin.core.telemetry import process
from tunix_stage_plugin.reading import picture as picture_lib
from tunix_stage_plugin.reading import runs as runs_lib

ROOT = pathlib.Path(__file__).parent.parent.parent
DATA = ROOT / "tests" / "data"


def long_record(folder, steps):
  sys.path.insert(0, str(ROOT / "tools"))
  try:
    import measure_report_size  # pylint: disable=import-outside-toplevel
  finally:
    sys.path.pop(0)
  measure_report_size.write(str(folder), steps, 2)
  return str(folder)


def opened(pid, folder):
  """Whether process `pid` holds a file of `folder` open (it is reading its records)."""
  fds = pathlib.Path(f"/proc/{pid}/fd")
  try:
    return any(os.path.realpath(fd).startswith(folder) for fd in fds.iterdir())
  except (FileNotFoundError, ProcessLookupError):
    return False


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_ends_a_report_with_one_line(tmp_path, signum, code):
  folder = long_record(tmp_path / "r", 20000)
  proc = subprocess.Popen([sys.executable, "-m", "tunix_stage_plugin", "report", folder],  # pylint: disable=consider-using-with
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  while proc.poll() is None and not opened(proc.pid, os.path.realpath(folder)):
    pass  # until it reads the records (its handlers are in place by then)
  proc.send_signal(signum)
  out, err = proc.communicate(timeout=60)
  assert proc.returncode == code, err
  assert err.strip().splitlines() == [
      f"tunix-stage report: interrupted by {signal.Signals(signum).name}"], err
  assert "Traceback" not in err and out == ""


def test_a_job_whose_only_step_is_its_compile_is_shown_so_and_never_advised_on(tmp_path):
  """One step of waits (a boundary wait, a pool wait): its figures are shown, its bound is the
  compile it is, and nothing is advised from it."""
  write_trainer_job(tmp_path, steps=1, boundary_wait=0.5, pool_waits=1)
  out = report(str(tmp_path)).stdout
  (row,) = [line for line in out.splitlines() if line.startswith("  0 ")]
  assert row.endswith("first step (compile)")
  assert "  trainer step (its first only, which compiles: shown, never advised on): median " in out
  assert "bound by: 1 first step (compile) not judged (steps)" in out
  assert out.splitlines()[-1] == ("recommendation: nothing to change: staging kept the "
                                  "trainer's input ready")
  # With a second step, that step is judged and advised on.
  write_trainer_job(tmp_path / "two", steps=2, boundary_wait=0.5, pool_waits=1)
  assert "recommendation: TUNIX_STAGE_MAX_HOST_BATCHES=2: " in report(str(tmp_path / "two")).stdout


@pytest.mark.parametrize("suffix, magic", [(".png", b"\x89PNG"), (".svg", b"<?xml"),
                                           (".pdf", b"%PDF")])
def test_the_picture_is_written_in_the_format_its_name_asks(tmp_path, suffix, magic):
  pytest.importorskip("matplotlib")
  target = tmp_path / f"job{suffix}"
  proc = report(str(DATA / "embedded_job"), "--png", str(target))
  assert proc.stderr.strip() == f"tunix-stage report: drew {target}"
  assert target.read_bytes().startswith(magic)


@pytest.mark.parametrize("name, why", [
    ("", "an empty name"), ("job", "a name ending in no suffix"),
    ("job.xyz", "a name ending in .xyz, not a format matplotlib writes")])
def test_a_picture_name_it_cannot_write_is_refused_before_any_record_is_read(tmp_path, name,
                                                                            why):
  target = str(tmp_path / name) if name else ""
  proc = report(str(tmp_path / "no-such-records"), "--png", target, check=False)
  assert proc.returncode == 2 and proc.stdout == ""
  (line,) = proc.stderr.strip().splitlines()
  assert line.startswith("tunix-stage report: error: --png") and why in line
  assert picture_lib.ACCEPTED in line and "no-such-records" not in line


def test_each_bar_counts_its_step_s_own_micro_batches(tmp_path):
  """A trainer whose step windows hold placements of the next step's micro-batches (a prestage)
  and an orchestrator that trained 3 staged and 1 inline each step: each bar says the step's own
  3s 1i (joined by the train step both number); a trainer with no orchestrator record, its
  fwd_bwds."""
  tel = process.Telemetry(process.Settings(host="tunix", metrics_dir=str(tmp_path), log_every=0))
  tel.trainer()
  t = 0.0
  for step in range(3):
    spans = [compute("fwd_bwd", t + i * 0.5, t + i * 0.5 + 0.5) for i in range(4)]
    for i in range(5):  # 5 placements in the window: one is the next step's, prestaged
      tel.recorder.add(tracks.TRAINER_H2D, "s-m", t + 0.1 * i, t + 0.1 * i + 0.05, lane="staging",
                       bytes=8)
    for span in spans + [compute("update", t + 2.0, t + 2.2, host_step=step + 1)]:
      tel.recorder.add(span.track, span.name, span.start, span.end, **dict(span.args))
    tel.orchestrator_step(StepReport(step, trained=4, staged=3, inline=1), 2,
                          host_step=step + 1)
    t += 2.5
  tel.close()
  (run,), _ = runs_lib.runs([str(tmp_path)])
  # placements in each step's window
  assert run.trainer_steps["placed_staged"].tolist() == [5, 5, 5]
  assert picture_lib.counts(run) == ["3s\n1i\ncompile", "3s\n1i", "3s\n1i"]
  alone = runs_lib.Run(run.label, tuple(p for p in run.processes if p.role == "trainer"),
                       run.started)
  assert picture_lib.counts(alone) == ["4n\ncompile", "4n", "4n"]
