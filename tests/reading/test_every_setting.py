"""Every record a job writes, at any settings, is read back by `tunix-stage report` and
`tunix-stage simulate`: each kind of value a depth or bound may have (its default, now auto; a
fixed value or auto, from the environment or a flag), a trainer's and an orchestrator's record
each, on every host that writes them (tunix's, the embedded one, MaxText's trainer). The records
are real: written by the telemetry core a job runs (core/telemetry), the sized settings chosen by
the sizers a job runs (core/sizing: the orchestrator's AutoDepth, the trainer's HostBound as its
step sink), each step built of the spans a trainer records.
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from tests.core.test_telemetry import compute
from tunix_stage_plugin.cli import main as cli_main
from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.core import contract
from tunix_stage_plugin.core import host_bound as host_bound_lib
from tunix_stage_plugin.core import sizing
from tunix_stage_plugin.core import tracks
from tunix_stage_plugin.core.pipeline import StepReport
from tunix_stage_plugin.core.telemetry import process
from tunix_stage_plugin.core.telemetry import record as record_lib

MIB = 1 << 20
STEPS = 4
SIZED = ("max_staged_batches", "max_host_batches")
# How a depth and a bound get their values: (the environment, the flags), each by field.
KINDS = {
    "default": ({}, {}),
    "fixed from env": ({"TUNIX_MAX_STAGED_BATCHES": "3", "TUNIX_STAGE_MAX_HOST_BATCHES": "2"}, {}),
    "fixed from flags": ({}, {"max_staged_batches": 3, "max_host_batches": 2}),
    "auto from env": ({"TUNIX_MAX_STAGED_BATCHES": "auto",
                       "TUNIX_STAGE_MAX_HOST_BATCHES": "auto"}, {}),
    "auto from flags": ({"TUNIX_MAX_STAGED_BATCHES": "1", "TUNIX_STAGE_MAX_HOST_BATCHES": "1"},
                        {"max_staged_batches": "auto", "max_host_batches": "auto"}),
    # Each sized apart from the other: one at auto, the other fixed.
    "auto depth, fixed host bound": ({"TUNIX_MAX_STAGED_BATCHES": "auto",
                                      "TUNIX_STAGE_MAX_HOST_BATCHES": "2"}, {}),
    "fixed depth, auto host bound": ({}, {"max_staged_batches": 3, "max_host_batches": "auto"}),
}
# Per kind, whether the depth and the host bound are sized (auto: each one's default).
AUTO = {"default": (True, True), "fixed from env": (False, False),
        "fixed from flags": (False, False), "auto from env": (True, True),
        "auto from flags": (True, True), "auto depth, fixed host bound": (True, False),
        "fixed depth, auto host bound": (False, True)}
# The hosts that write records: (the orchestrator's, the trainer's own kind).
HOSTS = {"tunix": ("tunix", "tunix"), "embedded": ("embedded", "embedded"),
         "maxtext": ("tunix", "maxtext")}


def config_of(kind):
  env, flags = KINDS[kind]
  return config_lib.resolve({"mode": "stage", **flags}, env={"TUNIX_STAGE_BATCH": "stage", **env},
                            explicit_source="flag")


def telemetry(folder, cfg, host):
  """A process's telemetry as a job's installation makes it of its settings, writing to
  `folder`, no line."""
  settings = process.Settings.of(host, cfg)
  return process.Telemetry(process.Settings(host, str(folder), 0, settings.shaping))


def write_trainer(folder, cfg, host):
  """A trainer process's records as a job's telemetry writes them: at auto its host bound sized
  by the HostBound a job runs (a step sink), as the installation wires it."""
  tel = telemetry(folder, cfg, "tunix")
  tel.trainer(lambda: (1, 1), host=host)
  if config_lib.is_auto(cfg.max_host_batches):
    def apply(bound, reason):
      tel.sized(record_lib.TRAINER, "max_host_batches", bound, reason)
    bound = host_bound_lib.HostBound(budget_bytes=cfg.memory_budget, device_bound=cfg.max_device_batches,
                             apply=apply)
    tel.add_step_sink(bound, record_lib.TRAINER)
    tel.sized(record_lib.TRAINER, "max_host_batches", bound.bound, bound.reason)
  t = 0.0
  for _ in range(STEPS):
    for _ in range(2):
      for span in (
          (tracks.TRAINER_RECEIVE, "stage_batch", t, t + 0.4, {"bytes": 16 * MIB,
                                                                "transport": "side"}),
          (tracks.TRAINER_H2D, "m", t + 0.4, t + 0.5, {"bytes": 16 * MIB, "lane": "staging"})):
        tel.recorder.add(*span[:4], **span[4])
      fwd = compute("fwd_bwd", t + 0.6, t + 1.6)
      tel.recorder.add(fwd.track, fwd.name, fwd.start, fwd.end, **dict(fwd.args))
      t += 1.6
    update = compute("update", t, t + 0.2)
    tel.recorder.add(update.track, update.name, update.start, update.end, **dict(update.args))
    t += 0.2
  tel.close()


def write_orchestrator(folder, cfg, host):
  """An orchestrator process's records as a job writes them: at auto each step's depth chosen
  by the AutoDepth a job runs (its trainer answered a stage UNSUPPORTED, so no step numbers
  come: the default, said)."""
  tel = telemetry(folder, cfg, host)
  tel.orchestrator()
  auto = (sizing.AutoDepth(cfg.memory_budget, tel)
          if config_lib.is_auto(cfg.max_staged_batches) else None)
  if auto is not None:
    auto.answered(contract.unsupported("k", "a test's trainer"))
  for step in range(STEPS):
    depth = cfg.max_staged_batches if auto is None else auto.depth_for(step, 2)
    report = StepReport(step, trained=2, staged=2, peak_staged=depth)
    if auto is not None:
      depth = auto.step_ended(report)
    tel.orchestrator_step(report, depth)
  if auto is not None:
    auto.close()
  tel.close()


def run_cli(*argv):
  out = io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()) as err:
    code = cli_main.main(list(argv))
  assert code == 0, err.getvalue()
  return out.getvalue()


@pytest.mark.parametrize("host", HOSTS)
@pytest.mark.parametrize("kind", KINDS)
def test_report_and_simulate_read_the_records_of_a_job_at_any_settings(tmp_path, kind, host):
  cfg = config_of(kind)
  orchestrator_host, trainer_host = HOSTS[host]
  write_trainer(tmp_path, cfg, trainer_host)
  write_orchestrator(tmp_path, cfg, orchestrator_host)
  records = {}
  for path in sorted(tmp_path.iterdir()):
    lines = path.read_text().splitlines()
    records[json.loads(lines[0])["role"]] = [json.loads(line) for line in lines]
  assert {role: len(r) for role, r in records.items()} == {"trainer": STEPS,
                                                           "orchestrator": STEPS}
  sized = {f: config_lib.is_auto(getattr(cfg, f)) for f in SIZED}
  assert tuple(sized.values()) == AUTO[kind], kind
  # Each record carries its own role's settings: the value in force, and where its role's own
  # setting is sized (the orchestrator's depth, the trainer's host bound), why.
  for role, field in record_lib.SIZED.items():
    for rec in records[role]:
      assert set(rec["settings"]) == {s.field for s in record_lib.CARRIED if role in s.roles}
      assert isinstance(rec["settings"][field], int)
      assert ("sizing" in rec) == sized[field], (role, rec.get("sizing"))
  out = run_cli("report", str(tmp_path))
  (label,) = [line for line in out.splitlines() if line.startswith("run:")]
  want = ["auto" if sized[f] else str(getattr(cfg, f)) for f in SIZED]
  assert [f"{f}={v}" in label for f, v in zip(SIZED, want)] == [True, True], label
  # The sizing lines each process's table is followed by: its own setting's, where it is auto.
  for role, field in record_lib.SIZED.items():
    said = "depth" if role == record_lib.ORCHESTRATOR else "host bound"
    lines = [line for line in out.splitlines() if line.startswith(f"  step 0: {said} ")]
    assert len(lines) == int(sized[field]), (role, lines)
  assert f"({trainer_host}, {STEPS} steps)" in out
  out = run_cli("simulate", str(tmp_path), "--modes", "depth2_prestage,auto")
  assert out.splitlines()[-1].startswith("auto ")
