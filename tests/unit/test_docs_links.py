"""Every relative link of the README and of docs/*.md reaches a file, and a heading where it names one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of `text`: lower case, punctuation dropped, spaces to
    hyphens, a repeated one numbered (`-1`, `-2`, ...). Headings inside code blocks are not headings."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} +(.+?) *#* *$", re.sub(r"```.*?```", "", text, flags=re.S), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower()).replace(" ", "-")
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def relative_links(page: Path) -> list[str]:
    """The targets of `page`'s Markdown links that are neither web addresses nor mail, code blocks left out."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def test_the_anchor_rule_is_githubs() -> None:
    text = "# Train on ReTool (the README's first command)\n## `agentrl run env=retool` over five seeds\n## A\n## A\n"
    assert heading_anchors(text) == {"train-on-retool-the-readmes-first-command",
                                     "agentrl-run-envretool-over-five-seeds", "a", "a-1"}


def test_the_readme_links_the_docs_index() -> None:
    index = [t for t in relative_links(REPO / "README.md") if t in ("docs/README.md", "docs/index.md")]
    assert index and (REPO / index[0]).is_file()


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target} (no file {file.relative_to(REPO) if file.is_relative_to(REPO) else file})")
        elif anchor and file.suffix == ".md" and anchor not in heading_anchors(file.read_text()):
            broken.append(f"{target} (no heading with the anchor #{anchor} in {file.relative_to(REPO)})")
    assert not broken, f"{page.relative_to(REPO)} links to what does not exist: {broken}"
