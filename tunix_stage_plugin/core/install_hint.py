"""Install hints that fit how this package was installed.

The README installs from a checkout (`pip install -e .`), while a registry release would be
`pip install 'tunix-stage-plugin[codec]'`: a hint naming the wrong one sends a user to a package
that may not exist. pip records where an installation came from (PEP 610's direct_url.json), so a
hint names that checkout, editable or not; a package imported from a source tree without being
installed (PYTHONPATH) gets its tree. Read only when a hint is printed (docs/configuration.md).
"""

from __future__ import annotations

import json
import os
import shlex
import urllib.parse
import urllib.request

DISTRIBUTION = "tunix-stage-plugin"


def _tree() -> str | None:
  """The source tree this module is imported from (a checkout), or None (site-packages)."""
  tree = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  return tree if os.path.isfile(os.path.join(tree, "setup.cfg")) else None


def _source() -> tuple[str, bool] | None:
  """(the checkout's folder, editable) this package was installed from; None: from a registry."""
  import importlib.metadata  # pylint: disable=import-outside-toplevel  (only for a hint)
  try:
    text = importlib.metadata.distribution(DISTRIBUTION).read_text("direct_url.json")
  except importlib.metadata.PackageNotFoundError:
    text = None
  try:
    record = json.loads(text or "null")
  except ValueError:
    record = None
  if not isinstance(record, dict) or not str(record.get("url", "")).startswith("file:"):
    # No record of a folder: imported from a checkout (its egg-info, or PYTHONPATH), else a
    # registry's release.
    tree = _tree()
    return None if tree is None else (tree, True)
  folder = urllib.request.url2pathname(urllib.parse.urlparse(record["url"]).path)
  info = record.get("dir_info")
  return folder, isinstance(info, dict) and info.get("editable") is True


def install_command(extra: str | None = None) -> str:
  """The pip command that installs this package (with `extra`) the way it was installed here."""
  suffix = f"[{extra}]" if extra else ""
  source = _source()
  if source is None:
    return f"pip install {shlex.quote(DISTRIBUTION + suffix)}"
  folder, editable = source
  return f"pip install {'-e ' if editable else ''}{shlex.quote(folder + suffix)}"
