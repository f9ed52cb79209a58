"""The pages link to what exists: every relative link of README.md and docs/*.md resolves.

A link's file must exist (relative to the page that holds it), and its #anchor must be a heading
of the page it points to, slugged as GitHub does (lower case, punctuation but `-` and `_`
dropped, spaces to `-`, a repeated heading getting `-1`, `-2`, ...). Links inside code (fenced
blocks, inline code) are not links. And the README stays a page a newcomer reads in minutes.
"""

from __future__ import annotations

from pathlib import Path
import re

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 120
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _prose(page: Path) -> list[tuple[int, str]]:
  """(line number, text) of the page's lines outside fenced code, inline code removed."""
  out, fenced = [], False
  for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
    if line.lstrip().startswith(("```", "~~~")):
      fenced = not fenced
      continue
    if not fenced:
      out.append((n, re.sub(r"`[^`]*`", "", line)))
  return out


def slug(heading: str) -> str:
  text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
  text = re.sub(r"[^\w\- ]", "", text.strip().lower())
  return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
  seen: dict[str, int] = {}
  out = set()
  fenced = False
  for line in page.read_text(encoding="utf-8").splitlines():
    if line.lstrip().startswith(("```", "~~~")):
      fenced = not fenced
      continue
    match = re.match(r"#{1,6} (.+?)\s*#*\s*$", line)
    if fenced or not match:
      continue
    base = slug(match.group(1))
    count = seen.get(base, 0)
    seen[base] = count + 1
    out.add(base if count == 0 else f"{base}-{count}")
  return out


def _links() -> list[tuple[str, Path, str]]:
  found = []
  for page in PAGES:
    for n, text in _prose(page):
      for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
          continue
        found.append((f"{page.relative_to(ROOT)}:{n}", page, target))
  return found


LINKS = _links()


def test_the_pages_have_relative_links():
  assert len(LINKS) > 20
  assert {p for _, p, _ in LINKS} >= {ROOT / "README.md"}


@pytest.mark.parametrize("where,page,target", LINKS, ids=[f"{w} {t}" for w, _, t in LINKS])
def test_a_relative_link_resolves(where: str, page: Path, target: str):
  path, _, anchor = target.partition("#")
  resolved = (page.parent / path).resolve() if path else page
  assert resolved.exists(), f"{where}: {target}: no file {resolved.relative_to(ROOT)}"
  if anchor:
    assert resolved.suffix == ".md", f"{where}: {target}: an anchor into a file that is not a page"
    assert anchor in anchors(resolved), (
        f"{where}: {target}: {resolved.name} has no heading with the anchor #{anchor}; it has "
        f"{sorted(anchors(resolved))}")


def test_slugs_are_githubs():
  assert slug("The main job: `tunix-stage bench`") == "the-main-job-tunix-stage-bench"
  assert slug("Micro-batches over tunix's message cap") == "micro-batches-over-tunixs-message-cap"
  assert slug("The receive/place split") == "the-receiveplace-split"
  assert slug("Activation, three ways") == "activation-three-ways"


def test_every_docs_page_is_linked_from_the_readme():
  readme = {(ROOT / t.partition("#")[0]).resolve()
            for w, p, t in LINKS if p == ROOT / "README.md" and t.partition("#")[0]}
  missing = [p.name for p in PAGES[1:] if p.resolve() not in readme]
  assert missing == [], f"README.md links to no {missing}"


def test_the_readme_is_a_short_page():
  lines = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
  assert lines <= README_MAX_LINES, (
      f"README.md has {lines} lines; keep it within {README_MAX_LINES} and move the rest to docs/")
