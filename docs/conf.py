"""Sphinx configuration: the docs site of README.md, docs/ and benchmarks/README.md (Markdown, read by MyST),
with an API reference generated from the public names' docstrings (autodoc).

Built from the repository root, so that the links between those three places resolve as they do on a
code host:  sphinx-build -W --keep-going -c docs . build/docs/html   (`make docs`).
"""

import re

project = "distopt"
author = "the distopt authors"
copyright = "the distopt authors"

extensions = ["myst_parser", "sphinx.ext.autodoc"]
source_suffix = {".md": "markdown"}
root_doc = "docs/index"

# The source folder is the repository root: only these Markdown files are pages, and the folders that hold
# none are not walked.
include_patterns = ["README.md", "docs/**.md", "benchmarks/README.md", "csrc/README.md"]
exclude_patterns = [".*", "build", "build-*", "dist", "distopt", "tests", "examples", "tools",
                    "benchmarks/results", "*.egg-info"]

myst_heading_anchors = 4          # [text](page.md#a-heading) links, as code hosts make them
myst_enable_extensions = ["colon_fence"]

html_theme = "alabaster"
html_title = "distopt"
html_static_path: list[str] = []

default_role = "literal"          # `name` in a docstring is code, as ``name`` is
autodoc_member_order = "bysource"
autodoc_typehints = "signature"


# ---------------------------------------------------------------------------------------------------------------
# distopt's docstrings are prose written for help() and the source: ``literals``, and two indented forms that
# reStructuredText reads otherwise (as block quotes and definition lists that end without a blank line):
#
#   an option list, right under a line that ends with a colon:     a code example, after a blank line:
#     name=default: what it does, and                                  (blank line)
#       its continuation lines, indented further.                          opt = FusedAdam(params)
#
# This hook renders them as what they are, a bullet list (the name as a literal) and a literal block, without
# changing the docstrings. Anything else is left to reStructuredText, and its warnings fail the build.

_TERM = re.compile(r"^(?P<term>[A-Za-z_][\w.=()\[\], /'\"+-]{0,78}?):(?:\s+(?P<rest>.*))?$")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


_STARRED = re.compile(r"(?<![\w`*\\])(\*{1,2}[A-Za-z_]\w*)(?![\w*])")


def _literal_stars(line: str) -> str:
    """``*args`` and ``**kwargs`` outside literals as literals (reStructuredText would start emphasis)."""
    parts = line.split("``")
    return "``".join(_STARRED.sub(r"``\1``", p) if i % 2 == 0 else p for i, p in enumerate(parts))


def _item(first: str) -> str:
    text = first.strip()
    if text[:2] in ("* ", "- "):
        text = text[2:]
    m = _TERM.match(text)
    if m and "`" not in m["term"] and "*" not in m["term"] and not m["term"].endswith(" "):
        text = f"``{m['term']}``:" + (f" {m['rest']}" if m["rest"] else "")
    return f"- {text}"


def render_prose_docstring(lines: list[str]) -> list[str]:
    out: list[str] = []
    literal = None  # the indent of the line that opened a literal block or directive, while inside it
    above = ""      # the last non-blank line read
    i = 0
    while i < len(lines):
        line, prev = lines[i], lines[i - 1] if i else ""
        ind = _indent(line)
        if literal is not None and (not line.strip() or ind > literal):
            out.append(line)
            i += 1
            continue
        literal = None
        if line.strip() and prev.strip() and ind > _indent(prev) and prev.rstrip().endswith(":") \
                and not prev.rstrip().endswith("::"):
            # An option list: each line at this indent starts an item, deeper ones continue it.
            base, level = ind, " " * _indent(prev)
            out.append("")
            while i < len(lines) and lines[i].strip() and _indent(lines[i]) >= base:
                item = lines[i]
                text = _item(item) if _indent(item) == base else "  " + item.strip()
                out.append(level + _literal_stars(text))
                i += 1
            out.append("")
            above = lines[i - 1]
            continue
        if line.strip() and i and not prev.strip() and above.strip() and ind > _indent(above):
            # An indented block after a blank line: a code example.
            out[-1:] = ["", " " * _indent(above) + "::", ""]
            literal = _indent(above)
            out.append(line)
            above = line
            i += 1
            continue
        if line.rstrip().endswith("::") or line.lstrip().startswith(".. "):
            literal = ind
        else:
            line = _literal_stars(line)
        out.append(line)
        if line.strip():
            above = line
        i += 1
    return out


def _process_docstring(app, what, name, obj, options, lines):
    if name.startswith("distopt"):
        lines[:] = render_prose_docstring(lines)


def setup(app):
    app.connect("autodoc-process-docstring", _process_docstring)
