"""Every command README.md and docs/*.md show runs as written from a checkout.

A `$ ...` line in a console block is run for real (PATH leads with this interpreter's bin
directory, as after the README's set-up, cwd the repository root) and checked against what the
page shows under it: its exit status (the `echo $?` the page shows; else 0, or
not 0 where it shows an error), every shown line, and, where no `...` line elides some, every
printed line shown (numbers, paths and hex masked; `...` elides a line or part of one). Every `tunix-stage ...` command elsewhere (inline
code, bash blocks) must parse with the real command-line parser. The examples that need tunix's
stack are skipped when it is not importable (one-line reason); the bench's full run is parsed
only (the bench has its own tests). Every sample bench table the pages show has the columns the
bench's report prints today (bench/report.format_table), one cell per column in each row.
Links and the README's length: test_links.py.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
import re
import shlex
import subprocess
import sys

import pytest

from tunix_stage_plugin.lab.bench import modes as modes_lib
from tunix_stage_plugin.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TUNIX = importlib.util.find_spec("tunix") is not None
SHOWN_WITHOUT_TUNIX = ("--host tunix",)  # the page shows the error on a machine without it
SHOWN_WITH_TUNIX = ("tunix-stage doctor",)


def _console_examples() -> list[tuple[str, str, list[str], int | None]]:
  """(page:line, command, shown output lines, shown exit status or None) for each `$` line."""
  found = []
  for page in PAGES:
    lines = page.read_text().splitlines()
    in_console = False
    i = 0
    while i < len(lines):
      line = lines[i]
      if line.startswith("```"):
        in_console = (not in_console) and line.strip() == "```console"
        i += 1
        continue
      if in_console and line.startswith("$ ") and line != "$ echo $?":
        where = f"{page.name}:{i + 1}"
        command = line[2:]
        while command.endswith("\\"):
          i += 1
          command = command[:-1] + lines[i].strip()
        shown, status = [], None
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
          if lines[i] == "$ echo $?":
            status = int(lines[i + 1])
            i += 2
            continue
          if lines[i].startswith("$ "):
            break
          shown.append(lines[i])
          i += 1
        found.append((where, command, shown, status))
        continue
      i += 1
  return found


def _mask(line: str) -> str:
  line = re.sub(r"(?<![\w'])/[^\s']+", "PATH", line)
  line = re.sub(r"\b[0-9a-f]{7,}\b", "HEX", line)
  line = re.sub(r"\d+(\.\d+)?", "N", line)
  return " ".join(line.split())


EXAMPLES = _console_examples()


def _example_param(example: tuple[str, str, list[str], int | None]):
  """The examples that need tunix's stack are marked `tunix`: CI runs them in its tunix venv."""
  needs_tunix = any(n in example[1] for n in SHOWN_WITH_TUNIX)
  return pytest.param(*example, id=example[0], marks=[pytest.mark.tunix] if needs_tunix else [])


@pytest.mark.parametrize("where,command,shown,status", [_example_param(e) for e in EXAMPLES])
def test_console_example_runs_as_shown(where: str, command: str, shown: list[str],
                                       status: int | None,
                                       tmp_path: Path):
  if any(n in command for n in SHOWN_WITHOUT_TUNIX) and TUNIX:
    pytest.skip("this example shows a machine without tunix's stack; this one has it")
  if any(n in command for n in SHOWN_WITH_TUNIX) and not TUNIX:
    pytest.skip("tunix's experimental stack (google/tunix main) is not importable")
  env = {k: v for k, v in os.environ.items() if not k.startswith("TUNIX_")}
  env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
  env["PYTHONUNBUFFERED"] = "1"  # stdout and stderr in the order a terminal shows them
  proc = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True, timeout=240)
  if status is None:  # not shown: an example that prints an error fails, any other succeeds
    failed = any(": error:" in line for line in shown)
    status = proc.returncode if failed and proc.returncode != 0 else int(failed)
  assert proc.returncode == status, f"{where}: {command}\n{proc.stdout[-3000:]}"
  printed = [_mask(l) for l in proc.stdout.splitlines()]

  def printed_as_shown(line: str) -> bool:  # "..." inside a shown line elides part of it
    pattern = ".*".join(re.escape(part) for part in _mask(line).split("..."))
    return any(re.fullmatch(pattern, p) for p in printed)

  missing = [l for l in shown if l.strip() and l.strip() != "..." and not printed_as_shown(l)]
  assert missing == [], f"{where}: {command} did not print these lines as shown"
  order = _in_order([l for l in shown if l.strip()], [p for p in printed if p])
  assert order is None, f"{where}: {command}: {order}"


def _in_order(shown: list[str], printed: list[str]) -> str | None:
  """Why the shown lines are not the printed ones, in order, a `...` line standing for any run of
  printed lines (None: they are): a sample shows every line its command prints, or elides it."""
  patterns = [None if l.strip() == "..." else
              ".*".join(re.escape(part) for part in _mask(l).split("...")) for l in shown]
  reach = {0}  # the printed lines matched so far, for each way through the patterns
  for pattern in patterns:
    if pattern is None:
      reach = set(range(min(reach), len(printed) + 1)) if reach else reach
    else:
      reach = {j + 1 for j in reach if j < len(printed) and re.fullmatch(pattern, printed[j])}
  if len(printed) in reach:
    return None
  return ("printed lines the page does not show, or not in its order (a `...` line elides "
          "lines): printed " + repr(printed[:60]))


def _tunix_stage_commands() -> list[tuple[str, str]]:
  """(page:line, argv string) for every `tunix-stage ...` the pages show outside `$` examples."""
  found = []
  for page in PAGES:
    fence = None
    for n, line in enumerate(page.read_text().splitlines(), 1):
      if line.startswith("```"):
        fence = line[3:].strip() if fence is None else None
        continue
      if fence is None:  # prose: the inline code spans
        candidates = re.findall(r"`((?:[A-Z_]+=\S+ )*tunix-stage [^`]+)`", line)
      elif fence in ("bash", "sh") and re.match(r"([A-Z_]+=\S+ )*(\.venv/bin/)?tunix-stage ", line):
        candidates = [line.split("#")[0].strip()]
      else:  # console blocks run in the test above; text blocks are output
        continue
      for c in candidates:
        if "[" in c or "..." in c or c.endswith("simulate"):  # a synopsis or a name, not a command
          continue
        found.append((f"{page.name}:{n}", c))
  return found


PLACEHOLDERS = {"ROLE": "trainer", "TRACE": "examples/upstream_pattern.json", "N": "2"}


COMMANDS = _tunix_stage_commands()


@pytest.mark.parametrize("where,command", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_documented_tunix_stage_command_parses(where: str, command: str):
  words = shlex.split(command.lstrip("$ "))
  words = words[[i for i, w in enumerate(words) if w.endswith("tunix-stage")][0] + 1:]
  words = [PLACEHOLDERS.get(w, w) for w in words]
  try:
    args, unknown = cli_main.build_parser().parse_known_args(words)
  except SystemExit as e:
    pytest.fail(f"{where}: `tunix-stage {' '.join(words)}` does not parse (exit {e.code})")
  assert unknown == [], f"{where}: unknown flags {unknown}"
  assert args.subcommand in cli_main.subcommands()


def _bench_tables() -> list[tuple[str, list[str]]]:
  """(page:line, the table's lines) for each bench mode table a page shows as sample output."""
  found = []
  for page in PAGES:
    lines = page.read_text().splitlines()
    for n, line in enumerate(lines):
      if line.startswith("mode ") and "peak device batches" in line:
        end = n + 1  # the header, then the dashes and one row per mode
        while end < len(lines) and (lines[end].startswith("---") or
                                    lines[end].split(" ", 1)[0] in modes_lib.BY_NAME):
          end += 1
        found.append((f"{page.name}:{n + 1}", lines[n:end]))
  return found


BENCH_TABLES = _bench_tables()


def test_the_pages_show_bench_tables():
  assert len(BENCH_TABLES) >= 2  # docs/bench.md's two sample runs, at least


@pytest.mark.parametrize("where,table", BENCH_TABLES, ids=[w for w, _ in BENCH_TABLES])
def test_a_sample_bench_table_has_the_columns_the_bench_prints(where: str, table: list[str]):
  # pylint: disable-next=import-outside-toplevel
  from tunix_stage_plugin.lab.bench import report
  cells = lambda line: re.split(r"\s{2,}", line.strip())
  printed = cells(report.format_table(None, {}).splitlines()[0])  # the header alone
  assert cells(table[0]) == printed, f"{where}: the bench prints {printed}"
  rows = [row for row in table[1:] if not row.startswith("---")]
  assert rows, where
  for row in rows:
    assert len(cells(row)) == len(printed), f"{where}: {row!r} has not one cell per column"
