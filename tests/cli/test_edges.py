"""The edges of `tunix-stage` that need a process of their own: pipes, FIFOs, bounds on time.

Each case runs the real console entry point in a subprocess with a timeout (the bound on "no
hang"), as a user's shell would: its output into a pipe whose reader has gone, an input that is a
FIFO nobody writes, traces at and past the simulator's bounds, the examples the help points at.
The generated cases of every subcommand are in test_generated_inputs.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
import subprocess
import sys

import pytest

from tunix_stage_plugin.lab.sim import trace as trace_lib

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.json"))


def tunix_stage(*argv: str, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
  kwargs.setdefault("stdout", subprocess.PIPE)
  return subprocess.run([sys.executable, "-m", "tunix_stage_plugin", *argv], stderr=subprocess.PIPE,
                        text=True, timeout=timeout, check=False, cwd=ROOT, **kwargs)


@pytest.mark.parametrize("argv", [
    ["config", "--json"],
    ["--help"],
    ["simulate", "examples/upstream_pattern.json", "--modes", "inline", "--json", "-"],
    ["bench", "--compare", "examples/bench_tiny_a.json", "examples/bench_tiny_b.json"],
], ids=lambda argv: " ".join(argv[:2]))
def test_output_into_a_pipe_whose_reader_has_gone_ends_quietly(argv):
  """`tunix-stage config --json | head -1`, with the reader gone before the first write."""
  read, write = os.pipe()
  os.close(read)
  try:
    proc = tunix_stage(*argv, stdout=write)
  finally:
    os.close(write)
  assert proc.returncode == (0 if argv == ["--help"] else 1), proc.stderr
  assert proc.stderr == ""  # no BrokenPipeError traceback, no "Exception ignored"


def test_a_fifo_as_input_is_refused_without_reading_it(tmp_path):
  fifo = tmp_path / "trace.json"
  os.mkfifo(fifo)
  for argv in (["simulate", str(fifo)], ["bench", "--compare", str(fifo), str(fifo)]):
    proc = tunix_stage(*argv, timeout=60)  # reading it would block for ever
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "is invalid: not a regular file" in proc.stderr


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_every_example_the_help_points_at_simulates(example):
  proc = tunix_stage("simulate", str(example.relative_to(ROOT)), "--json", "-")
  assert proc.returncode == 0, proc.stderr
  report = json.loads(proc.stdout)
  assert report["steps"] >= 2 and report["what_if"] == {}


def _trace(path: Path, steps: int, microbatches: int, seconds: float) -> Path:
  """A trace whose times add up to `seconds`."""
  each = seconds / (steps * microbatches * 3)
  mb = {"wire_s": each, "h2d_s": each, "compute_s": each}
  path.write_text(json.dumps({"steps": [{"microbatches": [mb] * microbatches}] * steps}))
  return path


def test_a_trace_at_the_bound_of_recorded_time_simulates_every_mode(tmp_path):
  """The virtual clock spins past 2**24 s: a trace at MAX_TOTAL_S (with a host bound that makes
  stages wait and be refused) still ends, in the time its few micro-batches take."""
  path = _trace(tmp_path / "t.json", 2, 3, trace_lib.MAX_TOTAL_S)
  proc = tunix_stage("simulate", str(path), "--modes", "inline,depth1,depth3_prestage,resident",
                     "--json", "-", timeout=120)
  assert proc.returncode == 0, proc.stderr
  totals = {m: r["total_s"] for m, r in json.loads(proc.stdout)["modes"].items()}
  assert totals["inline"] == pytest.approx(trace_lib.MAX_TOTAL_S)


@pytest.mark.parametrize("argv, message", [
    (["--what_if", "wire=1000x"], "--what_if='wire=1000x' is invalid: the scaled times add up to"),
    (["--what_if", "wire=1e9x"], "--what_if='wire=1e9x' is invalid; accepted: RESOURCE=F"),
], ids=["past-the-clock", "past-the-factor"])
def test_what_if_past_the_bounds_is_refused_at_once(tmp_path, argv, message):
  path = _trace(tmp_path / "t.json", 2, 3, trace_lib.MAX_TOTAL_S / 100)
  proc = tunix_stage("simulate", str(path), *argv, timeout=60)
  assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
  assert message in proc.stderr


def test_a_huge_time_in_a_trace_is_refused_at_once(tmp_path):
  path = tmp_path / "t.csv"
  path.write_text("step,microbatch,wire_s,h2d_s,compute_s\n0,0,1e12,0,1\n1,0,0.5,0,1\n")
  proc = tunix_stage("simulate", str(path), timeout=60)
  assert proc.returncode == 2, proc.stderr
  assert proc.stderr == (f"tunix-stage simulate: error: {path} line 2 wire_s='1e12' is invalid; "
                         f"accepted: {trace_lib.TIME_ACCEPTED}\n")
