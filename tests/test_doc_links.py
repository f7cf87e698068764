"""Relative links in README.md and docs/ resolve: the file exists, and a
`#fragment` into a markdown file names one of its headings (GitHub's slugs)."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^()\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def _slug(heading: str) -> str:
  text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
  return text.replace(" ", "-")


def _outside_fences(path: pathlib.Path):
  inside = False
  for line in path.read_text(encoding="utf-8").splitlines():
    if FENCE.match(line):
      inside = not inside
      continue
    if not inside:
      yield line


def _anchors(path: pathlib.Path) -> set[str]:
  seen: dict[str, int] = {}
  anchors = set()
  for line in _outside_fences(path):
    match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
    if not match:
      continue
    slug = _slug(match.group(1))
    count = seen.get(slug, 0)
    seen[slug] = count + 1
    anchors.add(slug if count == 0 else f"{slug}-{count}")
  return anchors


def _documents():
  return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_relative_links_resolve():
  broken = []
  for doc in _documents():
    for line in _outside_fences(doc):
      for target in LINK.findall(line):
        if re.match(r"[a-z]+:", target):
          continue  # http(s):, mailto:
        file_part, _, fragment = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        rel = doc.relative_to(ROOT)
        if not dest.exists():
          broken.append(f"{rel}: {target} (no such file)")
        elif fragment and dest.suffix == ".md" and fragment not in _anchors(dest):
          broken.append(f"{rel}: {target} (no heading #{fragment})")
  assert not broken, "broken links:\n" + "\n".join(broken)
