"""What every SpecError of the spec language must look like (shared by the dsl tests)."""
from __future__ import annotations

import re


import mixc
from mixc.derive.plan import derive

# Words a user never wrote: lark's terminal names, Python internals, our own file names.
_TERMINAL_WORDS = re.compile(
    r"\$END|__ANON|\b(?:COMMA|LSQB|RSQB|LPAR|RPAR|LBRACE|RBRACE|EQUAL|PLUS|MINUS|STAR|SLASH|"
    r"NAME|NUMBER|COMMENT|WS|Token|Tree|UnexpectedToken|UnexpectedCharacters|UnexpectedEOF|"
    r"LarkError)\b")
_INTERNAL = ("Traceback", ".py", "mixc/dsl", "mixc/derive", "lark")


def internal_words(text: str) -> list[str]:
    """The internal words in `text` (empty when it is in the user's words)."""
    found = [m.group(0) for m in _TERMINAL_WORDS.finditer(text)]
    return found + [w for w in _INTERNAL if w in text]


def assert_user_words(err: mixc.SpecError) -> None:
    """The message and notes (not the echoed source line) use only the user's words."""
    for text in (err.message, *err.notes):
        bad = internal_words(text)
        assert not bad, f"internal words {bad} in: {text!r}"


def assert_located(err: mixc.SpecError, text: str) -> None:
    """The error points inside `text`, or is a whole-file error with no span."""
    assert isinstance(err.message, str) and err.message
    if err.span is None:
        return
    lines = text.split("\n")
    assert 1 <= err.line <= len(lines), (err.line, len(lines), str(err))
    assert 1 <= err.column <= len(lines[err.line - 1].rstrip("\r")) + 1, (err.line, err.column, str(err))
    rendered = str(err)
    assert rendered.startswith(f"{err.filename}:{err.line}:{err.column}: error: "), rendered


def parse_and_derive(text: str, filename: str = "fuzz.mix"):
    """Parse, then derive under the default flags and with each flag flipped. Returns the
    SpecError raised (checked to be well-formed) or None; anything else propagates."""
    try:
        mixer = mixc.parse(text, filename)
        derive(mixer)
        for flag in mixer.flags:
            derive(mixer, {flag.name: not flag.default})
    except mixc.SpecError as err:
        assert_located(err, text)
        assert_user_words(err)
        return err
    return None
