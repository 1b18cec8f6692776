"""Content-hashed cache of generated modules, and their import.

The key hashes the spec text, the flags, the mixc version, the Triton version and the
code generator's own sources, so a new mixc or Triton never loads stale code. Writes are
atomic (a temporary file in the same folder, then os.replace), so processes compiling
the same spec at once each see either nothing or a whole file.

Trust (docs/reliability.md, "What the cache defends against"): a cached module is code this
process will run, so the cache only uses a folder this user owns that no one else can write
to, and only loads an entry that is a regular file owned by this user, writable by no one
else, whose checksum footer matches. The fallback for an unusable folder is a private
per-user folder in the system temp folder (0700, checked with lstat), never a shared path.
Each module is looked up once per plan and process: calls find it in a dict (no file-system
work, no hashing on the call path)."""
from __future__ import annotations

import hashlib
import linecache
import os
import shutil
import stat
import sys
import tempfile
import threading
import types
import warnings
from functools import lru_cache
from pathlib import Path

import triton

from .. import __version__, standalone
from ..derive.plan import Plan

# Everything a generated module is a function of besides the spec: the front end (the
# function registry lives in dsl), the class units (their kernel macros, chunk policies and
# hooks), the derivation (a stabilizer rewrite changes the kernels), the code generator and
# the kernels' argument lists (standalone/kernel_args.py: the signatures are printed from it).
# Hashing codegen alone kept serving modules from before a derive fix; leaving out classes
# kept serving kernels from before an edit of a class's macros.
PACKAGE_DIR = Path(__file__).resolve().parent.parent
GENERATOR_DIRS = tuple(PACKAGE_DIR / d for d in ("standalone", "dsl", "classes", "derive", "codegen"))
# a compiled module's runtime: the package `mixc compile -o DIR` copies beside the module
RUNTIME_DIR = Path(standalone.__file__).resolve().parent
CODEGEN_DIR = PACKAGE_DIR / "codegen"


@lru_cache(maxsize=1)
def _codegen_fingerprint() -> str:
    h = hashlib.sha256()
    for root in GENERATOR_DIRS:
        for p in sorted(root.rglob("*")):
            if p.is_file() and p.suffix in (".py", ".j2", ".lark"):
                h.update(str(p.relative_to(PACKAGE_DIR)).encode())
                h.update(p.read_bytes())
    return h.hexdigest()[:16]


def cache_key(plan: Plan) -> str:
    h = hashlib.sha256()
    for part in (plan.ir.source.text, repr(plan.flags), __version__, triton.__version__, _codegen_fingerprint()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


def _uid() -> int | None:
    return os.geteuid() if hasattr(os, "geteuid") else None


def untrusted_because(st: os.stat_result) -> str | None:
    """Why a file or folder with this stat is not this user's alone (None: it is): owned by
    another uid, or writable by group or others."""
    uid = _uid()
    if uid is not None and st.st_uid != uid:
        return f"is owned by uid {st.st_uid}, not by this user (uid {uid})"
    if st.st_mode & 0o022:
        return f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _folder_problem(path: Path, *, follow: bool) -> str | None:
    """Why path cannot hold this user's cache (None: it can). follow=False: a symlink is
    refused (the temp-folder fallback, where anyone may plant one)."""
    try:
        st = os.stat(path) if follow else os.lstat(path)
    except OSError as err:
        return f"is not writable ({err.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "is not writable (not a directory)"
    why = untrusted_because(st)
    if why is not None:
        return why
    if not os.access(path, os.W_OK | os.X_OK):    # no probe file: threads share nothing
        return "is not writable (permission denied)"
    return None


def _private_fallback() -> Path:
    """$TMPDIR/mixc-cache-<uid>, created 0700 and checked (ours, a real folder, no group or
    other write); if another user holds that name, a fresh mkdtemp folder for this process."""
    uid = _uid()
    path = Path(tempfile.gettempdir()) / f"mixc-cache-{uid if uid is not None else 'user'}"
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError:
        pass                            # checked below: unusable, so mkdtemp
    why = _folder_problem(path, follow=False)
    if why is None:
        return path
    fresh = Path(tempfile.mkdtemp(prefix=f"{path.name}-"))
    warnings.warn(f"mixc: {path} {why}, so it is not trusted; using {fresh} for this process", stacklevel=4)
    return fresh


def _resolve_cache_dir() -> Path:
    explicit = os.environ.get("MIXC_CACHE_DIR")
    try:
        root = Path(explicit) if explicit else Path.home() / ".cache" / "mixc"
    except (RuntimeError, KeyError):    # a uid with no passwd entry and no $HOME (docker --user)
        fallback = _private_fallback()
        warnings.warn(f"mixc: no home directory for the cache (set MIXC_CACHE_DIR); using {fallback}",
                      stacklevel=4)
        return fallback
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError:
        pass                            # reported by the check below
    why = _folder_problem(root, follow=True)
    if why is not None and not explicit and why.startswith("is writable by group"):
        try:                            # our own default folder, made under a loose umask: tighten it
            os.chmod(root, stat.S_IMODE(os.stat(root).st_mode) & ~0o022)
            why = _folder_problem(root, follow=True)
        except OSError:
            pass
    if why is None:
        return root
    fallback = _private_fallback()
    warnings.warn(f"mixc cache folder {root} {why}; using {fallback}", stacklevel=4)
    return fallback


_DIRS: dict[tuple, Path] = {}
_DIRS_LOCK = threading.Lock()


def cache_dir() -> Path:
    """$MIXC_CACHE_DIR, else ~/.cache/mixc, when it is this user's alone; else (with a warning)
    a private per-user folder in the system temp folder. Resolved once per environment value."""
    key = (os.environ.get("MIXC_CACHE_DIR"), os.environ.get("HOME"), tempfile.gettempdir())
    hit = _DIRS.get(key)
    if hit is None:
        with _DIRS_LOCK:
            hit = _DIRS.get(key)
            if hit is None:
                hit = _DIRS[key] = _resolve_cache_dir()
    return hit


def write_atomic(path: Path, text: str, mode: int = 0o600) -> None:
    """Write through a temporary file and os.replace: a symlink at path is replaced, never
    followed; readers see the old file or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_output(path: Path, text: str) -> None:
    """A file the user asked for (mixc compile -o): atomic, replacing (not following) a symlink,
    readable by all, writable by the user."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, text, mode=0o644)


def write_runtime(out: Path) -> Path:
    """DIR/_mixc_standalone (standalone.FOLDER): mixc/standalone's .py files copied verbatim
    (shutil.copyfile: the bytes, no edit), the runtime a module in DIR imports where mixc is not
    installed. Filled in a fresh folder, then renamed into place, replacing what was there (a
    symlink or a file too, never written through); readable by all, writable by the user."""
    out.mkdir(parents=True, exist_ok=True)
    target = out / standalone.FOLDER
    tmp = Path(tempfile.mkdtemp(dir=out, prefix=f".{standalone.FOLDER}."))
    old = None
    try:
        for src in sorted(RUNTIME_DIR.glob("*.py")):
            shutil.copyfile(src, tmp / src.name)
        os.chmod(tmp, 0o755)                    # mkdtemp's is 0700
        if target.is_symlink() or target.is_file():
            target.unlink()
        elif target.exists():
            old = Path(tempfile.mkdtemp(dir=out, prefix=f".{standalone.FOLDER}.old."))
            os.replace(target, old / "runtime")
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not target.exists():         # put the previous one back
            os.replace(old / "runtime", target)
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return target


def module_path(plan: Plan) -> Path:
    return cache_dir() / f"{plan.name}-{cache_key(plan)}.py"


_FOOTER = "# mixc checksum sha256 "


def _checksum(body: str) -> str:
    return hashlib.sha256(body.encode()).hexdigest()


def _footer_ok(text: str) -> bool:
    body, sep, last = text.rstrip("\n").rpartition("\n")
    return bool(sep) and last == _FOOTER + _checksum(body + "\n")


def read_trusted(path: Path) -> str | None:
    """The text of a cache entry, or None unless it is a regular file (not a symlink) owned by
    this user, writable by no one else, whose last line is the checksum of the rest."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or untrusted_because(st) is not None:
            return None
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read()
    finally:
        os.close(fd)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return text if _footer_ok(text) else None


def is_intact(path: Path) -> bool:
    """A cache entry is whole and ours: see read_trusted."""
    return read_trusted(path) is not None


def _source(plan: Plan) -> tuple[Path, str]:
    """(the entry's path, its verified text), written (again) if missing, truncated, corrupted,
    not ours, writable by others, or a directory."""
    path = module_path(plan)
    text = read_trusted(path)
    if text is not None:
        return path, text
    from ..codegen.module import generate          # jinja2 and the templates: only on a miss
    body = generate(plan)
    body = body if body.endswith("\n") else body + "\n"
    text = body + _FOOTER + _checksum(body) + "\n"
    try:
        write_atomic(path, text)
    except IsADirectoryError:           # a directory where the entry belongs: replaced
        shutil.rmtree(path, ignore_errors=True)
        write_atomic(path, text)
    return path, text


def ensure_source(plan: Plan) -> Path:
    """The generated module's file; written (again) if it is not a trusted, intact entry."""
    return _source(plan)[0]


def interpreting() -> bool:
    """Triton's interpreter (kernels on CPU tensors) is on. It must be chosen before Triton is
    first imported (its standard library is jit-compiled at import), so it is read, not set."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_MODULES: dict[str, types.ModuleType] = {}
_BY_PLAN: dict[int, tuple[Plan, types.ModuleType]] = {}     # id(plan) -> (plan kept alive, module)
_LOAD_LOCK = threading.RLock()


def _import(path: Path, text: str) -> types.ModuleType:
    """Execute the verified text (not the file again: it could change after the check), and
    give linecache the same text, which Triton's jit reads back with inspect.getsource."""
    name = f"mixc_generated.{path.stem.replace('-', '_')}"
    code = compile(text, str(path), "exec")
    mod = types.ModuleType(name)
    mod.__file__ = str(path)
    mod._MIXC_RUNTIME = standalone.__name__     # its op runs on mixc's own runtime (templates/op.py.j2)
    linecache.cache[str(path)] = (len(text), None, text.splitlines(True), str(path))
    sys.modules[name] = mod
    exec(code, mod.__dict__)
    return mod


def load_module(plan: Plan) -> types.ModuleType:
    """The generated module of a plan: found in a dict after the first call (the call path does
    no file-system work); the first writes or verifies the cache entry and imports it."""
    hit = _BY_PLAN.get(id(plan))
    if hit is not None:
        return hit[1]
    with _LOAD_LOCK:
        hit = _BY_PLAN.get(id(plan))
        if hit is not None:
            return hit[1]
        path, text = _source(plan)
        mod = _MODULES.get(str(path))
        if mod is None:
            mod = _MODULES[str(path)] = _import(path, text)
        _BY_PLAN[id(plan)] = (plan, mod)
        return mod
