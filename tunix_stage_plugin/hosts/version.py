"""A host's installed version and, where it can be known, the git commit it was installed from.

Read from files only (no `git` subprocess): pip's PEP 610 direct_url.json gives the commit of a
VCS install, or the directory of a local/editable one, whose .git/HEAD we then resolve.
"""

from __future__ import annotations

import importlib.metadata
import json
import pathlib


def dist_version(dist: str) -> str | None:
  try:
    return importlib.metadata.version(dist)
  except importlib.metadata.PackageNotFoundError:
    return None


def dist_commit(dist: str) -> str | None:
  """The commit `dist` was installed from: VCS installs, or a local checkout's HEAD."""
  try:
    text = importlib.metadata.distribution(dist).read_text("direct_url.json")
  except importlib.metadata.PackageNotFoundError:
    return None
  if not text:
    return None
  info = json.loads(text)
  commit = info.get("vcs_info", {}).get("commit_id")
  if commit:
    return commit
  url = info.get("url", "")
  if url.startswith("file://"):
    return git_head(pathlib.Path(url[len("file://"):]))
  return None


def git_head(checkout: pathlib.Path) -> str | None:
  """Resolves HEAD of the git checkout at `checkout` (a .git dir, or a worktree's .git file)."""
  git = checkout / ".git"
  if git.is_file():  # worktree or submodule: "gitdir: <path>"
    target = git.read_text().strip().removeprefix("gitdir:").strip()
    git = (checkout / target).resolve()
  head_file = git / "HEAD"
  if not head_file.is_file():
    return None
  head = head_file.read_text().strip()
  if not head.startswith("ref:"):
    return head  # detached HEAD
  ref = head[len("ref:"):].strip()
  common = git
  if (git / "commondir").is_file():  # worktrees keep refs in the main repository
    common = (git / (git / "commondir").read_text().strip()).resolve()
  for base in (git, common):
    if (base / ref).is_file():
      return (base / ref).read_text().strip()
  packed = common / "packed-refs"
  if packed.is_file():
    for line in packed.read_text().splitlines():
      if line.endswith(" " + ref):
        return line.split(" ", 1)[0]
  return None


def checkout_commit(module_file: str, levels: int = 4) -> str | None:
  """HEAD of the git checkout a module was imported from (editable installs, source trees)."""
  for parent in list(pathlib.Path(module_file).resolve().parents)[:levels]:
    if (parent / ".git").exists():
      return git_head(parent)
  return None


def describe(name: str, dist: str, module_file: str | None = None) -> str:
  """'tunix 0.1.8 (commit c7d8950)'; the commit from pip's record, else the module's checkout."""
  version = dist_version(dist) or "(version unknown)"
  commit = dist_commit(dist) or (checkout_commit(module_file) if module_file else None)
  return f"{name} {version}" + (f" (commit {commit[:7]})" if commit else "")
