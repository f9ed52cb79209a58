"""The env-gated bootstrap (.pth), its post-import hook, and what the package ships.

Host modules here are fake packages written to tmp_path: they stand in for tunix's because tunix
cannot be installed in CI.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from tunix_stage_plugin.activation import bootstrap
from tunix_stage_plugin.activation import entry_points
from tunix_stage_plugin.activation import importhook
from tunix_stage_plugin.activation import manager

REPO = pathlib.Path(__file__).resolve().parents[1]
PTH_SOURCE = REPO / "tunix_stage_plugin" / "activation" / bootstrap.PTH_NAME
BOOTSTRAP_MODULE = "tunix_stage_plugin.activation.bootstrap"


def run_python(code, env_updates, *args):
  env = {k: v for k, v in os.environ.items() if k != "TUNIX_STAGE_BATCH"}
  env.update(env_updates)
  return subprocess.run([sys.executable, *args, "-c", code], env=env, capture_output=True,
                        text=True, timeout=60, check=True)


def test_shipped_pth_is_the_gated_line():
  assert PTH_SOURCE.read_text() == bootstrap.PTH_LINE + "\n"


@pytest.mark.parametrize("value, imported", [
    (None, False), ("off", False), ("", False), ("stage", True), (" stage ", True)])
def test_pth_line_imports_nothing_unless_stage(value, imported):
  # -S: no site processing, so only the line under test runs (not an installed copy of it).
  code = (f"exec(open({str(PTH_SOURCE)!r}).read()); import sys; "
          f"print({BOOTSTRAP_MODULE!r} in sys.modules, 'tunix_stage_plugin' in sys.modules)")
  env = {"PYTHONPATH": str(REPO)} | ({} if value is None else {"TUNIX_STAGE_BATCH": value})
  out = run_python(code, env, "-S").stdout.split()
  assert out == [str(imported), str(imported)]


def test_installed_package_ships_the_pth_into_site_packages():
  installed = bootstrap.installed_pth_files()
  assert installed, "tunix_stage_plugin.pth missing: install the package (pip install -e .)"
  assert all(pathlib.Path(p).read_text() == PTH_SOURCE.read_text() for p in installed)
  # And the interpreter really runs it: with the env var, the bootstrap is imported at start-up.
  code = f"import sys; print({BOOTSTRAP_MODULE!r} in sys.modules)"
  assert run_python(code, {"TUNIX_STAGE_BATCH": "stage"}).stdout.strip() == "True"
  assert run_python(code, {}).stdout.strip() == "False"


def test_build_puts_the_pth_at_the_root_of_the_wheel_tree(tmp_path):
  pytest.importorskip("setuptools", reason="setuptools is not installed in this environment")
  src = tmp_path / "src"
  src.mkdir()
  for name in ("setup.py", "setup.cfg", "pyproject.toml", "README.md"):
    (src / name).write_bytes((REPO / name).read_bytes())
  os.symlink(REPO / "tunix_stage_plugin", src / "tunix_stage_plugin")
  build_lib = tmp_path / "lib"
  subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(build_lib)],
                 cwd=src, check=True, capture_output=True, timeout=60)
  assert (build_lib / bootstrap.PTH_NAME).read_text() == bootstrap.PTH_LINE + "\n"


@pytest.fixture
def fake_host(tmp_path, monkeypatch):
  """A package `fakehost_<n>` whose `__init__` imports `outer`, which imports `watched`."""
  name = f"fakehost_{tmp_path.name[-8:].replace('-', '_')}"
  pkg = tmp_path / name
  pkg.mkdir()
  (pkg / "__init__.py").write_text(f"from {name} import outer\n")
  (pkg / "outer.py").write_text(f"from {name} import watched\nDONE = watched.VALUE + 1\n")
  (pkg / "watched.py").write_text("VALUE = 41\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  yield name
  for mod in [m for m in sys.modules if m.split(".")[0] == name]:
    del sys.modules[mod]


@pytest.fixture
def finder():
  f = importhook.PostImportFinder()
  yield f
  if f in sys.meta_path:
    sys.meta_path.remove(f)


def test_hook_fires_once_after_the_outermost_host_import(fake_host, finder):
  seen = []

  def callback():
    # The watched module finished first, but a callback that imports the host must only run
    # once every module of the package has finished executing.
    outer = sys.modules[f"{fake_host}.outer"]
    seen.append(outer.DONE)

  finder.add([f"{fake_host}.watched"], callback)
  assert sys.meta_path[0] is finder
  module = __import__(f"{fake_host}.watched", fromlist=["VALUE"])
  assert seen == [42]
  assert finder not in sys.meta_path  # every watch fired: the finder removed itself
  # Modules keep their real loader; the wrapper was for one import only.
  assert type(module.__loader__).__name__ != "_NotifyingLoader"
  assert module.__spec__.loader is module.__loader__
  __import__(f"{fake_host}.outer")
  assert seen == [42]


def test_hook_fires_at_once_when_already_imported(fake_host, finder):
  __import__(fake_host)
  seen = []
  finder.add([f"{fake_host}.watched"], lambda: seen.append(True))
  assert seen == [True] and finder not in sys.meta_path


def test_hook_failure_is_one_line_and_never_breaks_the_import(fake_host, finder, capsys):
  finder.add([f"{fake_host}.watched"], lambda: 1 / 0)
  assert __import__(fake_host).outer.DONE == 42
  assert capsys.readouterr().err.strip() == (
      "tunix-stage: post-import hook failed: ZeroDivisionError: division by zero")


def test_unwatched_imports_pass_through(finder):
  finder.add(["never_imported_pkg.mod"], lambda: None)
  assert finder.find_spec("json", None) is None


def test_bootstrap_start_installs_each_host_when_it_is_imported(fake_host, monkeypatch):
  calls = []

  class Adapter:
    trigger_modules = (f"{fake_host}.watched",)

  monkeypatch.setenv("TUNIX_STAGE_BATCH", "stage")
  monkeypatch.setattr(bootstrap, "_started", False)
  monkeypatch.setattr(entry_points, "load_adapters", lambda: {"fakehost": Adapter()})
  monkeypatch.setattr(manager, "install", lambda **kw: calls.append(kw))
  bootstrap.start()
  bootstrap.start()  # idempotent: one set of watches
  assert calls == []
  __import__(fake_host)
  assert calls == [{"host": "fakehost"}]


def test_bootstrap_reports_a_bad_setting_once_and_watches_nothing(monkeypatch, capsys):
  monkeypatch.setenv("TUNIX_STAGE_BATCH", "stage")
  monkeypatch.setenv("TUNIX_STAGE_MAX_DEVICE_BATCHES", "two")
  monkeypatch.setattr(bootstrap, "_started", False)
  monkeypatch.setattr(entry_points, "load_adapters", lambda: pytest.fail("must not load hosts"))
  bootstrap.start()
  assert capsys.readouterr().err.strip() == (
      "tunix-stage: invalid staging configuration, nothing installed: "
      "TUNIX_STAGE_MAX_DEVICE_BATCHES='two' is invalid; accepted: an integer >= 1")


def test_bootstrap_never_raises(monkeypatch, capsys):
  monkeypatch.setenv("TUNIX_STAGE_BATCH", "stage")
  monkeypatch.setattr(bootstrap, "_started", False)

  def broken():
    raise OSError("metadata unreadable")

  monkeypatch.setattr(entry_points, "load_adapters", broken)
  bootstrap.start()
  assert capsys.readouterr().err.strip() == (
      "tunix-stage: bootstrap failed, nothing installed: OSError: metadata unreadable")


def test_real_tunix_adapter_is_registered_and_cheap_to_load():
  # Loading the adapter must not import tunix (the bootstrap loads it at interpreter start).
  code = textwrap.dedent("""
      import sys
      from tunix_stage_plugin.activation import entry_points
      adapters = entry_points.load_adapters()
      print(sorted(adapters), any(m.split('.')[0] == 'tunix' for m in sys.modules))
  """)
  assert run_python(code, {}).stdout.split() == ["['tunix']", "False"]


def test_native_tunix_plugin_entry_point_is_declared():
  # Read by tunix itself once patches/tunix-plugins-entry-point.patch is merged.
  import importlib.metadata  # pylint: disable=import-outside-toplevel
  values = [ep.value for ep in importlib.metadata.entry_points(group="tunix.plugins")]
  assert values == ["tunix_stage_plugin.activation.native:activate"]
