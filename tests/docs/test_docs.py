"""The README and docs/ pages: every relative link resolves (file and, for Markdown, heading anchor), every docs
page is linked from the README exactly once, the README stays a newcomer's page (at most 200 lines) and
docs/benchmarks.md a page of current results (at most 400: earlier runs live in git history)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Pages outside docs/ that the README must link exactly once too.
LINKED_ONCE = {"deploy/README.md"}

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def links(page: Path) -> list[str]:
    return LINK.findall(FENCE.sub("", page.read_text()))


def anchors(page: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        if line.startswith("#"):
            text = line.lstrip("#").strip().lower()
            out.add(re.sub(r"\s", "-", re.sub(r"[^\w\- ]", "", text)))
    return out


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        for target in links(page):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_readme_links_each_docs_page_once_and_stays_short():
    readme = ROOT / "README.md"
    targets = [t.partition("#")[0] for t in links(readme)]
    for page in sorted((ROOT / "docs").glob("*.md")):
        rel = page.relative_to(ROOT).as_posix()
        assert targets.count(rel) == 1, f"README links {rel} {targets.count(rel)} times"
    for rel in LINKED_ONCE:
        assert targets.count(rel) == 1, rel
    assert len(readme.read_text().splitlines()) <= 200


def test_the_benchmarks_page_holds_current_results_only():
    assert len((ROOT / "docs" / "benchmarks.md").read_text().splitlines()) <= 400
