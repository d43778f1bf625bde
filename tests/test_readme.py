"""The Python examples of the README and of every documentation page run as written, and the
README's commands are the ones CI runs.

Every ```python block of ``README.md`` and ``docs/**/*.md`` runs in a subprocess, in a fresh
temporary directory. A block that cannot run here (it needs a GPU, verl's trainer, a server)
says so in the Markdown, on the line right before its fence::

    <!-- not-run: needs a GPU -->
    ```python

and is only compiled. Blocks that are not Python at all use ```text.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = (ROOT / "README.md").read_text()

NOT_RUN = re.compile(r"^\s*<!--\s*not-run:\s*(?P<why>.*?)\s*-->\s*$")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


@dataclass(frozen=True)
class Block:
    page: str            # "README.md", or the page's path under docs/ ("guides/proxy.md")
    index: int           # the block's number among the page's Python blocks
    line: int            # the line of its opening fence (1-based)
    code: str
    not_run: str | None  # why it does not run, from its <!-- not-run: ... --> marker

    @property
    def id(self) -> str:
        return f"{self.page}-block{self.index}"


def python_blocks(text: str, page: str) -> list[Block]:
    """The fenced ```python blocks of one Markdown page, in order, dedented (a block may sit
    in a list item or an admonition)."""
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence = len(opening["indent"]), opening["fence"]
        info = opening["info"].strip().split()
        body: list[str] = []
        j = i + 1
        while j < len(lines):
            closing = FENCE.match(lines[j])
            if (closing and closing["fence"].startswith(fence) and not closing["info"].strip()
                    and len(closing["indent"]) <= indent):
                break
            body.append(lines[j][indent:] if lines[j][:indent].isspace() else lines[j].lstrip()
                        if indent else lines[j])
            j += 1
        if info and info[0] == "python":
            marker = NOT_RUN.match(lines[i - 1]) if i > 0 else None
            blocks.append(Block(page, len(blocks), i + 1, "\n".join(body) + "\n",
                                marker["why"] if marker else None))
        i = j + 1
    return blocks


PAGES = {"README.md": README} | {
    path.relative_to(DOCS).as_posix(): path.read_text() for path in sorted(DOCS.rglob("*.md"))}
BLOCKS = [block for page, text in PAGES.items() for block in python_blocks(text, page)]
RUN = [block for block in BLOCKS if block.not_run is None]

# An example that starts a Ray cluster runs in the Ray group, one cluster at a time
# (tests/conftest.py).
RAY = pytest.mark.xdist_group("ray")
PARAMS = [pytest.param(block, id=block.id,
                       marks=[RAY] if re.search(r"\b[Rr]ay", block.code) else [])
          for block in RUN]


def policy_earns_its_reward(stdout: str) -> None:
    """The set-up guide's tiny-policy example: on the rows it was trained on, the shipped
    policy calls the calculator and earns a reward well above a bare prompt's few percent."""
    found = re.search(r"reward mean ([\d.]+), tool calls (\d+)", stdout)
    assert found, stdout
    assert float(found[1]) >= 0.15 and int(found[2]) >= 40, stdout


OUTPUT_CHECKS = {("guides/getting-started.md", "tiny_policy_dir()"): policy_earns_its_reward}
"""What an example must print, beyond running: (page, a string of its code) -> a check."""


def output_check(block: Block) -> Callable[[str], None] | None:
    return next((check for (page, marker), check in OUTPUT_CHECKS.items()
                 if block.page == page and marker in block.code), None)


@pytest.mark.parametrize("block", PARAMS)
def test_python_examples_run(tmp_path, block):
    proc = subprocess.run(
        [sys.executable, "-c", block.code], capture_output=True, text=True, timeout=110,
        cwd=tmp_path
    )
    assert proc.returncode == 0, f"{block.page}:{block.line}\n{proc.stderr[-2000:]}"
    check = output_check(block)
    if check is not None:
        check(proc.stdout)


def test_blocks_marked_not_run_compile_and_say_why():
    for block in BLOCKS:
        if block.not_run is not None:
            assert block.not_run, f"{block.page}:{block.line}: say why it does not run"
            compile(block.code, f"{block.page}:{block.line}", "exec")


def test_examples_do_not_hide_the_package():
    """A variable named ``pipeline`` would shadow the package (``pipeline.asyncio_run``)."""
    assert len(BLOCKS) >= 5
    for block in BLOCKS:
        assert not re.search(r"^\s*pipeline\s*=", block.code, flags=re.M), block.id


def test_every_example_of_the_former_readme_still_runs():
    """The README's 14 examples moved into the guides (issue 35, item 6): each page that got
    some runs at least that many, none of them marked not-run."""
    ran = {page: sum(1 for b in RUN if b.page == page) for page in PAGES}
    moved = {"guides/getting-started.md": 1, "guides/compose-stages.md": 1,
             "guides/engines.md": 1, "guides/tools.md": 2, "guides/diagnostics.md": 2,
             "guides/proxy.md": 1, "guides/trainer.md": 1, "guides/verl.md": 1,
             "guides/streaming.md": 1, "guides/judging.md": 2, "guides/ray.md": 1}
    assert sum(moved.values()) == 14  # the README's Python blocks before the move
    for page, count in moved.items():
        assert ran.get(page, 0) >= count, (page, ran.get(page, 0))


def test_the_block_reader_finds_marked_indented_and_other_blocks():
    page = "\n".join([
        "text", "```python", "a = 1", "```", "<!-- not-run: needs a GPU -->", "```python",
        "import vllm", "```", "```text", "not = python", "```", "- item", "",
        "    ```python", "    b = [", "        2]", "    ```", "````markdown", "```python",
        "inside another fence", "```", "````"])
    blocks = python_blocks(page, "x.md")
    assert [(b.index, b.line, b.code, b.not_run) for b in blocks] == [
        (0, 2, "a = 1\n", None), (1, 6, "import vllm\n", "needs a GPU"),
        (2, 14, "b = [\n    2]\n", None)]
    assert blocks[1].id == "x.md-block1"


def test_ci_runs_the_readme_test_command():
    commands = re.findall(r"```bash\n(.*?)\n```", README, flags=re.S)
    test_command = next(c for c in commands if "pytest" in c)
    assert test_command in (ROOT / ".ci" / "run").read_text()
