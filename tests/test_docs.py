"""The README and the guide in docs/ give only commands the tests run, and their links lead somewhere.

The convention (docs/README.md, "The commands in these pages"): every command in a ```bash block
is run by a test (an example command of tests/test_examples.py, or the Quick start's lines, which
.ci/run runs), or follows a ``# needs ...`` comment in its block that names hardware this machine
lacks (GPUs, several machines, a SLURM cluster, a Mac). A ``$ cadence ...`` transcript whose
``--config`` files are in the repository prints what the page shows. Every relative link resolves
to a file and, with a ``#fragment``, to a heading of that file.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from test_examples import COMMANDS, DIGITS_SCRIPT
from trainer.cli import main

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: The Quick start's test line, which .ci/run runs verbatim.
CI_TEST_LINE = 'python -m pip install -q -e ".[test]" && python -m pytest'
#: The Quick start's install: the install .ci/run makes before that line, without the test extras.
INSTALL = "python -m pip install -e ."
#: What a ``# needs`` comment must name.
HARDWARE = re.compile(r"GPU|machine|node|SLURM|Mac")

TRANSCRIPT = re.compile(r"^\$ (cadence .*)\n((?:(?!\$ ).*\n)*)", re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.M)


def relative(page: Path) -> str:
    return str(page.relative_to(ROOT))


def split_blocks(text: str) -> tuple[str, list[tuple[str, str]]]:
    """``text`` without its fenced code blocks, and the blocks as (language, body)."""
    prose, blocks, language, body = [], [], None, []
    for line in text.splitlines(keepends=True):
        if line.startswith("```") and language is None:
            language, body = line[3:].strip(), []
        elif line.startswith("```"):
            blocks.append((language, "".join(body)))
            language = None
        elif language is None:
            prose.append(line)
        else:
            body.append(line)
    assert language is None, "a code block is not closed"
    return "".join(prose), blocks


def bash_commands(text: str) -> list[tuple[str, str | None]]:
    """Each command of the ```bash blocks in ``text`` (continued lines joined, comments dropped),
    with the ``# needs ...`` line it follows in its block, or None."""
    commands = []
    for language, block in split_blocks(text)[1]:
        if language != "bash":
            continue
        needs = None
        for line in re.sub(r"\s*\\\n\s*", " ", block).splitlines():
            line = line.strip()
            if line.startswith("# needs"):
                needs = line
            elif line and not line.startswith("#"):
                commands.append((re.split(r"\s+#\s", line)[0].strip(), needs))
    return commands


def is_run_by_a_test(command: str) -> bool:
    if command == CI_TEST_LINE:
        return True
    return all(part in COMMANDS or part == INSTALL for part in command.split(" && "))


def github_anchors(text: str) -> set[str]:
    """The fragment GitHub gives each heading of a Markdown page (lower case, punctuation dropped,
    spaces as hyphens; a repeated heading gets -1, -2, ...)."""
    anchors: set[str] = set()
    for _, title in HEADING.findall(split_blocks(text)[0]):
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        candidate, count = slug, 0
        while candidate in anchors:
            count += 1
            candidate = f"{slug}-{count}"
        anchors.add(candidate)
    return anchors


def test_every_command_in_the_docs_is_run_by_a_test_or_marked_as_needing_hardware():
    unexplained, vague = [], []
    for page in PAGES:
        for command, needs in bash_commands(page.read_text()):
            if needs is not None:
                if not HARDWARE.search(needs):
                    vague.append(f"{relative(page)}: {needs}")
            elif not is_run_by_a_test(command):
                unexplained.append(f"{relative(page)}: {command}")
    assert not unexplained, ("commands no test runs; run them in tests/test_examples.py (COMMANDS), or put a "
                             "'# needs <hardware>' line before them:\n" + "\n".join(unexplained))
    assert not vague, "a '# needs' line that names no hardware (GPU, machine, node, SLURM, Mac):\n" + "\n".join(vague)


def test_every_command_the_example_tests_run_is_in_the_docs():
    documented = {command for page in PAGES for command, _ in bash_commands(page.read_text())}
    documented |= {part for command in documented for part in command.split(" && ")}
    assert set(COMMANDS) <= documented, set(COMMANDS) - documented


def test_the_quick_start_gives_the_install_and_the_test_line_that_ci_runs():
    quick_start = (ROOT / "README.md").read_text().split("## Quick start")[1].split("\n## ")[0]
    assert [command for command, _ in bash_commands(quick_start)] == [f"{INSTALL} && {DIGITS_SCRIPT}", CI_TEST_LINE]
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert CI_TEST_LINE in ci  # verbatim; it installs the package as INSTALL does, with the test extras


def test_the_command_line_transcripts_on_the_examples_print_what_the_docs_show(monkeypatch):
    monkeypatch.chdir(ROOT)  # the transcripts' paths are relative to the repository
    shown = []
    for page in PAGES:
        for _, block in split_blocks(page.read_text())[1]:
            for command, output in TRANSCRIPT.findall(block):
                words = shlex.split(command)
                configs = [words[i + 1] for i, word in enumerate(words) if word == "--config"]
                if configs and all((ROOT / config).is_file() for config in configs):
                    shown.append((relative(page), words, output.strip()))
    assert shown
    for page, words, output in shown:  # each fails before anything is built or written
        with pytest.raises(SystemExit) as error:
            main(words[1:])
        assert str(error.value.code) == output, f"{page}: $ {shlex.join(words)}"


def test_every_relative_link_leads_to_a_file_and_heading_that_exist():
    broken = []
    for page in PAGES:
        for target in LINK.findall(split_blocks(page.read_text())[0]):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, fragment = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{relative(page)}: {target} (no such file)")
            elif fragment and file.suffix == ".md" and fragment not in github_anchors(file.read_text()):
                broken.append(f"{relative(page)}: {target} (no such heading in {relative(file)})")
    assert not broken, "\n".join(broken)


def test_the_docs_index_links_every_page_and_the_readme_stays_short():
    index = (ROOT / "docs" / "README.md").read_text()
    pages = {page.name for page in PAGES if page.parent.name == "docs" and page.name != "README.md"}
    assert pages and pages <= set(LINK.findall(index)), pages - set(LINK.findall(index))
    readme = (ROOT / "README.md").read_text().splitlines()
    assert len(readme) <= 200, f"README.md has {len(readme)} lines: move the details into docs/"
