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
  with pytest.raises(ValueError, match="^accepted: an integer >= 1 and <= 1000000$"):
    inputs.count(text)


def test_seed_is_32_bit_and_retries_may_be_zero():
  assert inputs.seed("0") == 0 and inputs.seed(str(2**32 - 1)) == 2**32 - 1
  for bad in ("-1", str(2**32)):
    with pytest.raises(ValueError, match=">= 0 and <= 4294967295"):
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


def test_memory_refusal_compares_with_mem_available():
  available = inputs.available_bytes()
  assert available is not None and available > 0
  assert inputs.memory_refusal(1 << 20, 4, "test") is None
  refusal = inputs.memory_refusal(available, 2, "test")
  assert refusal is not None and "(MemAvailable)" in refusal.why and "2 micro-batches" in refusal.why
  assert refusal.accepted.startswith(f"at most {available / 2 / (1 << 20):.0f} MiB per micro-batch")


def _refusal(check, path: str) -> str | None:
  try:
    check(path)
  except inputs.Refused as e:
    return e.why
  return None


def test_output_paths(tmp_path):
  a_file = tmp_path / "f"
  a_file.write_text("x")
  assert _refusal(inputs.output_dir, str(tmp_path / "new" / "deeper")) is None
  assert _refusal(inputs.output_file, str(tmp_path / "new" / "x.json")) is None
  assert _refusal(inputs.output_file, str(a_file)) is None  # overwritten
  assert not (tmp_path / "new").exists()  # checking creates nothing
  assert _refusal(inputs.output_file, str(tmp_path)) == "a directory"
  assert f"{a_file} is not a directory" in _refusal(inputs.output_dir, str(a_file / "sub"))
  assert "cannot create anything in /proc" in _refusal(inputs.output_dir, "/proc/x")
  assert "cannot create anything in /proc" in _refusal(inputs.output_file, "/proc/x/y.json")
  assert _refusal(inputs.output_file, "") == _refusal(inputs.output_dir, "") == "an empty path"
  assert sorted(os.listdir(tmp_path)) == ["f"]
