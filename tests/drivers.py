"""A driver of the shape of tunix's DeepSWE driver, written by the tests into a temporary directory.

Not tunix's file: tunix/experimental/examples/deepswe_dist/run_deepswe_dist.py is not in the
tunix commit this project installs (main c7d8950), and it is never copied into this project. What
the plugin relies on is its shape, read from newer tunix main: `main(argv, context)` parses with a
plain argparse `_parse_args(argv)` that returns `parser.parse_args(argv)` and defines no staging
flag, and the module imports tunix's experimental modules at its top (so the post-import hook
that installs the staging hooks fires before it parses). The stand-in keeps that shape and some of
its flags (the ones the launch recipes pass among them); its main prints what it parsed, as one
`DRIVER {json}` line, instead of running a job.

Where it goes: without tunix (the plain suite) under the real module name as namespace packages
on PYTHONPATH (`write_plain`); with tunix installed, a `sitecustomize` on PYTHONPATH maps just the
`...examples.deepswe_dist` package onto the written directory, since tunix's own
`tunix.experimental.examples` cannot take another directory on PYTHONPATH (`write_for_tunix`).
"""

from __future__ import annotations

import json
from pathlib import Path
import textwrap

PACKAGE = "tunix.experimental.examples.deepswe_dist"
MODULE = f"{PACKAGE}.run_deepswe_dist"
MAIN = f"{MODULE}.main"

_SOURCE = '''
"""A stand-in with the shape of tunix's DeepSWE driver (tests/drivers.py says why)."""

import argparse
import json
import sys
{tunix_imports}


def _parse_args(argv):
  parser = argparse.ArgumentParser(description="DeepSWE-shaped distributed GRPO demo.")
  parser.add_argument("--batch_size", type=int, default=1)
  parser.add_argument("--num_generations", type=int, default=2)
  parser.add_argument("--rollout_replicas", type=int, default=1)
  parser.add_argument("--max_steps", type=int, default=1)
  parser.add_argument("--max_prompt_length", type=int, default=1024)
  parser.add_argument("--max_response_length", type=int, default=1024)
  parser.add_argument("--train_micro_batch_size", type=int, default=1)
  parser.add_argument("--model_id", type=str, default="Qwen/Qwen3-1.7B")
  parser.add_argument("--tokenizer_path", type=str, default="")
  parser.add_argument("--use_rollout_logps", action=argparse.BooleanOptionalAction,
                      default=True)
  parser.add_argument("--offpolicy", "--max_staleness", dest="max_staleness", type=int,
                      default=0)
  parser.add_argument("--trajectory_store_root_dir", "--trajectory_store_root",
                      dest="trajectory_store_root_dir", type=str, default="")
  parser.add_argument("--learning_rate", type=float, default=1.0e-6)
  parser.add_argument("--stop_workers_on_exit", action="store_true")
  return parser.parse_args(argv)


def main(argv, context=None):
  args = _parse_args(argv)
  report = {{"args": vars(args), "parse_wrapped": hasattr(_parse_args, "__wrapped__"),
             "plugin_loaded": "tunix_stage_plugin" in sys.modules}}
  {tunix_report}
  print("DRIVER " + json.dumps(report, sort_keys=True), flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
'''

_TUNIX_IMPORTS = '''
from tunix.experimental.common import datatypes  # as tunix's driver: the hooks install here
from tunix.experimental.orchestrator import rl_program
from tunix.experimental.worker import remote_execution
'''

# With tunix: the upstream change's seams, as a user's program sees them.
_TUNIX_REPORT = ('report["seams"] = [hasattr(rl_program.StandardRLProgram, name) for name in '
                 '("_stage_ahead_while_pending", "_prestage_across_boundary")]')

_SITECUSTOMIZE = '''
"""Test shim: makes {package} (a stand-in, tests/drivers.py) importable inside tunix's own
namespace package; the import system does the rest (the plugin's post-import hook included)."""

import importlib.machinery
import importlib.util
import sys


class _StandIn:

  def find_spec(self, fullname, path, target=None):
    if fullname != {package!r}:
      return None
    return importlib.util.spec_from_file_location(
        fullname, {init!r}, submodule_search_locations=[{directory!r}])


sys.meta_path.append(_StandIn())  # after every other finder, the plugin's included
'''

# A trainer or rollout main for tunix's runtime that does nothing until it is stopped (the local
# launcher's job is the orchestrator's; the others must outlive it).
IDLE = '''
import threading


def main(argv, context=None):
  print("idle", argv, flush=True)
  threading.Event().wait()
'''


# One process as tunix's runtime main runs it (`python -m tunix.experimental.distributed.runtime.
# main ...`), with tunix's own `prepare_process` (its flag split and --process_main import), but no
# process executor: tunix's executors and contexts import the discovery service's generated
# protobuf module (discovery_service_pb2), which the c7d8950 checkout does not have (it is built
# from discovery_service.proto at packaging time; grpcio-tools is not installed to build it), so
# tunix's runtime cannot start a process in this environment. The context is None: the stand-in
# mains register with no discovery service.
RUNTIME = '''
"""tunix's runtime main for one process, without its executor (tests/drivers.py says why)."""
import sys

from tunix.experimental.distributed.runtime import main as runtime

prepared = runtime.prepare_process(sys.argv[1:])
prepared.main_fn(prepared.argv, None)
'''


def source(*, tunix: bool) -> str:
  return _SOURCE.format(tunix_imports=_TUNIX_IMPORTS if tunix else "",
                        tunix_report=_TUNIX_REPORT if tunix else "")


def write_plain(root: Path) -> Path:
  """Writes the stand-in under its real name (namespace packages); returns the PYTHONPATH entry."""
  path = root.joinpath(*MODULE.split(".")).with_suffix(".py")
  path.parent.mkdir(parents=True)
  path.write_text(source(tunix=False))
  return root


def write_for_tunix(root: Path) -> Path:
  """Writes the stand-in (importing tunix) and the sitecustomize shim that puts it under its real
  name next to an installed tunix; returns the PYTHONPATH entry (the shim's directory)."""
  package = root / "deepswe_dist"
  package.mkdir(parents=True)
  (package / "__init__.py").write_text("")
  (package / "run_deepswe_dist.py").write_text(source(tunix=True))
  shim = root / "shim"
  shim.mkdir()
  (shim / "sitecustomize.py").write_text(_SITECUSTOMIZE.format(
      package=PACKAGE, init=str(package / "__init__.py"), directory=str(package)))
  return shim


def write_module(root: Path, name: str, text: str) -> Path:
  """Writes a top-level module `name` (e.g. a copy of the stand-in under a name the plugin does
  not know, or IDLE); returns the PYTHONPATH entry."""
  root.mkdir(parents=True, exist_ok=True)
  (root / f"{name}.py").write_text(textwrap.dedent(text))
  return root


def report(output: str) -> dict:
  """The stand-in's one report line from a process's output."""
  (line,) = [l for l in output.splitlines() if l.startswith("DRIVER ")]
  return json.loads(line.removeprefix("DRIVER "))
