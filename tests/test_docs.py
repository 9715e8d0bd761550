"""The user pages (README.md and docs/*.md; docs/dev/ is the developers' record) hold only what
is true and runs:

* every ```python block names, on the line before it, the file in examples/ that holds it
  (``<!-- example: examples/NAME.py -->``), and appears there line for line; those files run
  in tests/test_examples.py, so a page's code that breaks fails the suite;
* relative links reach an existing file, and a heading there when they name one;
* the scripts/ and examples/ paths and the MPIDDP_* variables the pages name exist;
* no commit hashes, scratch paths (/tmp) or run histories: those go to docs/dev/.
"""
from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from mpiddp.config import SCRIPT_VARIABLES, env_name, setting_fields

ROOT = Path(__file__).resolve().parents[1]
USER_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
ALL_PAGES = USER_PAGES + sorted((ROOT / "docs" / "dev").glob("*.md"))
FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
EXAMPLE_MARK = re.compile(r"<!--\s*example:\s*(\S+)\s*-->")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
KNOWN_VARIABLES = {env_name(f.name) for f in setting_fields()} | set(SCRIPT_VARIABLES)


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def code_blocks(text: str):
    """(language, first line number, lines, the line before the fence) of each fenced block."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening and opening.group(2) is not None:
            start = i
            i += 1
            while i < len(lines) and not re.match(r"^\s*```\s*$", lines[i]):
                i += 1
            yield (opening.group(2), start + 1, lines[start + 1:i],
                   lines[start - 1] if start else "")
        i += 1


def prose(text: str) -> str:
    """The page without its fenced code blocks (links and words only)."""
    return re.sub(r"```.*?```", "", text, flags=re.S)


def contains_run(haystack: list[str], needle: list[str]) -> bool:
    """Whether ``needle`` is a contiguous run of ``haystack``, all of it indented alike there
    (a block may show the body of a function); trailing blanks ignored."""
    hay = [line.rstrip() for line in haystack]
    need = [line.rstrip() for line in needle]
    for i in range(len(hay) - len(need) + 1):
        indent = hay[i][:len(hay[i]) - len(hay[i].lstrip())]
        if all(h == (indent + n if n else "") for h, n in zip(hay[i:i + len(need)], need)):
            return True
    return False


@pytest.mark.parametrize("page", USER_PAGES, ids=page_id)
def test_python_blocks_are_examples_that_run(page: Path):
    for language, line, block, before in code_blocks(page.read_text()):
        if language != "python":
            continue
        where = f"{page_id(page)}:{line}"
        mark = EXAMPLE_MARK.search(before)
        assert mark, f"{where}: a python block needs <!-- example: examples/NAME.py --> " \
                     "on the line before it (the file in examples/ that runs it)"
        example = ROOT / mark.group(1)
        assert example.parent == ROOT / "examples" and example.exists(), \
            f"{where}: {mark.group(1)} is not a file in examples/"
        body = textwrap.dedent("\n".join(block)).splitlines()
        assert contains_run(example.read_text().splitlines(), body), \
            f"{where}: the block is not in {mark.group(1)} as it stands (copy it from there)"


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[`*]|<[^>]+>", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found, seen = set(), {}
    for line in prose(page.read_text()).splitlines():
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            base = slug(heading.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


@pytest.mark.parametrize("page", ALL_PAGES, ids=page_id)
def test_relative_links_resolve(page: Path):
    broken = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"^[a-z]+:", target) or target.startswith("mailto"):
            continue                                   # a web address
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor.lower() not in anchors(dest):
            broken.append(f"{target} (no heading with that anchor)")
    assert not broken, f"{page_id(page)}: broken links: {broken}"


@pytest.mark.parametrize("page", USER_PAGES, ids=page_id)
def test_named_files_and_settings_exist(page: Path):
    text = page.read_text()
    missing = sorted({path for path in re.findall(r"(?<![\w/.-])((?:scripts|examples)/[\w./-]+)",
                                                  text)
                      if not (ROOT / path.rstrip(".")).exists()})
    assert not missing, f"{page_id(page)} names files that do not exist: {missing}"
    # (A quoted "unknown setting MPIDDP_X" warning shows a misspelt name on purpose.)
    unknown = sorted(set(re.findall(r"(?<!unknown setting )\bMPIDDP_[A-Z_]*[A-Z]\b", text))
                     - KNOWN_VARIABLES)
    assert not unknown, f"{page_id(page)} names settings mpiddp does not have: {unknown}"


# A hexadecimal word of 7-40 characters with both a digit and a letter: a commit hash.
COMMIT = re.compile(r"(?<![\w/.-])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w-])")


@pytest.mark.parametrize("page", USER_PAGES, ids=page_id)
def test_user_pages_hold_no_lab_notes(page: Path):
    text = page.read_text()
    assert not COMMIT.findall(text), f"{page_id(page)}: commit hashes {COMMIT.findall(text)}"
    scratch = [line for line in text.splitlines() if "/tmp/" in line]
    assert not scratch, f"{page_id(page)}: scratch paths belong in docs/dev/: {scratch[:3]}"


def test_every_example_is_shown_or_run_by_a_page():
    """No orphan: each file in examples/ is named by a user page."""
    text = "\n".join(page.read_text() for page in USER_PAGES)
    orphans = [example.name for example in sorted((ROOT / "examples").glob("*.py"))
               if f"examples/{example.name}" not in text]
    assert not orphans, f"examples no user page names: {orphans}"


def test_the_versions_setup_cfg_claims_are_the_ones_tested():
    """setup.cfg claims the oldest Python and torch the suite runs with here (CI): a claim
    of an older one would be untested."""
    import sys

    import torch

    text = (ROOT / "setup.cfg").read_text()
    python = re.search(r"python_requires = >=(\d+)\.(\d+)", text).groups()
    assert tuple(map(int, python)) == sys.version_info[:2], python
    claimed = re.search(r"torch>=(\d+)\.(\d+)", text).groups()
    running = re.match(r"(\d+)\.(\d+)", torch.__version__).groups()
    assert claimed == running, f"setup.cfg claims torch>={'.'.join(claimed)}, " \
                               f"the suite runs {torch.__version__}"
