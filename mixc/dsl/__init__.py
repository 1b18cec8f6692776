"""The spec language: text -> MixerIR."""
from __future__ import annotations

from pathlib import Path

from .check import check
from .errors import SpecError, Source, Span, did_you_mean
from .ir import MixerIR
from .parser import MAX_SPEC_CHARS, parse_tree

SPEC_DIR = Path(__file__).resolve().parent.parent / "specs"


def parse(text: str, filename: str = "<spec>") -> MixerIR:
    """Parse and check a spec; raises SpecError with file:line:column on any problem."""
    # A byte-order mark (Windows editors write one) is not part of the spec: columns count
    # from the first character after it, as the editor shows them.
    return check(parse_tree(text.removeprefix("\ufeff"), filename))


def library_names(kind: str | None = None) -> list[str]:
    """The library specs; kind "recurrent" (a state and its update) or "sequence" (conv, mix,
    attend) keeps those only."""
    names = sorted(p.stem for p in SPEC_DIR.glob("*.mix"))
    if kind is None:
        return names
    if kind not in ("recurrent", "sequence"):
        raise ValueError(f"kind: expected 'recurrent' or 'sequence', got {kind!r}")
    return [n for n in names if load_ir(n).is_sequence == (kind == "sequence")]


def read_spec(name_or_path: str | Path) -> Source:
    """A library spec by name ('gla') or a .mix file by path."""
    text_name = str(name_or_path)
    path = Path(text_name)
    if path.suffix == ".mix" or path.exists() or "/" in text_name:
        if not path.is_file():
            raise SpecError(f"no spec file at '{text_name}'")
        try:
            # the length limit before the file is read: a 200 MB file must not be read whole
            # (UTF-8 takes at most 4 bytes a character, and a byte-order mark 3)
            if path.stat().st_size > 4 * MAX_SPEC_CHARS + 3:
                raise SpecError(f"spec file '{text_name}' is too long ({path.stat().st_size} bytes; the limit is "
                                f"{MAX_SPEC_CHARS} characters)")
            return Source(path.read_text(encoding="utf-8-sig"), str(path))
        except UnicodeDecodeError as e:
            raise SpecError(f"spec file '{text_name}' is not UTF-8 text ({e.reason} at byte {e.start})") from None
    lib = SPEC_DIR / f"{text_name}.mix"
    if not lib.is_file():
        raise SpecError(f"no library spec named '{text_name}'{did_you_mean(text_name, library_names())}; "
                        f"library specs: {', '.join(library_names())}")
    return Source(lib.read_text(encoding="utf-8"), f"<library>/{lib.name}")


def load_ir(name_or_path: str | Path) -> MixerIR:
    src = read_spec(name_or_path)
    return parse(src.text, src.filename)


__all__ = ["SpecError", "Source", "Span", "MixerIR", "parse", "read_spec", "load_ir", "library_names", "SPEC_DIR"]
