"""Content-hashed cache of generated modules, and their import.

The key hashes the spec text, the flags, the mixc version, the Triton version and the
code generator's own sources, so a new mixc or Triton never loads stale code. Writes are
atomic (a temporary file in the same folder, then os.replace), so processes compiling
the same spec at once each see either nothing or a whole file."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
import warnings
from functools import lru_cache
from pathlib import Path

import triton

from .. import __version__
from ..derive.plan import Plan

CODEGEN_DIR = Path(__file__).resolve().parent.parent / "codegen"


@lru_cache(maxsize=1)
def _codegen_fingerprint() -> str:
    h = hashlib.sha256()
    for p in sorted(CODEGEN_DIR.rglob("*")):
        if p.is_file() and p.suffix in (".py", ".j2"):
            h.update(p.name.encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


def cache_key(plan: Plan) -> str:
    h = hashlib.sha256()
    for part in (plan.ir.source.text, repr(plan.flags), __version__, triton.__version__, _codegen_fingerprint()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


def cache_dir() -> Path:
    """$MIXC_CACHE_DIR, else ~/.cache/mixc; a temporary folder (with a warning) if unwritable."""
    root = Path(os.environ.get("MIXC_CACHE_DIR") or Path.home() / ".cache" / "mixc")
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".probe-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
        return root
    except OSError as err:
        fallback = Path(tempfile.gettempdir()) / "mixc-cache"
        fallback.mkdir(parents=True, exist_ok=True)
        warnings.warn(f"mixc cache folder {root} is not writable ({err.strerror}); using {fallback}",
                      stacklevel=3)
        return fallback


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def module_path(plan: Plan) -> Path:
    return cache_dir() / f"{plan.name}-{cache_key(plan)}.py"


_FOOTER = "# mixc checksum sha256 "


def _checksum(body: str) -> str:
    return hashlib.sha256(body.encode()).hexdigest()


def is_intact(path: Path) -> bool:
    """A cache entry is whole when its last line is the checksum of everything before it."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    body, sep, last = text.rstrip("\n").rpartition("\n")
    return bool(sep) and last == _FOOTER + _checksum(body + "\n")


def ensure_source(plan: Plan) -> Path:
    """The generated module's file; written (again) if it is missing, truncated or corrupted."""
    from ..codegen.module import generate
    path = module_path(plan)
    if path.is_file() and is_intact(path):
        return path
    body = generate(plan)
    body = body if body.endswith("\n") else body + "\n"
    write_atomic(path, body + _FOOTER + _checksum(body) + "\n")
    return path


def interpreting() -> bool:
    """Triton's interpreter (kernels on CPU tensors) is on. It must be chosen before Triton is
    first imported (its standard library is jit-compiled at import), so it is read, not set."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_MODULES: dict[str, object] = {}


def load_module(plan: Plan):
    """Import the generated module of a plan (once per process)."""
    path = ensure_source(plan)
    if str(path) not in _MODULES:
        name = f"mixc_generated.{path.stem.replace('-', '_')}"
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        _MODULES[str(path)] = mod
    return _MODULES[str(path)]
