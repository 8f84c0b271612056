"""The docs stay true to the repository: the performance tables are the
benchmark summaries as the last runs wrote them (tools/perf_tables.py),
every relative link in the README and docs/ leads somewhere that exists,
and docs/server.md's route table names the server's routes and their
fields, no more and no fewer."""
import re
import subprocess
import sys

import pytest
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.S | re.M)
CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFDEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)


def _prose(text: str) -> str:
    """The text without code: a link inside a code span or block is an example."""
    return CODE.sub("", FENCE.sub("", text))


def _anchors(page: Path) -> set:
    """GitHub's anchors for a page's headings."""
    seen: dict = {}
    out = set()
    for line in FENCE.sub("", page.read_text(encoding="utf-8")).splitlines():
        m = re.match(r" {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_performance_tables_are_generated():
    """docs/performance.md holds what benchmarks/results/*.md say now."""
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "perf_tables.py"), "--check"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_relative_links_lead_to_files():
    broken = []
    for page in PAGES:
        text = _prose(page.read_text(encoding="utf-8"))
        for target in LINK.findall(text) + REFDEF.findall(text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)}: {target}"
            if not dest.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{where} (no such heading)")
    assert not broken, "\n".join(broken)


def test_readme_stays_a_front_door():
    """The README is short and sends the details to docs/."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move details to docs/"


def _route_table() -> list[tuple[list[tuple[str, str]], str]]:
    """docs/server.md's Routes table: per row, its (method, path) pairs and
    the text of its second cell.  ``POST /a``, ``/b`` is POST for both;
    "(also without `/v1`)" adds each path before it without its /v1."""
    text = (ROOT / "docs" / "server.md").read_text(encoding="utf-8")
    table = text.split("## Routes", 1)[1].split("\n\n", 2)[1]
    rows = []
    for line in table.splitlines()[2:]:
        first, what = [c.strip() for c in line.strip("|").split("|", 1)]
        pairs, method = [], None
        marker = "(also without `/v1`)"
        before = first.split(marker, 1)[0].count("`") // 2 if marker in first else 0
        for k, code in enumerate(re.findall(r"`([^`]+)`", first.replace(marker, ""))):
            bare = k < before
            m = re.fullmatch(r"(?:(GET|POST|PUT|DELETE) )?(/\S*)", code)
            if not m:
                continue
            method = m.group(1) or method
            path = m.group(2).replace("{id}", "{model_id:path}")
            pairs.append((method, path))
            if bare and path.startswith("/v1/"):
                pairs.append((method, path[3:]))
        rows.append((pairs, what.strip("| ")))
    return rows


def _bodies():
    """Each route's request body model (None: no body)."""
    from llamax.server.routes import router
    out = {}
    for r in router.routes:
        body = getattr(r, "body_field", None)
        model = body.field_info.annotation if body is not None else None
        for m in r.methods:
            out[(m, r.path)] = model
    return out


def test_route_table_names_every_route_and_only_routes():
    bodies = _bodies()
    documented = {p for pairs, _ in _route_table() for p in pairs}
    assert documented - set(bodies) == set(), "docs/server.md names routes the server does not have"
    assert set(bodies) - documented == set(), "routes docs/server.md's table does not name"


def test_route_table_fields_are_the_bodies_fields():
    """Every field a row names in backticks is a field of its routes'
    bodies, and every field of those bodies is named in the row (the
    values a field takes, such as `json_object`, are written after it in
    parentheses or as `field` (..., `value`) and are not fields)."""
    bodies = _bodies()
    wrong = []
    for pairs, what in _route_table():
        models = {bodies[p] for p in pairs if bodies.get(p) is not None}
        if not models:
            continue
        fields = set().union(*(m.model_fields for m in models))
        nested = {f"{f}.{g}" for m in models for f, info in m.model_fields.items()
                  for g in getattr(_model_of(info.annotation), "model_fields", {})}
        named = set()
        for code in re.findall(r"`([^`]+)`", re.sub(r"\([^()]*\)", "", what)):
            if re.fullmatch(r"[a-z_]+(\.[a-z_]+)?", code):
                named.add(code)
        wrong += [f"{pairs[0]}: `{c}` is no field of its body" for c in named - fields - nested]
        inside = set(re.findall(r"`([a-z_]+)`", what))
        wrong += [f"{pairs[0]}: field `{f}` is not in its row" for f in sorted(fields - inside)
                  if f not in _NO_EFFECT]
    assert not wrong, "\n".join(wrong)


# documented once, in the Fields paragraph: accepted, no effect
_NO_EFFECT = {"user", "metadata", "store", "service_tier", "model", "tools", "tool_choice",
              "parallel_tool_calls", "functions", "function_call", "reasoning_effort", "chat_template_kwargs"}


def _model_of(annotation):
    import typing
    for a in (annotation, *typing.get_args(annotation)):
        if hasattr(a, "model_fields"):
            return a
    return None


def test_fields_paragraph_names_fields():
    """The fields docs/server.md's Fields paragraph says are accepted exist,
    and the misspelling it gives as refused does not."""
    from llamax.server import protocol
    text = (ROOT / "docs" / "server.md").read_text(encoding="utf-8")
    para = text.split("**Fields.**", 1)[1].split("\n\n", 1)[0]
    fields = set(protocol.ChatCompletionRequest.model_fields)
    assert "misspelt `active_lora`" in para and "active_lora" not in fields
    for name in set(re.findall(r"`([a-z_]+)`", para)) - {"active_lora"}:
        assert name in fields, name
    assert _NO_EFFECT - {"model"} <= set(re.findall(r"`([a-z_]+)`", para))


def test_route_table_values_are_what_the_fields_take():
    """The values the table gives a field are those it takes: each
    `response_format` type listed works and one not listed is refused;
    `encoding_format`'s are its Literal's."""
    import typing

    import llamax
    from llamax.llama import _response_format_grammar
    from llamax.server import protocol
    what = " ".join(w for _, w in _route_table())
    listed = re.search(r"`response_format` \(chat: ([^)]*)\)", what).group(1)
    types = re.findall(r"`([a-z_]+)`", listed)
    assert types, listed
    specs = {"text": {}, "json_object": {}, "json_schema": {"json_schema": {"name": "x", "schema": {"type": "object"}}}}
    for t in types:
        _response_format_grammar(dict(specs[t], type=t))  # raises if refused
    assert set(types) == set(specs)
    with pytest.raises(llamax.InvalidArgumentError):
        _response_format_grammar({"type": "yaml"})
    enc = re.search(r"`encoding_format` ([a-z0-9]+) or ([a-z0-9]+)", what).groups()
    assert set(enc) == set(typing.get_args(protocol.EmbeddingRequest.model_fields["encoding_format"].annotation))
