"""`tunix-stage doctor`: can staging work here, and what would it do? What it reports and its exit
status (0 off or can work, 1 requested but cannot work, 2 an invalid setting): docs/tunix.md
"Doctor"; a misspelled staging variable is warned about on stderr and in the JSON.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
from typing import Any

from tunix_stage_plugin import __version__
from tunix_stage_plugin.activation import bootstrap
from tunix_stage_plugin.activation import entry_points
from tunix_stage_plugin.hosts import triggers
from tunix_stage_plugin.activation import manager
from tunix_stage_plugin.cli import config_cmd
from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.core import flags as flags_lib

HOST = "tunix"
ENGINES = ("maxtext",)  # optional engines behind tunix's TrainerWorker, reported next to tunix
# Which trainers the worker hook stages (hosts/placements.py, hosts/maxtext/), and the one case
# it refuses (with one line, to the orchestrator, which then stops offering).
TRAINERS = ("tunix PeftTrainer and its subclasses (a subclass's own _prepare_payload included: it "
            "runs once per micro-batch, on the staging thread), MaxText's training engine; "
            "refused with one line: a _prepare_payload set on the trainer instance, or one that "
            "is not a function defined in its class (nothing to hand a staged batch through)")
TUNIX_HINT = ("tunix's experimental distributed stack is on google/tunix main (c7d8950, "
              "2026-08-21, or newer), not in the registry's google-tunix releases: install a "
              "checkout of it (pip install -e TUNIX_CHECKOUT) into this environment")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
  parser = subparsers.add_parser(
      "doctor",
      help="check that staging can work with the installed tunix",
      description="Check tunix, its version/commit, the capability probes, the effective "
      "configuration and the installed hooks. Exits 1 when staging is requested (flag or "
      "TUNIX_STAGE_BATCH=stage) but cannot work, 2 when a setting is invalid, else 0.",
  )
  flags_lib.add_argparse_flags(parser)
  parser.add_argument("--json", action="store_true", help="print JSON for machines")
  parser.set_defaults(run=run)


def diagnose(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
  """Returns the report and the problems that stop staging from working (empty: it can)."""
  report: dict[str, Any] = {"plugin": __version__, "python": platform.python_version()}
  problems: list[str] = []
  cfg = flags_lib.config_from_argparse(args)  # ConfigError is the caller's exit 2
  report["config"] = {"enabled": cfg.enabled, "settings": cfg.as_dict()}
  report["bootstrap_pth"] = bootstrap.installed_pth_files()
  report["entry_points"] = sorted(entry_points.host_entry_points())
  from tunix_stage_plugin.core import codec as codec_lib  # pylint: disable=import-outside-toplevel
  report["codecs"] = [name for name in codec_lib.CODECS if codec_lib.installed(name)]
  report["codec_extra"] = codec_lib.extra_hint()
  if not report["bootstrap_pth"]:
    problems.append(f"{bootstrap.PTH_NAME} is not installed: TUNIX_STAGE_BATCH=stage cannot "
                    "activate on its own (reinstall the package, or call install())")
  report["drivers"] = [_driver(d) for d in triggers.KNOWN_DRIVERS]
  _host(report, problems, cfg)
  # MaxText is reported whether or not tunix is importable: a user setting up the trainer's image
  # needs both answers.
  report["engines"] = {name: _engine(name, problems, cfg) for name in ENGINES
                       if name in report["entry_points"]}
  return report, problems


def _host(report: dict[str, Any], problems: list[str], cfg: config_lib.StageConfig) -> None:
  """tunix: importable, its probes, the trainers it serves, the hooks installed here."""
  if HOST not in report["entry_points"]:
    problems.append(f"no {HOST!r} adapter in entry-point group {entry_points.ENTRY_POINT_GROUP!r}")
    return
  adapter = entry_points.load_adapter(HOST)
  try:
    adapter.load()
  except ImportError as e:
    report["host"] = None
    problems.append(f"tunix is not importable: {type(e).__name__}: {e}. {TUNIX_HINT}")
    return
  report["host"] = adapter.describe()
  # Which way the train loop is staged in this tunix: through its seam, or the plugin's copy.
  report["train_loop"] = adapter.describe_loop()
  if manager.is_installed(HOST):  # the bootstrap installed while load() imported tunix
    checks = [{"name": "host probes (passed at install)", "ok": True, "detail": "ok"}]
  else:
    checks = [vars(p) for p in adapter.probe(cfg)]
  report["probes"] = checks
  problems += [f"probe failed: {c['name']}: {c['detail']}" for c in checks if not c["ok"]]
  report["installed_hooks"] = manager.installed_hooks(HOST)
  report["hook_groups"] = list(adapter.hook_groups)
  report["trainers"] = TRAINERS


def _driver(driver: triggers.Driver) -> dict[str, Any]:
  """A known driver: how it takes the staging flags, and whether this environment has it."""
  try:
    present = importlib.util.find_spec(driver.module) is not None  # imports its parents only
  except ImportError:  # a parent package is missing
    present = False
  return {"module": driver.module, "about": driver.about,
          "how": ("its own flags" if driver.parse is None
                  else f"the plugin adds them to its {driver.parse} when staging is on"),
          "installed": present, "hooked_here": driver.module in manager.hooked_drivers()}


def _engine(name: str, problems: list[str], cfg: config_lib.StageConfig) -> dict[str, Any]:
  """An optional training engine behind tunix's TrainerWorker (MaxText): absent is fine; present,
  it must pass its probes."""
  adapter = entry_points.load_adapter(name)
  try:
    adapter.load()
  except ImportError as e:
    return {"host": None, "detail": f"not importable ({type(e).__name__}: {e}); optional"}
  if manager.is_installed(name):
    probes = [{"name": f"{name} probes (passed at install)", "ok": True, "detail": "ok"}]
  else:
    probes = [vars(p) for p in adapter.probe(cfg)]
  problems += [f"probe failed: {p['name']}: {p['detail']}" for p in probes if not p["ok"]]
  return {"host": adapter.describe(), "probes": probes,
          "installed_hooks": manager.installed_hooks(name)}


def run(args: argparse.Namespace) -> int:
  warnings = config_cmd.warn_unknown_variables("doctor")
  try:
    report, problems = diagnose(args)
  except config_lib.ConfigError as e:
    return config_cmd.print_config_error("doctor", e)
  report["warnings"] = warnings
  enabled = report["config"]["enabled"]
  status = 1 if enabled and problems else 0
  if args.json:
    print(json.dumps({**report, "problems": problems, "exit": status}, indent=2))
    return status
  print(f"tunix-stage-plugin {report['plugin']} (Python {report['python']})")
  print(f"staging: {'on' if enabled else 'off'}")
  for item in report["config"]["settings"].values():
    print(f"  {config_cmd.setting_row(item)}")
  print(f"bootstrap .pth: {', '.join(report['bootstrap_pth']) or 'missing'}")
  print(f"host adapters (entry points): {', '.join(report['entry_points']) or 'none'}")
  print("codecs (TUNIX_STAGE_CODEC; a trainer decodes what its orchestrator compresses): "
        + (", ".join(report["codecs"]) or f"none installed ({report['codec_extra']})"))
  if "host" in report:
    print(f"host: {report['host'] or 'tunix not importable'}")
  if report.get("train_loop"):
    print(f"  train loop: {report['train_loop']}")
  for check in report.get("probes", []):
    print(f"  [{'ok' if check['ok'] else 'FAIL'}] {check['name']}"
          + ("" if check["ok"] else f": {check['detail']}"))
  if "trainers" in report:
    print(f"trainers staged: {report['trainers']}")
  if "installed_hooks" in report:
    hooks = report["installed_hooks"]
    print(f"hooks installed in this process: {len(hooks) or 'none'}")
    for name in hooks:
      print(f"  {name}")
    if not hooks:
      print("hooks staging installs: " + "; ".join(report["hook_groups"]))
  for name, engine in report.get("engines", {}).items():
    print(f"engine {name}: {engine['host'] or engine['detail']}")
    for check in engine.get("probes", []):
      print(f"  [{'ok' if check['ok'] else 'FAIL'}] {check['name']}"
            + ("" if check["ok"] else f": {check['detail']}"))
  print("drivers that take the staging flags (the launch recipes pass them to no other; any "
        "other driver reads the staging settings from the environment only):")
  for driver in report["drivers"]:
    where = "in this environment" if driver["installed"] else "not in this environment"
    print(f"  {driver['module']}: {driver['about']}, {driver['how']} [{where}]")
  for problem in problems:
    print(f"{'error' if enabled else 'note'}: {problem}")
  if enabled and not problems:
    print("staging can work here")
  return status
