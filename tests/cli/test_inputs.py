"""Checking inputs before work starts (cli.inputs) and orchestrator_main's flags and memory."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from tunix_stage_plugin.cli import inputs
from tunix_stage_plugin.embedded import process as process_lib

ORCH = [sys.executable, "-m", "tunix_stage_plugin.embedded.orchestrator_main"]
STAGING_ENV = ("TUNIX_STAGE_BATCH", "TUNIX_MAX_STAGED_BATCHES", "TUNIX_STAGE_MAX_DEVICE_BATCHES")


@pytest.mark.parametrize("text, value", [("1", 1), ("007", 7), (" 12 ", 12), ("1000000", 10**6)])
def test_count_takes_plain_decimal(text, value):
  assert inputs.count(text) == value


@pytest.mark.parametrize("text", [
    "0", "-1", "+2", "2_0", "0x10", "1e3", "1.0", "", " ", "٢", "1000001",
    "99999999999999999999999", "9" * 5000])
def test_count_refuses_anything_else_naming_the_range(text):
  with pytest.raises(ValueError, match="^accepted: an integer from 1 to 1000000$"):
    inputs.count(text)


def test_seed_is_32_bit_and_retries_may_be_zero():
  assert inputs.seed("0") == 0 and inputs.seed(str(2**32 - 1)) == 2**32 - 1
  for bad in ("-1", str(2**32)):
    with pytest.raises(ValueError, match="from 0 to 4294967295"):
      inputs.seed(bad)


@pytest.mark.parametrize("text, value", [("0.8", 0.8), ("2e-3", 0.002), (".5", 0.5), ("3", 3.0)])
def test_positive_numbers(text, value):
  assert inputs.positive(text) == value


@pytest.mark.parametrize("text", ["0", "-1", "nan", "inf", "-inf", "1e400", "1_0", "٢", "", "0x1"])
def test_positive_refuses_zero_negative_and_non_finite(text):
  with pytest.raises(ValueError, match="accepted: a number > 0"):
    inputs.positive(text)


def test_payload_bounds():
  assert inputs.payload_mib(str(1 / 1024)) == 1 / 1024
  assert inputs.payload_mib("65536") == 65536
  for bad in ("1e-30", "0.0009", "65537", "0"):
    with pytest.raises(ValueError, match=r"from 1/1024 \(1 KiB\) to 65536 \(64 GiB\)"):
      inputs.payload_mib(bad)


def test_memory_problem_compares_with_mem_available():
  available = inputs.available_bytes()
  assert available is not None and available > 0
  assert inputs.memory_problem(1 << 20, 4, "test") is None
  problem = inputs.memory_problem(available, 2, "test")
  assert problem is not None and "(MemAvailable)" in problem and "2 micro-batches" in problem


def test_output_paths(tmp_path):
  a_file = tmp_path / "f"
  a_file.write_text("x")
  assert inputs.output_dir_problem(str(tmp_path / "new" / "deeper")) is None
  assert inputs.output_file_problem(str(tmp_path / "new" / "x.json")) is None
  assert inputs.output_file_problem(str(a_file)) is None  # overwritten
  assert not (tmp_path / "new").exists()  # checking creates nothing
  assert "is a directory" in inputs.output_file_problem(str(tmp_path))
  assert f"{a_file} is not a directory" in inputs.output_dir_problem(str(a_file / "sub"))
  assert "cannot create anything in /proc" in inputs.output_dir_problem("/proc/x")
  assert "cannot create anything in /proc" in inputs.output_file_problem("/proc/x/y.json")
  assert sorted(os.listdir(tmp_path)) == ["f"]


def _env(**values: str) -> dict[str, str]:
  env = {k: v for k, v in os.environ.items() if k not in STAGING_ENV}
  env.update(values)
  return env


def test_orchestrator_main_reports_every_bad_flag_before_connecting():
  with socket.socket() as listener:  # a "trainer" that records whether anyone connected
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    result = subprocess.run(
        [*ORCH, "--trainer", address, "--steps", "99999999999999999999999", "--microbatches",
         "0", "--payload_mib", "1e-30", "--seed", "-1", "--sync_s", "-1", "--wire_mbps", "inf",
         "--h2d_mbps", "0", "--connect_timeout_s", "x", "--max_staged_batches", "0"],
        env=_env(TUNIX_STAGE_BATCH="maybe"), capture_output=True, text=True, timeout=60)
    with pytest.raises(BlockingIOError):
      listener.accept()
  assert result.returncode == 2, result.stderr
  expected = [
      "--steps '99999999999999999999999': accepted: an integer from 1 to 1000000",
      "--microbatches '0': accepted: an integer from 1 to 1000000",
      "--payload_mib '1e-30': accepted: a size in MiB from 1/1024 (1 KiB)",
      "--wire_mbps 'inf': accepted: a number > 0",
      "--h2d_mbps '0': accepted: a number > 0",
      "--sync_s '-1': accepted: a number >= 0",
      "--seed '-1': accepted: an integer from 0 to 4294967295",
      "--connect_timeout_s 'x': accepted: a number > 0",
      "TUNIX_STAGE_BATCH='maybe' is invalid; accepted: off | stage",
      "--max_staged_batches='0' is invalid; accepted: an integer >= 1",
  ]
  lines = result.stderr.strip().splitlines()
  assert len(lines) == len(expected), result.stderr
  for line, want in zip(lines, expected):
    assert line.startswith(f"orchestrator_main: error: {want}"), (line, want)


def test_orchestrator_main_refuses_a_payload_that_cannot_fit():
  result = subprocess.run([*ORCH, "--trainer", "127.0.0.1:9", "--payload_mib", "65536",
                           "--microbatches", "1000"], env=_env(), capture_output=True, text=True,
                          timeout=60)
  assert result.returncode == 2
  assert "2000 micro-batches of 65536 MiB held at once (a step's and the next step's)" in (
      result.stderr)
  assert "(MemAvailable); accepted: a smaller payload" in result.stderr


def _peak_rss_mib(address: str, steps: int, tmp_path) -> float:
  """Runs orchestrator_main to the end; its peak RSS from wait4 (the kernel's VmHWM)."""
  log = tmp_path / f"steps{steps}.log"
  with open(log, "w", encoding="utf-8") as out:
    proc = subprocess.Popen(
        [*ORCH, "--trainer", address, "--tiny", "--payload_mib", "8", "--steps", str(steps),
         "--microbatches", "4", "--stage_train_batches", "stage"], env=_env(), stdout=out,
        stderr=subprocess.STDOUT)
  try:
    _, status, usage = os.wait4(proc.pid, 0)
  finally:
    proc.returncode = -1  # reaped above: Popen must not wait for it again
  assert os.waitstatus_to_exitcode(status) == 0, log.read_text()
  assert f"OK: {steps} steps x 4 micro-batches" in log.read_text()
  return usage.ru_maxrss / 1024  # KiB on Linux


def test_orchestrator_main_memory_does_not_grow_with_steps(tmp_path):
  with process_lib.TrainerProcess() as trainer:
    few = _peak_rss_mib(trainer.address, 2, tmp_path)
    many = _peak_rss_mib(trainer.address, 12, tmp_path)
  # Built up front, 10 more steps of 4 x 8 MiB would add 320 MiB.
  assert many < few + 48, (few, many)
