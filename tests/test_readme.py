"""The README's code and links work as written.

- A ```python block preceded by the line ``<!-- runnable -->`` is executed, alone, on the CPU: it must
  define its own inputs and run as a reader would paste it (it may assert its own result).
- Every other ```python block of the README and of the docs this checks needs a model, a trainer or a
  GPU; it must at least compile.
- Every relative link resolves, and every repository path named in backticks exists.

docs/api.md is left to its own tests (its blocks are signatures, not code).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "api.md")
PAGES = [README, *DOCS]
RUNNABLE_MARK = "<!-- runnable -->"
# Backticked paths inside the repository (TRL's own paths such as trl/kernels/... are not ours).
REPO_PATH = re.compile(r"`((?:grpo_kernels|grpo|tests|benchmarks|docs)/[\w./-]*)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def python_blocks(page: Path) -> list[tuple[int, bool, str]]:
    """(line number, runnable, source) of each ```python block of ``page``."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start = i
            previous = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            i += 1
            body = []
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            if i == len(lines):
                raise AssertionError(f"{page.name}:{start + 1}: unterminated ```python block")
            blocks.append((start + 1, previous == RUNNABLE_MARK, "\n".join(body) + "\n"))
        i += 1
    return blocks


RUNNABLE = [(ln, src) for ln, runnable, src in python_blocks(README) if runnable]
COMPILE_ONLY = [(page, ln, src) for page in PAGES for ln, runnable, src in python_blocks(page) if not runnable]


def test_the_readme_has_runnable_blocks():
    """The API block and the drop-in block are marked runnable, so the test below cannot pass empty."""
    assert len(RUNNABLE) >= 2, f"expected the API and drop-in blocks marked {RUNNABLE_MARK!r}, found {len(RUNNABLE)}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("line, source", RUNNABLE, ids=[f"README.md:{ln}" for ln, _ in RUNNABLE])
def test_runnable_block_runs(line, source):
    torch.manual_seed(0)
    code = compile(source, f"README.md:{line}", "exec")
    namespace: dict = {"__name__": "__readme__"}
    exec(code, namespace)  # noqa: S102 -- the README's own code, as a reader runs it
    loss = namespace.get("out").loss if "out" in namespace else None
    assert loss is None or torch.isfinite(loss), f"README.md:{line}: the block's loss is {loss}"


@pytest.mark.parametrize(
    "page, line, source", COMPILE_ONLY, ids=[f"{p.relative_to(ROOT)}:{ln}" for p, ln, _ in COMPILE_ONLY]
)
def test_other_blocks_compile(page, line, source):
    compile(source, f"{page.relative_to(ROOT)}:{line}", "exec")


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_and_paths_exist(page):
    text = page.read_text(encoding="utf-8")
    missing = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        if not (page.parent / target.split("#", 1)[0]).exists():
            missing.append(f"link {target}")
    for path in REPO_PATH.findall(text):
        if not (ROOT / path).exists():
            missing.append(f"path {path}")
    assert not missing, f"{page.relative_to(ROOT)} names what does not exist: {missing}"
