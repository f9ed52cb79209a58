"""A micro-batch's way, measured: every call into the plugin's files (the lab's own left out) in
every thread of this process, with the plugin files on its stack, between two instants.

`Way` is a profile hook (`sys.setprofile` and `threading.setprofile`: start it before the threads
to watch start). The tests of the way (tests/hosts/tunix/test_way.py, tests/embedded/
test_way.py) open a window on one staged micro-batch, from the pipeline's stage call to the
return of its train call by key, and read which files its calls passed through and whether any
call went back up: a file met again further down a call's stack, after another file.
"""

from __future__ import annotations

import pathlib
import sys
import threading
import time
from typing import Any

import tunix_stage_plugin

PACKAGE = str(pathlib.Path(tunix_stage_plugin.__file__).parent) + "/"
LAB = PACKAGE + "lab/"
DESIGN = pathlib.Path(__file__).resolve().parents[1] / "docs" / "design.md"


def _plugin(filename: str, lab: bool) -> bool:
  return filename.startswith(PACKAGE) and (lab or not filename.startswith(LAB))


class Way:
  """The calls into the plugin (its lab too, with `lab`) while on: (when, file, function, the
  plugin files on the caller's stack, outermost first)."""

  def __init__(self, *, lab: bool = False) -> None:
    self.lab = lab
    self.calls: list[tuple[float, str, str, tuple[str, ...]]] = []
    self.marks: dict[str, float] = {}
    self._lock = threading.Lock()

  def _profile(self, frame: Any, event: str, arg: Any) -> None:
    del arg
    if event != "call" or not _plugin(frame.f_code.co_filename, self.lab):
      return
    stack, outer = [], frame.f_back
    while outer is not None:
      if _plugin(outer.f_code.co_filename, self.lab):
        stack.append(outer.f_code.co_filename[len(PACKAGE):])
      outer = outer.f_back
    call = (time.perf_counter(), frame.f_code.co_filename[len(PACKAGE):], frame.f_code.co_name,
            tuple(reversed(stack)))
    with self._lock:
      self.calls.append(call)

  def start(self) -> "Way":
    threading.setprofile(self._profile)
    sys.setprofile(self._profile)
    return self

  def stop(self) -> None:
    sys.setprofile(None)
    threading.setprofile(None)  # threads started meanwhile keep it until they end

  def mark(self, name: str) -> None:
    """Notes this instant under `name` (a window's start or end)."""
    self.marks[name] = time.perf_counter()

  def window(self, start: str, end: str) -> list[tuple[float, str, str, tuple[str, ...]]]:
    lo, hi = self.marks[start], self.marks[end]
    with self._lock:
      return [c for c in self.calls if lo <= c[0] <= hi]


def files(calls: list[tuple[float, str, str, tuple[str, ...]]]) -> set[str]:
  """The plugin files the calls passed through."""
  return {c[1] for c in calls}


def back_up(calls: list[tuple[float, str, str, tuple[str, ...]]]) -> list[tuple[str, ...]]:
  """The calls that went back up: their file already on their stack below another file (A calls
  B, which calls back into A), as the stacks' files, outermost first."""
  found = []
  for _, file, _, stack in calls:
    chain = [f for i, f in enumerate([*stack, file]) if i == 0 or f != [*stack, file][i - 1]]
    if len(chain) != len(set(chain)):
      found.append(tuple(chain))
  return sorted(set(found))


HOSTS = {"tunix": "### On tunix's host", "embedded": "### On the embedded host"}


def design_table(host: str) -> set[str]:
  """The files docs/design.md's table of a micro-batch's way on `host` names (its first column:
  `file:function`, the file relative to the package)."""
  text = DESIGN.read_text(encoding="utf-8")
  start = text.index(HOSTS[host])
  end = text.find("\n#", start + 1)
  named = set()
  for line in text[start:end if end != -1 else None].splitlines():
    if line.startswith("| `") and ".py" in line:
      named.add(line.split("|")[1].strip().strip("`").split(":")[0])
  return named


def marking(engine_cls: type) -> type:
  """`engine_cls` (a pipeline's engine), its train call marking "end" on `way` once the train
  call of `key` returned: the window's end."""

  class Marked(engine_cls):
    key: str | None = None
    way: Way

    async def train(self, payload, *, stage_key, apply_optimizer):
      trained = await super().train(payload, stage_key=stage_key, apply_optimizer=apply_optimizer)
      if stage_key is not None and stage_key == self.key:
        self.way.mark("end")
      return trained

  return Marked


def check(way: Way, host: str, most: int) -> None:
  """The window's calls on `host`: at most `most` files, none called back from below, and the
  files docs/design.md's table names."""
  calls = way.window("start", "end")
  found = files(calls)
  print(f"\nthe files a staged micro-batch's calls pass through ({host}):", *sorted(found),
        sep="\n  ")
  assert len(found) <= most, " ".join(sorted(found))
  assert back_up(calls) == [], "\n".join(" > ".join(c) for c in back_up(calls))
  assert found == design_table(host), sorted(found)
