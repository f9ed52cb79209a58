"""The pages read quickly: short sentences, a short README, and few words in all.

Measured on prose only, as issue 56 measured it: fenced code blocks, tables, headings, HTML
comments, pictures and list items' markers are left out. The rest of a page is joined into one
text and split into sentences after `.`, `!` or `?` followed by a space or a line's end (so a
paragraph or list item without an end mark runs on into the next). A word is what whitespace
separates. The total is `wc -w README.md docs/*.md`: every word, code and tables included.
"""

from __future__ import annotations

from pathlib import Path
import re
import statistics

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]

MEDIAN_WORDS_MAX = 20  # a page's median words per sentence
README_SENTENCE_MAX = 45  # the README's longest sentence, in words
README_LINES_MAX = 120
TOTAL_WORDS_MAX = 28_900  # 60 % of the 48,212 words the pages held when issue 56 was filed


def prose(text: str) -> str:
  """The page's prose as one text: fenced code, tables, headings, comments and pictures out."""
  text = re.sub(r"<!--.*?-->", " ", text, flags=re.S)
  text = re.sub(r"!\[[^\]]*\]\([^)]*\)", " ", text)  # a picture, its alt text on any lines
  kept, fenced = [], False
  for line in text.splitlines():
    stripped = line.strip()
    if stripped.startswith(("```", "~~~")):
      fenced = not fenced
      continue
    if fenced or stripped.startswith(("|", "#")):
      continue
    kept.append(re.sub(r"^([-*+]|\d+[.)])\s+", "", stripped))  # a list item's marker is no word
  return " ".join(kept)


def sentence_texts(text: str) -> list[str]:
  """The page's sentences, split after `.`, `!` or `?` and whitespace."""
  return [p for p in re.split(r"(?<=[.!?])\s+", prose(text)) if p.split()]


def sentences(text: str) -> list[int]:
  """Each sentence's word count."""
  return [len(p.split()) for p in sentence_texts(text)]


def words(text: str) -> int:
  return len(text.split())


def test_the_measure_splits_and_leaves_out_as_the_issue_says():
  page = ("# A heading of many words that is not a sentence\n\n"
          "One two three. Four five\nsix seven!\n\n"
          "```bash\nnot. counted. at all.\n```\n"
          "| a | table. |\n<!-- a comment. -->\n![a picture.\nof two lines.](p.png)\n"
          "- an item with no end mark\n- runs into the next one? Yes.\n")
  assert sentences(page) == [3, 4, 11, 1]
  assert words("a b\nc  d") == 4


def test_the_measure_can_fail():
  long_one = " ".join(["word"] * 46) + "."
  assert max(sentences(long_one)) > README_SENTENCE_MAX
  assert statistics.median(sentences(long_one + " Short one.")) > MEDIAN_WORDS_MAX


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_a_page_s_sentences_are_short(page: Path):
  counts = sentences(page.read_text(encoding="utf-8"))
  assert counts, f"{page.name}: no prose"
  median = statistics.median(counts)
  assert median <= MEDIAN_WORDS_MAX, (
      f"{page.relative_to(ROOT)}: median {median} words a sentence over {len(counts)} sentences; "
      f"keep it within {MEDIAN_WORDS_MAX}: split them, or make a list or a table of what they list")


def test_no_readme_sentence_is_long():
  text = README.read_text(encoding="utf-8")
  long_ones = [p for p in sentence_texts(text) if len(p.split()) > README_SENTENCE_MAX]
  assert long_ones == [], (
      f"README.md: sentences over {README_SENTENCE_MAX} words: {long_ones}")


def test_the_readme_is_short():
  lines = len(README.read_text(encoding="utf-8").splitlines())
  assert lines <= README_LINES_MAX, f"README.md has {lines} lines; keep it within {README_LINES_MAX}"


def test_the_pages_hold_few_words_in_all():
  total = sum(words(p.read_text(encoding="utf-8")) for p in PAGES)
  each = {p.name: words(p.read_text(encoding="utf-8")) for p in PAGES}
  assert total <= TOTAL_WORDS_MAX, (
      f"README.md and docs/*.md hold {total} words (wc -w); keep them within {TOTAL_WORDS_MAX}: "
      f"{each}")
