"""A small post-import hook: run a callback once after any of some modules has been imported, so
that the bootstrap (at interpreter start) can install when the host is first imported, whatever
the import order (docs/tunix.md "Activation, three ways").

Trap: the callback imports the rest of the host, so it must not run while a host module is still
half executed (`rl_program` importing `rl_engine_interface` importing `remote_execution`). A watch
is therefore *triggered* by a watched module and *fired* once no other module of the same
top-level package is still initializing. The finder wraps only that package's loaders and leaves
`sys.meta_path` once every watch fired. It runs at every start-up with staging on, so it imports
nothing beyond builtins (importlib.abc alone costs ~10 ms) and answers any other import with one
set lookup.
"""

from __future__ import annotations

import _thread
import sys

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs start-up time
if TYPE_CHECKING:
  from typing import Any, Callable, Iterable


class _Watch:
  def __init__(self, modules: frozenset[str], callback: Callable[[], None]) -> None:
    self.modules = modules
    self.roots = frozenset(m.split(".", 1)[0] for m in modules)
    self.callback = callback
    self.triggered = False
    self.fired = False

  def covers(self, name: str) -> bool:
    return name.split(".", 1)[0] in self.roots


class _NotifyingLoader:
  """Wraps the real loader for one import: execute the module, hand it back, then notify.

  Everything but exec_module is the real loader's: attributes are delegated, so `python -m` of a
  watched module (runpy calls get_code / is_package / get_filename), importlib.resources
  (get_resource_reader) and pkgutil (get_data) see exactly what the real loader answers.
  """

  def __init__(self, loader: Any, finder: PostImportFinder) -> None:
    self._loader = loader
    self._finder = finder

  def __getattr__(self, name: str) -> Any:
    # Only called for attributes this wrapper lacks; __dict__ lookup avoids recursing when
    # _loader itself is missing (e.g. during copy or unpickling).
    try:
      loader = self.__dict__["_loader"]
    except KeyError:
      raise AttributeError(name) from None
    return getattr(loader, name)

  def __repr__(self) -> str:
    return f"<tunix-stage post-import wrapper of {self._loader!r}>"

  def create_module(self, spec: Any) -> Any:
    create = getattr(self._loader, "create_module", None)
    return None if create is None else create(spec)  # None: the default module creation

  def exec_module(self, module: Any) -> None:
    # The import system reads spec.loader again to call exec_module, so the real loader can only
    # be handed back here; the module keeps it, never this wrapper.
    module.__spec__.loader = self._loader
    module.__loader__ = self._loader
    self._loader.exec_module(module)
    self._finder.notify(module.__name__)


def _initializing(root: str, but: str) -> bool:
  """Whether a module of package `root` other than `but` is still executing its body."""
  for name, module in list(sys.modules.items()):
    if name != but and name.split(".", 1)[0] == root:
      # importlib's own marker for a module whose body is running (importlib._bootstrap).
      if getattr(getattr(module, "__spec__", None), "_initializing", False):
        return True
  return False


class PostImportFinder:
  """Meta-path finder that wraps the loaders of watched packages; passes on everything else."""

  def __init__(self) -> None:
    self._lock = _thread.RLock()
    self._watches: list[_Watch] = []
    # The top-level packages of the live watches: find_spec's only work for any other import.
    self._roots: frozenset[str] = frozenset()

  def _live(self) -> list[_Watch]:
    with self._lock:
      return [w for w in self._watches if not w.fired]

  def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
    if fullname.partition(".")[0] not in self._roots:
      return None
    for finder in list(sys.meta_path):
      if finder is self or not hasattr(finder, "find_spec"):
        continue
      spec = finder.find_spec(fullname, path, target)
      if spec is not None:
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
          return spec  # a namespace package or legacy loader: nothing to wrap
        spec.loader = _NotifyingLoader(spec.loader, self)
        return spec
    return None

  def invalidate_caches(self) -> None:
    pass  # nothing cached here; importlib.invalidate_caches calls it on every meta-path finder

  def add(self, modules: Iterable[str], callback: Callable[[], None]) -> None:
    watch = _Watch(frozenset(modules), callback)
    with self._lock:
      self._watches.append(watch)
      self._roots = self._roots | watch.roots
      if self not in sys.meta_path:
        sys.meta_path.insert(0, self)
    if watch.modules & set(sys.modules):  # already imported: no import will come to watch
      watch.triggered = True
      self._settle(watch, just_loaded="")

  def notify(self, module_name: str) -> None:
    for watch in self._live():
      if module_name in watch.modules:
        watch.triggered = True
      if watch.triggered and watch.covers(module_name):
        self._settle(watch, just_loaded=module_name)

  def _settle(self, watch: _Watch, just_loaded: str) -> None:
    if any(_initializing(root, but=just_loaded) for root in watch.roots):
      return  # an outer host import is still running; its completion will settle this watch
    with self._lock:
      if watch.fired:
        return
      watch.fired = True
      self._watches = [w for w in self._watches if not w.fired]
      self._roots = frozenset(r for w in self._watches for r in w.roots)
      if not self._watches and self in sys.meta_path:
        sys.meta_path.remove(self)
    try:
      watch.callback()
    except Exception as e:  # pylint: disable=broad-except  (never break the host's own import)
      # A callback that must stop the process (an invalid staging setting) raises SystemExit,
      # which is not an Exception and so passes through here on purpose.
      print(f"tunix-stage: post-import hook failed: {type(e).__name__}: {e}", file=sys.stderr)


_finder = PostImportFinder()


def when_imported(modules: Iterable[str], callback: Callable[[], None]) -> None:
  """Calls `callback` once after the first of `modules` is imported (now, if one already is)."""
  _finder.add(modules, callback)
