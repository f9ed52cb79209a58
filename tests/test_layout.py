"""The package's layout: what a job loads apart from what only a reader of its records and the
lab load, and no import cycle.

The job's path is what a tunix job loads (activation, core, hosts, transport); the command line
(cli) names the reading layer's and the lab's subcommands without importing them; the reading
layer (tunix_stage_plugin.reading: `report`, the records' DataFrame) is what only a reader loads,
and the lab (tunix_stage_plugin.lab) what only the bench and the simulator load. Read statically
(every import statement, function-level ones included, so the tunix hook modules count although
tunix is absent here) and at run time in a fresh interpreter with the lab, the reading layer and
their libraries blocked: every job module imports, and the production commands run (`config
--check`, as the launch recipes run it, `doctor`, `run --help`, `tunix-stage --help`) without
loading them; `report --help` loads the reading layer and never the lab.
"""

from __future__ import annotations

import ast
import importlib.metadata
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

import tunix_stage_plugin

PACKAGE = pathlib.Path(tunix_stage_plugin.__file__).parent
LAB = "tunix_stage_plugin.lab"
READING = "tunix_stage_plugin.reading"
JOB = ("activation", "core", "hosts", "transport", "__init__.py", "__main__.py")
PRODUCTION = (*JOB, "cli")
LAB_LIBRARIES = ("optax", "looptime", "matplotlib")
READING_LIBRARIES = ("pandas", "pyarrow", "matplotlib")


def _modules() -> dict[str, pathlib.Path]:
  found = {}
  for path in PACKAGE.rglob("*.py"):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  return found


def _imports(path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
  """The package's modules `path` imports: `from pkg import mod` counts as mod, not pkg."""
  names = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      names.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      subs = [f"{node.module}.{a.name}" for a in node.names]
      names.update([n for n in subs if n in modules] or [node.module])
  return {n for n in names if n.startswith("tunix_stage_plugin")}


def _files(parts: tuple[str, ...] = PRODUCTION) -> list[pathlib.Path]:
  files = []
  for part in parts:
    path = PACKAGE / part
    files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
  return files



def _importing(files: list[pathlib.Path], *layers: str) -> dict[str, list[str]]:
  """Per file of `files`, the modules of `layers` it imports (statically), where any."""
  modules = _modules()
  found = {str(f.relative_to(PACKAGE)): sorted(
      n for n in _imports(f, modules) if any(n == x or n.startswith(x + ".") for x in layers))
           for f in files}
  return {f: names for f, names in found.items() if names}


def test_the_production_path_imports_nothing_from_the_lab_or_the_reading_layer():
  files = _files()
  assert len(files) > 30  # the folders above exist and hold the production modules
  assert _importing(files, LAB, READING) == {}


def test_the_reading_layer_imports_nothing_from_the_lab():
  files = _files(("reading",))
  assert len(files) >= 6
  assert _importing(files, LAB) == {}


def test_no_import_cycle():
  modules = _modules()
  edges = {m: {n for n in _imports(p, modules) if n in modules and n != m}
           for m, p in modules.items()}

  def reaches(start: str, goal: str) -> bool:
    seen, todo = set(), list(edges[start])
    while todo:
      m = todo.pop()
      if m == goal:
        return True
      if m not in seen:
        seen.add(m)
        todo += edges[m]
    return False

  # A module importing its own package's __init__ is how Python loads it, not a cycle.
  cycles = sorted((a, b) for a in edges for b in edges[a]
                  if not a.startswith(b + ".") and reaches(b, a))
  assert cycles == []


def test_the_plugin_loads_and_refuses_with_the_lab_and_its_libraries_blocked():
  """The lab, the reading layer and their libraries blocked: every job module still loads."""
  blocked = (LAB, READING, *LAB_LIBRARIES, *READING_LIBRARIES)
  files = _files()
  production = sorted(m for m, p in _modules().items() if p in files)
  # Every production module is imported; the hook modules that need a host absent here (tunix,
  # MaxText, flax) stop at that host's import, and only there.
  code = textwrap.dedent(f"""
      import importlib, sys

      class Block:
        def find_spec(self, name, path=None, target=None):
          if any(name == b or name.startswith(b + ".") for b in {blocked!r}):
            raise ImportError(f"blocked: {{name}}")
          return None

      sys.meta_path.insert(0, Block())
      loaded = 0
      for name in {production!r}:
        try:
          importlib.import_module(name)
          loaded += 1
        except ModuleNotFoundError as e:
          if e.name.split(".")[0] not in ("tunix", "maxtext", "flax"):
            raise
      import tunix_stage_plugin
      print(tunix_stage_plugin.install(mode="stage").line)
      print(loaded, sorted(m for m in sys.modules if m.startswith(({LAB!r}, {READING!r}))))
  """)
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                        env={"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"})
  assert proc.returncode == 0, proc.stderr
  refusal, loaded = proc.stdout.splitlines()
  assert loaded.endswith(" []") and int(loaded.split()[0]) > 25, loaded
  # tunix is absent from the plain suite's environment: the one refusal line, from the real code.
  assert re.fullmatch(r"tunix-stage: tunix is not importable \(\w+Error: .+\)", refusal), refusal


def test_every_file_of_the_package_is_production_reading_or_lab():
  production = set(_files())
  lab = set((PACKAGE / "lab").rglob("*.py"))
  reading = set((PACKAGE / "reading").rglob("*.py"))
  assert production.isdisjoint(lab) and production.isdisjoint(reading)
  assert sorted(map(str, set(PACKAGE.rglob("*.py")) - production - lab - reading)) == []


# (argv, what its output starts with): the production commands, as a recipe or a user runs them;
# the lab and the reading layer, and their libraries, blocked.
PRODUCTION_COMMANDS = (
    (["config", "--check"], ""),
    (["doctor"], "tunix-stage-plugin "),
    (["run", "--help"], "usage: tunix-stage run"),
    (["--help"], "usage: tunix-stage "),
)
# `report`, the lab blocked (the reading layer, pandas and pyarrow loaded).
READING_COMMANDS = ((["report", "--help"], "usage: tunix-stage report"),)


@pytest.mark.parametrize("commands, blocked", [
    (PRODUCTION_COMMANDS, (LAB, READING, *LAB_LIBRARIES, *READING_LIBRARIES)),
    (READING_COMMANDS, (LAB, *LAB_LIBRARIES))], ids=["production", "report"])
def test_the_production_commands_never_import_the_lab(commands, blocked):
  code = textwrap.dedent(f"""
      import contextlib, io, sys

      class Block:
        def find_spec(self, name, path=None, target=None):
          if any(name == b or name.startswith(b + ".") for b in {blocked!r}):
            raise ImportError(f"blocked: {{name}}")
          return None

      sys.meta_path.insert(0, Block())
      from tunix_stage_plugin.cli import main
      for argv, start in {commands!r}:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
          try:
            code = main.main(argv)
          except SystemExit as e:
            code = e.code
        assert code in (0, 1), (argv, code)
        assert out.getvalue().startswith(start), (argv, out.getvalue()[:200])
        if argv == ["--help"]:
          assert "bench" in out.getvalue() and "simulate" in out.getvalue(), out.getvalue()
        lab = sorted(m for m in sys.modules if m == {LAB!r} or m.startswith({LAB!r} + "."))
        assert lab == [], (argv, lab)
      print("ok")
  """)
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                        env={"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"})
  assert proc.returncode == 0 and proc.stdout == "ok\n", proc.stderr[-3000:]


def test_installing_the_package_without_extras_pulls_no_lab_library():
  requires = importlib.metadata.requires("tunix-stage-plugin") or []
  runtime = {re.split(r"[<>=!~ ;\[]", r, maxsplit=1)[0].lower() for r in requires
             if "extra ==" not in r}
  assert runtime == {"numpy", "jax", "grpcio", "cloudpickle"}
  extra = lambda name: {re.split(r"[<>=!~ ;\[]", r, maxsplit=1)[0].lower() for r in requires  # noqa: E731
                        if re.search(f"""extra == ["']{name}["']""", r)}
  assert set(LAB_LIBRARIES) <= extra("bench")
  assert set(READING_LIBRARIES) == extra("report") <= extra("bench")


def test_tunix_s_host_is_at_most_twelve_modules_each_in_design_md_s_table():
  """hosts/tunix/ holds one module per idea, at most 12, and docs/design.md names each."""
  modules = sorted(p.name for p in (PACKAGE / "hosts" / "tunix").glob("*.py")
                   if p.name != "__init__.py")
  assert len(modules) + 1 <= 12, modules  # (with its __init__)
  design = (PACKAGE.parent / "docs" / "design.md").read_text(encoding="utf-8")
  assert [m for m in modules if f"| `{m}` |" not in design] == []
