"""The documentation holds together: every relative link in README.md and docs/ reaches a file
(and a heading, when it names one), every page and figure under docs/ is reachable from the
index (docs/README.md), and every `docs/...` path that code, tests, notebooks and presets name
exists. Pages move between the sections of docs/; these tests find what still points to the old
place.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
INDEX = DOCS / "README.md"

# Folders and file kinds that may name a docs path in their text.
_NAMING_FOLDERS = (
    "sdk",
    "envs",
    "verifiers",
    "recipes",
    "benchmarks",
    "scripts",
    "tests",
    "notebooks",
    "docs",
)
_NAMING_FILES = ("README.md", "CHANGELOG.md", "Makefile", "pyproject.toml")
_TEXT_SUFFIXES = {".py", ".md", ".ipynb", ".yaml", ".yml", ".toml", ".sh", ".txt", ".cfg"}

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)
_DOCS_PATH = re.compile(r"(?<![\w/.-])docs/[\w./{},-]*")


def markdown_links(text: str) -> list[str]:
    """Link and image targets of a markdown text, outside code blocks and code spans, in order.

    >>> markdown_links("[a](x.md) `[b](y.md)` ![c](fig/z.png \\"t\\") [d]: <w.md>")
    ['x.md', 'fig/z.png']
    >>> markdown_links("[d]: w.md#part")
    ['w.md#part']
    """
    prose = _INLINE_CODE.sub("", _FENCE.sub("", text))
    return _LINK.findall(prose) + _REF_DEF.findall(prose)


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, markup and punctuation dropped (hyphens
    and underscores kept), each space a hyphen.

    >>> slug("Parallel plans: memory and step time")
    'parallel-plans-memory-and-step-time'
    >>> slug("`RLTrainer` vs TRL (CPU), 2x")
    'rltrainer-vs-trl-cpu-2x'
    """
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Anchors of a markdown file's headings, numbered as GitHub numbers repeated ones."""
    seen: dict[str, int] = {}
    out = set()
    for line in _FENCE.sub("", path.read_text(encoding="utf-8")).splitlines():
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            base = slug(match.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def _is_external(target: str) -> bool:
    return bool(re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target))


def broken_links(path: Path) -> list[str]:
    """The relative links of markdown file `path` that reach no file, or no heading of it."""
    bad = []
    for target in markdown_links(path.read_text(encoding="utf-8")):
        if _is_external(target):
            continue
        file_part, _, fragment = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            bad.append(f"{target} (no such file)")
        elif fragment and dest.suffix == ".md" and fragment.lower() not in anchors(dest):
            bad.append(f"{target} (no heading with that anchor in {dest.name})")
    return bad


def _markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_reach_a_file_and_heading(path):
    bad = broken_links(path)
    assert not bad, f"{path.relative_to(ROOT)} links to: " + "; ".join(bad)


def test_the_link_checker_finds_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("# Title\n\n## Two words\n\n## Two words\n")
    page = tmp_path / "a.md"
    page.write_text(
        "[ok](sub/b.md#two-words) [ok2](sub/b.md#two-words-1) [self](#top)\n"
        "# Top\n[gone](sub/c.md) [bad anchor](sub/b.md#three) "
        "[web](https://example.org/x.md) `[code](nowhere.md)`\n"
        "```\n[fenced](nowhere.md)\n```\n"
    )
    assert broken_links(page) == [
        "sub/c.md (no such file)",
        "sub/b.md#three (no heading with that anchor in b.md)",
    ]


def reachable_from(index: Path) -> set[Path]:
    """Files under docs/ reached from `index` by following relative links between its pages."""
    seen = {index.resolve()}
    todo = [index.resolve()]
    while todo:
        page = todo.pop()
        for target in markdown_links(page.read_text(encoding="utf-8")):
            file_part = target.partition("#")[0]
            if not file_part or _is_external(target):
                continue
            dest = (page.parent / file_part).resolve()
            if dest in seen or not dest.is_file() or DOCS.resolve() not in dest.parents:
                continue
            seen.add(dest)
            if dest.suffix == ".md":
                todo.append(dest)
    return seen


def test_every_page_and_figure_under_docs_is_reachable_from_the_index():
    assert INDEX.is_file(), "docs/README.md, the index of the documentation, is missing"
    reached = reachable_from(INDEX)
    files = {p.resolve() for p in DOCS.rglob("*") if p.is_file()}
    orphans = sorted(str(p.relative_to(DOCS.resolve())) for p in files - reached)
    assert not orphans, (
        f"not reachable from docs/README.md (link them from the index or a page): {orphans}"
    )


def test_readme_links_the_docs_index():
    targets = {
        (ROOT / t.partition("#")[0]).resolve()
        for t in markdown_links((ROOT / "README.md").read_text(encoding="utf-8"))
        if not _is_external(t)
    }
    assert INDEX.resolve() in targets, "README.md must link docs/README.md"


def _expand(path: str) -> list[str]:
    """A named path with its braces expanded, trailing sentence punctuation dropped.

    >>> _expand("report.{md,png}.")
    ['report.md', 'report.png']
    """
    path = path.rstrip(".,")
    match = re.search(r"\{([^{}]*)\}", path)
    if not match:
        return [path]
    return [path[: match.start()] + alt + path[match.end() :] for alt in match.group(1).split(",")]


def _naming_files() -> list[Path]:
    """The project's text files that may name a docs path (this file's examples excepted)."""
    files = [ROOT / name for name in _NAMING_FILES if (ROOT / name).is_file()]
    for folder in _NAMING_FOLDERS:
        files += [
            p
            for p in sorted((ROOT / folder).rglob("*"))
            if p.suffix in _TEXT_SUFFIXES
            and p.is_file()
            and not {"__pycache__", ".ipynb_checkpoints"} & set(p.parts)
        ]
    return [p for p in files if p.resolve() != Path(__file__).resolve()]


def named_docs_paths() -> dict[str, set[str]]:
    """Every `docs/...` path named in the project's text files -> the files that name it."""
    named: dict[str, set[str]] = {}
    for path in _naming_files():
        for found in _DOCS_PATH.findall(path.read_text(encoding="utf-8", errors="replace")):
            for one in _expand(found):
                named.setdefault(one, set()).add(str(path.relative_to(ROOT)))
    return named


def test_docs_paths_named_anywhere_exist():
    named = named_docs_paths()
    assert "docs/design/architecture.md" in named
    # A path without a suffix is a prefix given to a script's --out (it adds .md and .png).
    missing = {
        p: sorted(where)
        for p, where in named.items()
        if not (ROOT / p).exists() and not (ROOT / f"{p}.md").exists()
    }
    assert not missing, f"docs paths that do not exist (moved or renamed?): {missing}"


def test_doctests():
    import doctest
    import sys

    result = doctest.testmod(sys.modules[__name__])
    assert result.attempted >= 5 and not result.failed


_SECTION_REF = re.compile(r"(docs/[\w./-]+\.md)`?(?: \(|, )((?:\"[^\"]+\"(?:,\s*)?)+)")


def named_sections() -> dict[tuple[str, str], set[str]]:
    """Headings named in quotes right after a docs path (in brackets, or after a comma) in the
    project's text files -> the files that name them."""
    named: dict[tuple[str, str], set[str]] = {}
    for path in _naming_files():
        for doc, quoted in _SECTION_REF.findall(path.read_text(encoding="utf-8", errors="replace")):
            for heading in re.findall(r'"([^"]+)"', quoted):
                key = (doc, " ".join(heading.split()))
                named.setdefault(key, set()).add(str(path.relative_to(ROOT)))
    return named


def headings(path: Path) -> set[str]:
    """The text of a markdown file's headings, markup dropped, spaces collapsed."""
    out = set()
    for line in _FENCE.sub("", path.read_text(encoding="utf-8")).splitlines():
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            out.add(" ".join(re.sub(r"[`*]", "", match.group(1)).split()))
    return out


def test_sections_named_beside_a_docs_path_exist():
    named = named_sections()
    assert ("docs/runbooks/ray.md", "On Slurm") in named
    missing = {
        f'{doc} ("{heading}")': sorted(where)
        for (doc, heading), where in named.items()
        if not (ROOT / doc).is_file() or heading not in headings(ROOT / doc)
    }
    assert not missing, f"sections named that the page does not have: {missing}"


def test_the_section_check_reads_both_forms_and_finds_a_missing_heading(tmp_path):
    text = 'see docs/a.md ("On Slurm", "Gone\n   away") and docs/b.md, "Setup".'
    assert _SECTION_REF.findall(text) == [
        ("docs/a.md", '"On Slurm", "Gone\n   away"'),
        ("docs/b.md", '"Setup"'),
    ]
    page = tmp_path / "a.md"
    page.write_text("# Title\n\n## On `Slurm`\n\n```\n## Gone away\n```\n")
    assert headings(page) == {"Title", "On Slurm"}
