"""The Python snippets of README.md and docs/ run in the test suite (Sybil), so that the docs cannot drift.

Every ```python block of those pages runs when plain `pytest` runs (pyproject's testpaths), in order, in
one namespace per page (a page reads top to bottom), in a fresh temporary working directory per page (so
`torch.save(..., "ckpt.pt")` writes nowhere else), torch seeded with 0. The block's info string may add:

  ranks=N       run it on N gloo ranks on the CPU (forked, one thread each: distopt.testing.run_ranks), in
                an initialised default process group with torchrun's environment variables set (RANK,
                LOCAL_RANK, WORLD_SIZE, ...: what the training frameworks read), each rank starting from
                a copy of the page's namespace (what the block defines stays on the ranks); marked `ranks`
                where pyproject registers that marker
  requires=A,B  skip it unless each is there: `cuda` (a GPU; the item is also marked `cuda`, so that
                `pytest -m cuda` selects it), or a module's name (an optional framework)
  rank-setup    (an invisible block) not run here: it runs first on the ranks of every later ranks=N
                block of the page, until the next rank-setup (the model and optimizer those blocks use)

A block that skips is still compiled, so a syntax error fails. Setup a reader need not see (a small
model, a batch) goes in Sybil's invisible block, which runs like a visible one:

  <!-- invisible-code-block: python
  model = torch.nn.Linear(4, 2)
  -->

A block in another spelling of Python (py, python3, pycon) is an error rather than silently not run.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent

# pytest's default ('prepend') import mode put the repository root first on sys.path to import this file,
# which would make `import distopt` the checkout's sources rather than the installed distopt the suite tests
# (CI installs the wheel; the Makefile runs .venv/bin/pytest for that reason). Off again, unless no other
# distopt can be found.
if sys.path and sys.path[0] == str(ROOT):
    del sys.path[0]
    if importlib.util.find_spec("distopt") is None:
        sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

# The ranks of a `ranks=N` block are forked. torch's autograd engine decides at a process's first backward
# whether it starts device threads (which make a forked child's backward fail): one now, as tests/ does.
_x = torch.ones(1, requires_grad=True)
(_x * 2).sum().backward()
del _x

RANK_SETUP = "__rank_setup__"  # the page namespace's key for the code of the last rank-setup block
SPELLINGS_NOT_RUN = {"py", "python3", "pycon", "ipython", "Python"}


def is_doc_page(path: Path) -> bool:
    path = path.resolve()
    docs = ROOT / "docs"
    in_docs = docs in path.parents and "_build" not in path.parts
    return path.suffix == ".md" and (path == ROOT / "README.md" or in_docs)


@dataclass(frozen=True)
class Options:
    ranks: int = 0
    requires: tuple[str, ...] = ()
    rank_setup: bool = False


def parse_options(info: str, where: str) -> Options:
    ranks, requires, rank_setup = 0, (), False
    for word in info.split():
        key, _, value = word.partition("=")
        if key == "ranks" and value.isdigit() and int(value) >= 1:
            ranks = int(value)
        elif key == "requires" and value:
            requires = tuple(value.split(","))
        elif word == "rank-setup":
            rank_setup = True
        else:
            raise ValueError(f"{where}: unknown snippet option {word!r} (ranks=N, requires=A,B, rank-setup)")
    if rank_setup and ranks:
        raise ValueError(f"{where}: a rank-setup block runs on the ranks of later blocks; it takes no ranks=N")
    return Options(ranks, requires, rank_setup)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def missing(requirement: str) -> str | None:
    """Why `requirement` is not met here, or None."""
    if requirement == "cuda":
        return None if torch.cuda.is_available() else "needs a CUDA GPU (none visible)"
    return None if importlib.util.find_spec(requirement) is not None else f"needs {requirement} (not installed)"


try:
    from sybil import Sybil
    from sybil.evaluators.python import pad
    from sybil.integration.pytest import SybilFile, SybilItem
    from sybil.parsers.abstract.lexers import LexerCollection
    from sybil.parsers.markdown.lexers import DirectiveInHTMLCommentLexer, FencedCodeBlockLexer
except ImportError:  # the suite without the docs' tool: each page is one skipped item that says why
    Sybil = None


if Sybil is not None:

    class SnippetParser:
        """Sybil parser: ```python fences (with the options above) and invisible-code-block comments."""

        def __init__(self) -> None:
            self.lexers = LexerCollection([
                FencedCodeBlockLexer(language=r"[^\n]*", mapping={"language": "info", "source": "source"}),
                DirectiveInHTMLCommentLexer(directive=r"invisible-code-block", arguments=r"[^\n]*",
                                            mapping={"arguments": "info", "source": "source"}),
            ])

        def __call__(self, document):
            for region in self.lexers(document):
                language, _, info = region.lexemes["info"].strip().partition(" ")
                where = f"{document.path}, line {document.text.count(chr(10), 0, region.start) + 1}"
                if language in SPELLINGS_NOT_RUN:
                    raise ValueError(f"{where}: a ```{language} block would not run: spell it ```python")
                if language != "python":
                    continue
                region.parsed = (region.lexemes["source"], parse_options(info, where))
                region.evaluator = evaluate
                yield region

    def evaluate(example) -> None:
        source, options = example.parsed
        code = compile(pad(source, example.line + source.line_offset), example.path, "exec", dont_inherit=True)
        reasons = [r for r in map(missing, options.requires) if r]
        if reasons:
            pytest.skip("; ".join(reasons))
        if options.rank_setup:
            example.namespace[RANK_SETUP] = code
        elif options.ranks:
            from distopt.testing import run_ranks

            namespace = example.namespace
            setup = namespace.get(RANK_SETUP)
            port = free_port()

            def on_rank(rank: int, world_size: int) -> None:
                os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                                  LOCAL_WORLD_SIZE=str(world_size), NODE_RANK="0", MASTER_ADDR="127.0.0.1",
                                  MASTER_PORT=str(port))
                scope = dict(namespace)
                if setup is not None:
                    exec(setup, scope)
                exec(code, scope)

            run_ranks(on_rank, world_size=options.ranks)
        else:
            exec(code, example.namespace)
            example.namespace.pop("__builtins__", None)

    class PageSetup:
        """Each page in a temporary working directory, with torch seeded; both undone after the page."""

        def __init__(self) -> None:
            self.saved: list[tuple[str, tempfile.TemporaryDirectory]] = []

        def setup(self, namespace: dict) -> None:
            tmp = tempfile.TemporaryDirectory(prefix="distopt-docs-")
            self.saved.append((os.getcwd(), tmp))
            os.chdir(tmp.name)
            torch.manual_seed(0)

        def teardown(self, namespace: dict) -> None:
            cwd, tmp = self.saved.pop()
            os.chdir(cwd)
            tmp.cleanup()

    _page = PageSetup()
    SNIPPETS = Sybil(parsers=[SnippetParser()], setup=_page.setup, teardown=_page.teardown, name="docs")

    def pytest_collect_file(file_path: Path, parent):
        if is_doc_page(file_path):
            return SybilFile.from_parent(parent, path=file_path, sybils=[SNIPPETS])
        return None

    def pytest_collection_modifyitems(config, items) -> None:
        # A `ranks` marker, where pyproject registers one (the tests' marker for forked gloo ranks), marks
        # the ranks=N blocks too, so that `-m 'not ranks'` deselects them with the tests.
        has_ranks_marker = any(m.split(":")[0].strip() == "ranks" for m in config.getini("markers"))
        for item in items:
            if isinstance(item, SybilItem) and isinstance(item.example.parsed, tuple):
                options = item.example.parsed[1]
                if "cuda" in options.requires:
                    item.add_marker(pytest.mark.cuda)
                if options.ranks and has_ranks_marker:
                    item.add_marker(pytest.mark.ranks)

else:

    class _NotRun(pytest.Item):
        def runtest(self) -> None:
            pytest.skip("the page's Python snippets need Sybil to run (pip install sybil)")

        def reportinfo(self):
            return self.path, 0, self.name

    class _Page(pytest.File):
        def collect(self):
            yield _NotRun.from_parent(self, name="snippets")

    def pytest_collect_file(file_path: Path, parent):
        if is_doc_page(file_path):
            return _Page.from_parent(parent, path=file_path)
        return None

