"""docs/language.md: every complete ```mix example parses and derives, and the error
examples are what mixc prints."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

import mixc
from mixc.derive.plan import derive

DOC = Path(__file__).resolve().parents[2] / "docs" / "language.md"
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def blocks(lang: str) -> list[str]:
    return [body for tag, body in BLOCK.findall(DOC.read_text(encoding="utf-8")) if tag == lang]


def complete(body: str) -> bool:
    """A whole spec (not a fragment): its first line that is not a comment is `mixer NAME`."""
    lines = [x.strip() for x in body.splitlines() if x.strip() and not x.strip().startswith("#")]
    return bool(lines) and lines[0].startswith("mixer ")


EXAMPLES = [b for b in blocks("mix") if complete(b)]


def test_the_doc_has_examples():
    assert len(EXAMPLES) >= 10


@pytest.mark.parametrize("body", EXAMPLES, ids=[re.search(r"mixer (\w+)", b).group(1) for b in EXAMPLES])
def test_example_parses_and_derives(body):
    m = mixc.parse(body, "docs/language.md")
    derive(m)
    for flag in m.flags:
        derive(m, {flag.name: not flag.default})


@pytest.mark.parametrize("spec", [
    "mixer m\n  dims   K, V\n  input  q[K], k[K], v[V]\n  state  S[K, V]\n  update S = S + kk * v\n  output o = q @ S\n",
    "mixer m\n  dims   K, V\n  input q[K] k[K]\n",
])
def test_error_examples_are_verbatim(spec):
    with pytest.raises(mixc.SpecError) as info:
        mixc.parse(spec, "bad.mix")
    assert str(info.value) + "\n" in blocks("text")
