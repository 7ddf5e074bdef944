"""Every relative link in the README, the changelog and the docs resolves: to a file or directory of the
repository, and where it names an anchor, to a heading of that file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [
    ROOT / "README.md",
    ROOT / "CHANGELOG.md",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "docs/results/README.md",
]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """The lines outside fenced code blocks, numbered from 1."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def anchors(path: Path) -> set[str]:
    """GitHub's anchors for the headings of a Markdown file (a repeated heading gets -1, -2, ...)."""
    found, seen = set(), {}
    for _, line in prose_lines(path.read_text()):
        heading = re.match(r"#+\s+(.*)", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", re.sub(r"[`*_]", "", heading.group(1).strip().lower())).replace(" ", "-")
            count = seen.get(slug, 0)
            found.add(slug if count == 0 else f"{slug}-{count}")
            seen[slug] = count + 1
    return found


def broken_links(doc: Path) -> list[str]:
    broken = []
    for number, line in prose_lines(doc.read_text()):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            destination = (doc.parent / path) if path else doc
            if not destination.exists():
                broken.append(f"{doc.name}:{number}: {target} does not exist")
            elif anchor and destination.is_file() and anchor not in anchors(destination):
                broken.append(f"{doc.name}:{number}: no heading #{anchor} in {path or doc.name}")
    return broken


@pytest.mark.parametrize("doc", [d for d in DOCS if d.exists()], ids=lambda d: str(d.relative_to(ROOT)))
def test_links_resolve(doc):
    assert broken_links(doc) == []


def test_a_broken_link_is_reported(tmp_path):
    (tmp_path / "there.md").write_text("# A heading\n")
    doc = tmp_path / "doc.md"
    doc.write_text("[ok](there.md#a-heading) [gone](missing.md) [bad anchor](there.md#nowhere)\n```\n[x](no.md)\n```\n")
    assert broken_links(doc) == [
        "doc.md:1: missing.md does not exist",
        "doc.md:1: no heading #nowhere in there.md",
    ]
