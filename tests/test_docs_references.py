"""Every cross-reference of the README and the docs resolves, as the docstrings' do
(``tests/test_docstring_references.py``): links to pages, files and headings; files named in inline code (from the
repository root, the package or the page's folder); objects named by their dotted path; the members the API page
lists. And every pointer of a docstring to a docs page, one of its headings or a README section names one that
exists."""

import ast
import re
import subprocess
import unicodedata
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_docstring_references import _MISSING, docstrings, lookup, module_names, source_of

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "lightning_ckpt_determinism"
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

_FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_CODE = re.compile(r"`([^`\n]+)`")
# A file: folders, then a name without dots and a suffix the repository holds (`Cause.hints.yaml` is no file).
_FILE = re.compile(r"^(?:[\w.\-]+/)*[\w\-]+\.(?:py|md|yaml|json|toml|png|txt)$")
_OBJECT = re.compile(r"^(?:lightning_ckpt_determinism|torch|lightning)(?:\.\w+)+(?:\(\))?$")
_HEADING = re.compile(r"^#+ (.+)$", re.MULTILINE)
_DOCS_POINTER = re.compile(r"docs/([\w\-]+\.md)(?:#([\w\-]+))?")
_README_SECTION = re.compile(r"README's ([A-Z][\w\- ]*?) section")
_MEMBERS = re.compile(r"^::: ([\w.]+)\n    options:\n      members: \[([^\]]*)\]$", re.MULTILINE)
# Files the docs name that a user's run writes, not the repository.
_USERS_FILES = {"config.yaml"}


def slug(heading: str) -> str:
    """The anchor the docs' table of contents gives ``heading`` (Python-Markdown's ``toc`` slugify)."""
    text = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(text: str) -> set[str]:
    """The anchors of the headings of a page's ``text``."""
    return {slug(heading) for heading in _HEADING.findall(_FENCE.sub("", text))}


def tracked_names() -> set[str]:
    listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return {Path(path).name for path in listed.split()}


def unresolved(page: Path, text: str, names: set[str]) -> list[str]:
    """The references of ``text`` (the text of ``page``) that name nothing: links, files and objects."""
    prose = _FENCE.sub("", text)
    found = []
    for target in _LINK.findall(prose):
        if target.startswith(("https://", "http://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        if not path:
            if anchor not in anchors(text):
                found.append(f"{page.name}: link {target} names no heading of the page")
            continue
        resolved = page.parent / path
        if not resolved.is_file():
            found.append(f"{page.name}: link {target} names no file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved.read_text()):
            found.append(f"{page.name}: link {target} names no heading of {resolved.name}")
    for code in _CODE.findall(prose):
        if _FILE.match(code) and code not in _USERS_FILES:
            # A path from the repository, the package or the page; a bare name anywhere in the repository.
            bases = (REPO, PACKAGE, page.parent)
            exists = any((base / code).is_file() for base in bases) if "/" in code else code in names
            if not exists:
                found.append(f"{page.name}: `{code}` names no file")
        elif _OBJECT.match(code) and lookup(code.removesuffix("()")) is _MISSING:
            found.append(f"{page.name}: `{code}` names no object")
    return found


def pointers(source: str) -> Iterator[tuple[str, str, int, str]]:
    """``(kind, target, line, anchor)`` of every pointer to the docs or the README in the docstrings of ``source``:
    kind ``"page"`` with a page of ``docs/`` and its anchor (``""`` for none), or ``"readme"`` with a section's
    title."""
    for _, text, line in docstrings(ast.parse(source)):
        for page, anchor in _DOCS_POINTER.findall(text):
            yield "page", page, line, anchor
        for section in _README_SECTION.findall(" ".join(text.split())):
            yield "readme", section, line, ""


def stale_pointers(module: str, source: str) -> list[str]:
    readme = {heading.strip().lower() for heading in _HEADING.findall((REPO / "README.md").read_text())}
    found = []
    for kind, target, line, anchor in pointers(source):
        if kind == "readme":
            if target.lower() not in readme:
                found.append(f"{module}:{line} the README has no section {target!r}")
            continue
        page = REPO / "docs" / target
        if not page.is_file():
            found.append(f"{module}:{line} docs/{target} is no page")
        elif anchor and anchor not in anchors(page.read_text()):
            found.append(f"{module}:{line} docs/{target} has no heading #{anchor}")
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_link_file_and_object_a_page_names_exists(page: Path) -> None:
    assert unresolved(page, page.read_text(), tracked_names()) == []


@pytest.mark.parametrize("module", module_names())
def test_every_docstring_pointer_to_the_docs_or_the_readme_names_what_exists(module: str) -> None:
    assert stale_pointers(module, source_of(module)) == []


def test_the_members_the_api_page_lists_exist() -> None:
    listed = _MEMBERS.findall((REPO / "docs" / "api.md").read_text())
    assert listed, "the API page lists members for its classes that have internals"
    for name, members in listed:
        owner = lookup(name)
        assert owner is not _MISSING, name
        assert [member for member in re.split(r",\s*", members) if not hasattr(owner, member)] == [], name


BROKEN_PAGE = """# A page

## Mixture of experts

See [the check](how-a-check-works.md#no-such-heading), [this](#mixture-of-experts), [that](#mixture), [gone](gone.md),
`examples/configs/no_such.yaml`, `examples/configs/moe_blocks.yaml`, `moe_blocks.yaml`, `missing_file.py`,
`config.yaml`, `lightning_ckpt_determinism.verify.digest.no_such`, `lightning_ckpt_determinism.Cause.hints` and
`Cause.hints.yaml`.

```text
`in_a_block.py` is not prose
```
"""

BROKEN_DOCSTRING = '''
"""See ``docs/performance.md``, ``docs/gone.md``, ``docs/routing.md#limits`` and ``docs/routing.md#nowhere``."""


def cost() -> None:
    """Costs under a step (see the README's Performance section, not the README's Quick start section)."""
'''


def test_stale_references_of_a_page_and_of_a_docstring_are_found() -> None:
    page = REPO / "docs" / "broken.md"
    assert unresolved(page, BROKEN_PAGE, tracked_names()) == [
        "broken.md: link how-a-check-works.md#no-such-heading names no heading of how-a-check-works.md",
        "broken.md: link #mixture names no heading of the page",
        "broken.md: link gone.md names no file",
        "broken.md: `examples/configs/no_such.yaml` names no file",
        "broken.md: `missing_file.py` names no file",
        "broken.md: `lightning_ckpt_determinism.verify.digest.no_such` names no object",
    ]
    assert stale_pointers("holder", BROKEN_DOCSTRING) == [
        "holder:2 docs/gone.md is no page",
        "holder:2 docs/routing.md has no heading #nowhere",
        "holder:6 the README has no section 'Performance'",
    ]
