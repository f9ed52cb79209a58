"""Where a relative TUNIX_STAGE_METRICS folder goes (docs/configuration.md "The settings"): taken as
given, resolved against the process's working directory when it writes its first record."""

from __future__ import annotations

from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.core.pipeline import StepReport
from tunix_stage_plugin.core.telemetry import process


def test_a_relative_metrics_folder_is_the_working_directory_s_at_the_first_record(
    tmp_path, monkeypatch):
  (tmp_path / "started").mkdir()
  (tmp_path / "later").mkdir()
  monkeypatch.chdir(tmp_path / "started")
  cfg = config_lib.resolve(env={"TUNIX_STAGE_BATCH": "stage", "TUNIX_STAGE_METRICS": "m",
                                "TUNIX_STAGE_LOG_EVERY": "0"})
  assert cfg.metrics == "m"  # as given: no folder is resolved when the settings are read
  tel = process.Telemetry(process.Settings.of("test", cfg))
  monkeypatch.chdir(tmp_path / "later")
  tel.orchestrator_step(StepReport(0, trained=1, inline=1), depth=2)
  tel.close()
  assert [p.parent for p in tmp_path.rglob("*.jsonl")] == [tmp_path / "later" / "m"]
