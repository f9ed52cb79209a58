"""Checking inputs before work starts (core.inputs); orchestrator_main's use is in test_mains.py."""

from __future__ import annotations

import os

import pytest

from tunix_stage_plugin.lab import inputs


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
  assert f"accepted: at most {available / 2 / (1 << 20):.0f} MiB per micro-batch" in problem


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
