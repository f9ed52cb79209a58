"""Install hints name the way this package was installed (core.install_hint).

Real metadata: a dist-info folder first on sys.path is what importlib.metadata finds, as pip
leaves it for a registry release, a checkout installed from its folder, or an editable checkout.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tunix_stage_plugin.core import install_hint

CHECKOUT = Path(__file__).resolve().parents[2]


def _dist_info(folder: Path, direct_url: dict | None) -> None:
  info = folder / "tunix_stage_plugin-0.1.0.dist-info"
  info.mkdir()
  (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tunix-stage-plugin\nVersion: 0.1.0\n")
  if direct_url is not None:
    (info / "direct_url.json").write_text(json.dumps(direct_url))


@pytest.mark.parametrize("direct_url, extra, command", [
    ({"url": "file:///src/tsp", "dir_info": {"editable": True}}, "codec",
     "pip install -e '/src/tsp[codec]'"),
    ({"url": "file:///src/my%20tsp", "dir_info": {}}, None, "pip install '/src/my tsp'"),
    ({"url": "https://example.org/tsp.tar.gz", "archive_info": {}}, "bench",
     "pip install 'tunix-stage-plugin[bench]'"),
])
def test_the_hint_names_where_pip_installed_it_from(tmp_path, monkeypatch, direct_url, extra,
                                                    command):
  _dist_info(tmp_path, direct_url)
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.setattr(install_hint, "_tree", lambda: None)  # as from site-packages
  assert install_hint.install_command(extra) == command


def test_a_registry_release_gets_the_registry_s_command(tmp_path, monkeypatch):
  _dist_info(tmp_path, None)  # pip records no direct_url.json for a registry's wheel
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.setattr(install_hint, "_tree", lambda: None)
  assert install_hint.install_command("codec") == "pip install 'tunix-stage-plugin[codec]'"


def test_a_package_imported_from_its_checkout_names_the_checkout(tmp_path, monkeypatch):
  _dist_info(tmp_path, None)  # e.g. the checkout's own egg-info, or PYTHONPATH
  monkeypatch.syspath_prepend(str(tmp_path))
  assert install_hint.install_command("codec") == f"pip install -e '{CHECKOUT}[codec]'"
