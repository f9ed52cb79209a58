"""`tunix-stage report A B` (reading/compare.py) and `report --png` (reading/picture.py) over
tiny runs the telemetry core wrote: each run's trainer records written by a process of its own
(test_report's job, in a child process), so the two runs are two jobs' processes, as a user's
two folders are. The real two-process tunix job's runs: tests/hosts/tunix/test_observability.py.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import textwrap

import pytest

from tests.cli.test_report import report
from tunix_stage_plugin.reading import compare as report_compare


def write_run(folder, **job):
  """test_report.write_trainer_job(folder, **job), in a process of its own."""
  code = textwrap.dedent(f"""
      import pathlib
      from tests.cli.test_report import write_trainer_job
      write_trainer_job(pathlib.Path({str(folder)!r}), **{job!r})
  """)
  subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
  return str(folder)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """Two runs of 7 steps: A waits 0.5 s at each boundary and once a step for its receive pool
  (a host bound of 1), B never waits (a host bound of 2); and a run of 3 steps."""
  root = tmp_path_factory.mktemp("runs")
  return {"a": write_run(root / "a", steps=7, boundary_wait=0.5, pool_waits=1),
          "b": write_run(root / "b", steps=7, host_batches=2),
          "short": write_run(root / "short", steps=3)}


def figures(data):
  return {f["name"]: f for f in data["figures"]}


def test_two_runs_compared_each_figure_s_median_the_change_and_the_verdict(runs):
  data = json.loads(report(runs["a"], runs["b"], "--json").stdout)
  assert [r["label"] for r in data["runs"]] == [runs["a"], runs["b"]]
  assert [r["trainer_steps"] for r in data["runs"]] == [7, 7]
  assert data["test"] == report_compare.TEST and "Mann-Whitney U" in data["test"]
  f = figures(data)
  # B takes the boundary's 0.5 s and the pool's wait off each step (6 judged steps each).
  wait = f["stage/input_wait_boundary_s"]
  assert (wait["a"], wait["b"], wait["change"]) == pytest.approx((0.5, 0.0, -0.5))
  assert wait["change_pct"] == pytest.approx(-1.0) and wait["steps"] == [6, 6]
  assert wait["verdict"] == report_compare.BEYOND and wait["p"] < 0.05
  assert f["stage/step_s"]["change"] == pytest.approx(-0.5)
  assert f["stage/step_s"]["verdict"] == report_compare.BEYOND
  assert f["stage/pool_waits"]["a"] == 1 and f["stage/pool_waits"]["b"] == 0
  # What did not change is within the noise: the same compute, the same placements.
  for name in ("stage/compute_s", "stage/placed_staged", "stage/placed_inline"):
    assert f[name]["verdict"] == report_compare.WITHIN, f[name]
  assert f["stage/placed_staged"]["a"] == f["stage/placed_staged"]["b"] == 2
  # Each run's own summary, as `report` judges one job.
  a, b = (r["summary"] for r in data["runs"])
  # counts over every step but a first (its compile, counted apart)
  assert a["trainer"]["bound_by"]["wire"] == 6 and b["trainer"]["bound_by"]["compute"] == 6
  assert a["trainer"]["first_steps"] == b["trainer"]["first_steps"] == 1
  assert any("TUNIX_STAGE_MAX_HOST_BATCHES=2" in line for line in a["recommendations"])
  assert b["recommendations"] == []


def test_the_text_says_the_same_table_and_how_noise_is_decided(runs):
  out = report(runs["a"], runs["b"]).stdout.splitlines()
  assert out[0] == f"A: {runs['a']} (7 trainer steps, 0 orchestrator steps)"
  row = next(line.split() for line in out if "stage/input_wait_boundary_s" in line)
  assert row[:6] == ["trainer", "stage/input_wait_boundary_s", "0.500", "0.000", "-0.500",
                     "(-100%)"]
  assert " ".join(row[6:]).startswith("beyond the noise (p=0.0")
  row = next(line.split() for line in out if "stage/placed_staged" in line)
  assert row[2:5] == ["2", "2", "+0"] and " ".join(row[6:]).startswith("within the noise")
  assert f"noise: {report_compare.TEST}" in out
  assert out[-1] == "B: recommendation: nothing to change"


def test_a_run_of_fewer_steps_than_the_test_needs_is_too_few_to_tell(runs):
  data = json.loads(report(runs["a"], runs["short"], "--json").stdout)
  f = figures(data)
  assert f["stage/step_s"]["steps"] == [6, 2]
  assert {x["verdict"] for x in data["figures"]} == {report_compare.TOO_FEW}
  assert f["stage/input_wait_boundary_s"]["change"] == pytest.approx(-0.5)  # still said


def test_two_paths_of_one_job_are_one_report_not_a_comparison(runs, tmp_path):
  """A job's records named file by file (its trainer's and its orchestrator's), or one folder
  twice, hold no two runs of other processes: the one job's report."""
  out = report(runs["a"], runs["a"]).stdout
  assert "overall (medians per step" in out and "medians a step" not in out
  (trainer,) = [str(p) for p in pathlib.Path(runs["a"]).glob("*.jsonl")]
  other = tmp_path / "orchestrator-x-1.jsonl"
  record = json.loads(open(trainer, encoding="utf-8").readline())
  other.write_text(json.dumps({**record, "role": "orchestrator", "step_s": None,
                               "microbatches": 2, "depth": 2, "staged": 2, "inline": 0,
                               "prestaged": 0, "peak_staged": 2,
                               "fallbacks": {"count": 0, "by_kind": {}}, "sent": {},
                               "stage_calls": {"count": 2, "seconds": 0.1, "median_s": 0.05,
                                               "max_s": 0.05}}) + "\n")
  out = report(trainer, str(other)).stdout
  assert "overall (medians per step" in out and "orchestrator " in out


@pytest.mark.parametrize("bad", ["missing", "other-schema"])
def test_compare_refuses_what_report_refuses_in_one_line(runs, tmp_path, bad):
  path = tmp_path / "r.jsonl"
  if bad == "other-schema":
    path.write_text('{"schema": "x"}\n')
  proc = report(runs["a"], str(path), check=False)
  assert proc.returncode == 2 and proc.stdout == ""
  (line,) = proc.stderr.strip().splitlines()
  assert line.startswith("tunix-stage report: error: ")


def test_mann_whitney_p_agrees_with_scipy():
  stats = pytest.importorskip("scipy.stats")
  cases = [([1, 2, 3, 4, 5], [6, 7, 8, 9, 10]),
           ([1.0, 2.0, 2.0, 3.0, 5.0], [2.0, 3.0, 4.0, 4.0, 6.0]),
           ([0.5] * 6, [0.5] * 6 + [0.6]), ([3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8])]
  for a, b in cases:
    expected = stats.mannwhitneyu(a, b, alternative="two-sided", method="asymptotic").pvalue
    assert report_compare.mann_whitney_p(a, b) == pytest.approx(expected), (a, b)
  assert report_compare.mann_whitney_p([1, 1, 1, 1, 1], [1, 1, 1, 1, 1]) == 1.0


def picture(path):
  """The PNG read back as a picture: (height, width), and the distinct colours inside its plot
  areas (the middle of the picture, away from the title and the legend)."""
  image = pytest.importorskip("matplotlib.image").imread(path)
  height, width = image.shape[:2]
  area = image[int(height * 0.25):int(height * 0.75), int(width * 0.1):int(width * 0.95), :3]
  colours = {tuple(px) for px in (area.reshape(-1, 3) * 255).round().astype(int).tolist()}
  return (height, width), colours


def test_png_draws_one_panel_for_a_job_and_two_side_by_side_for_two_runs(runs, tmp_path):
  pytest.importorskip("matplotlib")
  one, two = tmp_path / "one.png", tmp_path / "two.png"
  proc = report(runs["a"], "--png", str(one))
  assert "overall (medians per step" in proc.stdout  # the report, and the picture beside it
  assert proc.stderr.strip() == f"tunix-stage report: drew {one}"
  proc = report(runs["a"], runs["b"], "--png", str(two), "--json")
  json.loads(proc.stdout)  # --json stays one JSON object on stdout
  (h1, w1), c1 = picture(one)
  (h2, w2), c2 = picture(two)
  assert h1 == h2 == 520 and w2 > w1 >= 700  # 5.2 in high, at least 7 in a panel, at 100 dpi
  # Not blank: the bars' colours in the plot area (compute blue, boundary wait orange).
  assert len(c1) > 1 and len(c2) > 1
  assert (31, 119, 180) in c1 and (255, 127, 14) in c1  # PARTS' #1f77b4 and #ff7f0e


@pytest.mark.parametrize("target, why", [
    ("{tmp}", "a folder"),
    ("{tmp}/no/such/folder/x.png", "its folder is not a folder that exists"),
    ("{file}/x.png", "its folder is not a folder that exists"),
])
def test_png_refuses_a_file_it_cannot_write_in_one_line_before_reading(runs, tmp_path, target,
                                                                       why):
  (tmp_path / "f").write_text("")
  target = target.format(tmp=tmp_path, file=tmp_path / "f")
  proc = report(runs["a"], "--png", target, check=False)
  assert proc.returncode == 2 and proc.stdout == ""
  (line,) = proc.stderr.strip().splitlines()
  assert line.startswith("tunix-stage report: error: --png=") and why in line
  assert "accepted: a file to write whose name ends in .png, .svg" in line


def test_png_without_matplotlib_is_one_line_naming_the_extra(runs, tmp_path):
  code = textwrap.dedent(f"""
      import sys

      class Block:
        def find_spec(self, name, path=None, target=None):
          if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(f"blocked: {{name}}")
          return None

      sys.meta_path.insert(0, Block())
      from tunix_stage_plugin.cli import main
      sys.exit(main.main(["report", {runs['a']!r}, "--png", {str(tmp_path / 'p.png')!r}]))
  """)
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        timeout=120)
  assert proc.returncode == 2 and proc.stdout == ""  # refused before any record is read
  (line,) = proc.stderr.strip().splitlines()
  assert line.startswith("tunix-stage report: error: --png=") and "matplotlib is not installed" \
      in line
  assert "'report' extra" in line and "pip install" in line
  assert not (tmp_path / "p.png").exists()
