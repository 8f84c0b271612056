#!/usr/bin/env python3
"""Stitch the benchmark summaries into the docs.

Each benchmark script writes a Markdown summary to ``benchmarks/results/*.md``.
A docs page names the summaries it shows between two markers::

    <!-- BEGIN results benchmarks/results/engine.md -->
    (generated: replaced on every run)
    <!-- END results -->

and this script replaces what lies between them with the summary, so the
numbers on the page are the numbers the last run wrote, never copied by hand.
Headings in a summary are moved three levels down (a summary's ``#`` title
sits under the page's ``###``), and a leading HTML comment, where a script
keeps the command it ran, is shown as a quote.

    python3 tools/perf_tables.py           # rewrite docs/*.md in place
    python3 tools/perf_tables.py --check   # exit 1 if a page is stale (tests/test_docs.py)

Standard library only: it runs before anything is installed.
"""
import argparse
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
RESULTS = ROOT / "benchmarks" / "results"

BLOCK = re.compile(r"(<!-- BEGIN results (?P<src>\S+) -->\n)(?P<body>.*?)(<!-- END results -->)", re.S)
COMMENT = re.compile(r"\A<!--(?P<text>.*?)-->\s*", re.S)


def render(src: Path, page: Path) -> str:
    """The generated text for one summary, as it appears on ``page``."""
    text = src.read_text(encoding="utf-8")
    out = []
    m = COMMENT.match(text)
    if m:  # the command a script recorded: visible, not hidden in a comment
        out += ["> " + " ".join(m.group("text").split()), ""]
        text = text[m.end():]
    for line in text.rstrip().splitlines():
        h = re.match(r"(#{1,6}) ", line)
        out.append("#" * min(6, len(h.group(1)) + 3) + line[len(h.group(1)):] if h else line.rstrip())
    rel = os.path.relpath(src, page.parent).replace(os.sep, "/")
    out += ["", f"<sub>Generated from [{src.relative_to(ROOT).as_posix()}]({rel}) by "
                "`python3 tools/perf_tables.py`; do not edit by hand.</sub>"]
    return "\n".join(out) + "\n"


def stitch(page: Path) -> tuple[str, list[str]]:
    """The page with every block regenerated, and the summaries it names."""
    text = page.read_text(encoding="utf-8")
    used = []

    def one(m: re.Match) -> str:
        src = ROOT / m.group("src")
        if not src.is_file():
            raise SystemExit(f"{page.relative_to(ROOT)}: no such summary: {m.group('src')}")
        used.append(m.group("src"))
        return m.group(1) + render(src, page) + m.group(4)

    return BLOCK.sub(one, text), used


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a page is stale")
    a = ap.parse_args(argv)
    stale, used, pages = [], set(), ""
    for page in sorted(DOCS.glob("*.md")):
        new, names = stitch(page)
        used.update(names)
        pages += new
        if new != page.read_text(encoding="utf-8"):
            stale.append(page.relative_to(ROOT).as_posix())
            if not a.check:
                page.write_text(new, encoding="utf-8")
    shown = {p.relative_to(ROOT).as_posix() for p in RESULTS.rglob("*.md")}
    for name in sorted(n for n in shown - used if n not in pages):
        print(f"note: {name} is on no docs page (neither stitched in nor named)", file=sys.stderr)
    if a.check and stale:
        print("stale: " + ", ".join(stale) + " (run python3 tools/perf_tables.py)", file=sys.stderr)
        return 1
    if not a.check:
        print("rewrote " + (", ".join(stale) if stale else "nothing (up to date)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
