"""The env-gated bootstrap (.pth), its post-import hook, and what the package ships.

Host modules here are fake packages written to tmp_path: they stand in for tunix's because tunix
cannot be installed in CI.
"""

from __future__ import annotations

import importlib.machinery
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from tunix_stage_plugin.activation import bootstrap
from tunix_stage_plugin.activation import entry_points
from tunix_stage_plugin.hosts import triggers
from tunix_stage_plugin.activation import importhook
from tunix_stage_plugin.activation import manager

REPO = pathlib.Path(__file__).resolve().parents[2]
PTH_SOURCE = REPO / "tunix_stage_plugin" / "activation" / bootstrap.PTH_NAME
BOOTSTRAP_MODULE = "tunix_stage_plugin.activation.bootstrap"


STAGE_ENV = ("TUNIX_STAGE_BATCH", "TUNIX_MAX_STAGED_BATCHES", "TUNIX_STAGE_MAX_DEVICE_BATCHES")


def run_python(code, env_updates, *args, check=True, argv=None):
  env = {k: v for k, v in os.environ.items() if k not in STAGE_ENV}
  env.update(env_updates)
  return subprocess.run([sys.executable, *args, *(argv or ["-c", code])], env=env,
                        capture_output=True, text=True, timeout=60, check=check)


def test_shipped_pth_is_the_gated_line():
  assert PTH_SOURCE.read_text() == bootstrap.PTH_LINE + "\n"


@pytest.mark.parametrize("value, imported", [
    (None, False), ("off", False), (" off ", False), ("", False), ("stage", True),
    (" stage ", True), ("on", True), ("OFF", True)])
def test_pth_line_imports_nothing_unless_set_and_not_off(value, imported):
  # Any value but empty/off starts the bootstrap, so a typo ("on") is caught, not ignored.
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


def test_bootstrap_start_activates_each_host_when_it_is_imported(fake_host, monkeypatch,
                                                                 capsys):
  calls = []
  monkeypatch.setenv("TUNIX_STAGE_BATCH", "on")  # invalid, and still nothing at start
  monkeypatch.setattr(bootstrap, "_started", False)
  monkeypatch.setattr(triggers, "HOST_TRIGGERS", {"fakehost": (f"{fake_host}.watched",)})
  monkeypatch.setattr(entry_points, "host_entry_points",
                      lambda: pytest.fail("no metadata at start"))
  monkeypatch.setattr(manager, "activate_from_env", calls.append)
  bootstrap.start()
  bootstrap.start()  # idempotent: one set of watches
  assert calls == [] and capsys.readouterr().err == ""
  __import__(fake_host)
  assert calls == ["fakehost"]


def test_bootstrap_never_raises(monkeypatch, capsys):
  monkeypatch.setenv("TUNIX_STAGE_BATCH", "stage")
  monkeypatch.setattr(bootstrap, "_started", False)

  def broken(modules, callback):
    raise OSError("meta path unwritable")

  monkeypatch.setattr(importhook, "when_imported", broken)
  bootstrap.start()
  assert capsys.readouterr().err.strip() == (
      "tunix-stage: bootstrap failed, nothing installed: OSError: meta path unwritable")


def test_host_triggers_match_the_registered_adapters():
  # The bootstrap watches the static table (no metadata at start-up); it must name the modules
  # each registered adapter's install is triggered by.
  adapters = {name: ep.load() for name, ep in entry_points.host_entry_points().items()}
  assert {name: tuple(a.trigger_modules) for name, a in adapters.items()} == (
      triggers.HOST_TRIGGERS)


def test_bootstrap_start_loads_no_metadata_and_no_manager():
  # With staging on, start-up imports the bootstrap, the trigger table (and its import-free
  # package) and the import hook only.
  code = "import sys; print(' '.join(sorted(sys.modules)))"
  off = set(run_python(code, {}).stdout.split())
  on = set(run_python(code, {"TUNIX_STAGE_BATCH": "stage"}).stdout.split())
  assert on - off == {"tunix_stage_plugin", "tunix_stage_plugin.activation",
                      "tunix_stage_plugin.activation.bootstrap",
                      "tunix_stage_plugin.hosts", "tunix_stage_plugin.hosts.triggers",
                      "tunix_stage_plugin.activation.importhook"}


@pytest.fixture
def fake_tunix(tmp_path):
  """A stand-in `tunix` package on disk with the watched modules and a runtime main module."""
  root = tmp_path / "fake_tunix"
  for module in triggers.HOST_TRIGGERS["tunix"] + (
      "tunix.experimental.distributed.runtime.main",):
    path = root.joinpath(*module.split("."))
    for parent in [path.parent, *path.parent.parents]:
      if parent == root:
        break
      parent.mkdir(parents=True, exist_ok=True)
      (parent / "__init__.py").touch()
    path.with_suffix(".py").write_text("")
  main = root / "tunix" / "experimental" / "distributed" / "runtime" / "main.py"
  main.write_text(textwrap.dedent(f"""
      import sys
      import {triggers.HOST_TRIGGERS["tunix"][0]}
      print("main ran as", __name__, sys.argv[1:])
  """))
  return root


@pytest.mark.parametrize("env, problem", [
    ({"TUNIX_STAGE_BATCH": "on"}, "TUNIX_STAGE_BATCH='on' is invalid; accepted: off | stage"),
    ({"TUNIX_STAGE_BATCH": "stage", "TUNIX_MAX_STAGED_BATCHES": "0"},
     "TUNIX_MAX_STAGED_BATCHES='0' is invalid; accepted: auto, or an integer >= 1 and <= 1024"),
])
def test_bad_setting_stops_a_host_process_with_one_line_and_exit_2(fake_tunix, env, problem):
  env = {**env, "PYTHONPATH": str(fake_tunix)}
  # A process that never imports the host is not the plugin's business: silent, exit 0.
  quiet = run_python("print('work')", env)
  assert (quiet.stdout, quiet.stderr) == ("work\n", "")
  # `python -m` of the host's runtime: stops when the host is imported, before main's own work.
  proc = run_python("", env, argv=["-m", "tunix.experimental.distributed.runtime.main", "--x"],
                    check=False)
  assert proc.returncode == 2
  assert proc.stderr == f"tunix-stage: error: invalid staging configuration: {problem}\n"
  assert proc.stdout == ""


def test_python_dash_m_of_a_watched_host_runs_and_activates(fake_tunix):
  # The watched package's loaders are wrapped; runpy needs get_code & co from the wrapper.
  proc = run_python("", {"TUNIX_STAGE_BATCH": "stage", "PYTHONPATH": str(fake_tunix)},
                    argv=["-m", "tunix.experimental.distributed.runtime.main", "--x"],
                    check=False)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout == "main ran as __main__ ['--x']\n"
  # The hook fired: install ran against the stand-in (whose classes are missing) and said, in
  # one line, that it installed nothing (the exact reason is the tunix adapter's).
  assert proc.stderr.startswith("tunix-stage: ") and len(proc.stderr.splitlines()) == 1
  assert "staging on" not in proc.stderr


@pytest.fixture
def fake_pkg(tmp_path):
  """A package with a module run by `python -m`, which imports a watched sibling."""
  name = f"dashm_{tmp_path.name[-8:].replace('-', '_')}"
  pkg = tmp_path / name
  pkg.mkdir()
  (pkg / "__init__.py").write_text("")
  (pkg / "watched.py").write_text("VALUE = 41\n")
  (pkg / "data.txt").write_text("resource\n")
  (pkg / "sub.py").write_text(textwrap.dedent(f"""
      import importlib.resources
      from {name} import watched
      print("sub ran", __name__, watched.VALUE + 1,
            importlib.resources.files({name!r}).joinpath("data.txt").read_text().strip())
  """))
  return name


def test_run_module_of_a_watched_package_runs_and_fires(fake_pkg, tmp_path):
  code = textwrap.dedent(f"""
      import runpy
      from tunix_stage_plugin.activation import importhook
      importhook.when_imported([{fake_pkg + ".watched"!r}], lambda: print("fired"))
      runpy.run_module({fake_pkg + ".sub"!r}, run_name="__main__", alter_sys=True)
  """)
  proc = run_python(code, {"PYTHONPATH": str(tmp_path)})
  assert proc.stdout.splitlines() == ["fired", "sub ran __main__ 42 resource"]
  assert proc.stderr == ""


def test_wrapped_loader_answers_as_the_real_loader(fake_pkg, tmp_path, monkeypatch):
  monkeypatch.syspath_prepend(str(tmp_path))
  f = importhook.PostImportFinder()
  f.add([f"{fake_pkg}.watched"], lambda: None)
  try:
    for module in (fake_pkg, f"{fake_pkg}.sub"):
      path = None if module == fake_pkg else [str(tmp_path / fake_pkg)]
      wrapped = f.find_spec(module, path).loader
      real = importlib.machinery.PathFinder.find_spec(module, path).loader
      assert type(wrapped).__name__ == "_NotifyingLoader" and type(real).__name__ != (
          "_NotifyingLoader")
      assert wrapped.get_code(module).co_filename == real.get_code(module).co_filename
      assert wrapped.get_source(module) == real.get_source(module)
      assert wrapped.is_package(module) == real.is_package(module) == (module == fake_pkg)
      assert wrapped.get_filename(module) == real.get_filename(module)
      reader = wrapped.get_resource_reader(module)
      assert type(reader) is type(real.get_resource_reader(module))
      assert wrapped.name == real.name and wrapped.path == real.path
      with pytest.raises(AttributeError):
        wrapped.no_such_loader_method  # pylint: disable=pointless-statement
  finally:
    sys.meta_path.remove(f)
    for mod in [m for m in sys.modules if m.split(".")[0] == fake_pkg]:
      del sys.modules[mod]


def test_real_adapters_are_registered_and_cheap_to_load():
  # Loading an adapter must not import its host (a host is imported only when installing).
  code = textwrap.dedent("""
      import sys
      from tunix_stage_plugin.activation import entry_points
      adapters = {name: ep.load() for name, ep in entry_points.host_entry_points().items()}
      print(','.join(sorted(adapters)),
            any(m.split('.')[0] in ('tunix', 'maxtext', 'jax') for m in sys.modules))
  """)
  assert run_python(code, {}).stdout.split() == ["maxtext,tunix", "False"]


def test_native_tunix_plugin_entry_point_is_declared():
  # Read by tunix itself once patches/tunix-plugins-entry-point.patch is merged.
  import importlib.metadata  # pylint: disable=import-outside-toplevel
  values = [ep.value for ep in importlib.metadata.entry_points(group="tunix.plugins")]
  assert values == ["tunix_stage_plugin.activation.native:activate"]
