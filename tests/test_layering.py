"""The stages only look down: standalone <- dsl <- classes <- derive <- codegen <- runtime <-
(pipeline, tools, nn, cli). Every module's imports, at module and function level, are read with
ast: a stage that imports a stage above it (or the pipeline, the tools, the layers, the CLI)
fails here, and so does an import cycle between modules. mixc/standalone, the runtime that
`mixc compile -o DIR` copies beside a compiled module, imports only its own files (relatively),
the standard library, torch and Triton."""
import ast
from pathlib import Path

import pytest

import mixc

ROOT = Path(mixc.__file__).resolve().parent
STAGES = ("standalone", "dsl", "classes", "derive", "codegen", "runtime")


def _module_name(path: Path) -> str:
    parts = ("mixc",) + path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(dotted: str) -> bool:
    path = ROOT.parent.joinpath(*dotted.split("."))
    return path.with_suffix(".py").exists() or path.is_dir()


def _imports(path: Path) -> list[tuple[int, str, bool]]:
    """(line, imported module, at function level) for each import of a mixc module."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    in_function = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for n in ast.walk(f)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # `from . import plan` imports the module mixc.derive.plan
            targets = [f"{module}.{a.name}" if _is_module(f"{module}.{a.name}") else module for a in node.names]
        else:
            continue
        out += [(node.lineno, t, id(node) in in_function) for t in targets if t == "mixc" or t.startswith("mixc.")]
    return out


MODULES = sorted(ROOT.rglob("*.py"))


def _stage(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in STAGES else None


def _allowed(src: str, dst: str) -> bool:
    """src may import dst: its own stage or one below, or the package root (__version__)."""
    if dst == "mixc":
        return True
    s, d = _stage(src), _stage(dst)
    if s is None:               # above the stages: pipeline, tools, nn, cli, ...
        return True
    return d is not None and STAGES.index(d) <= STAGES.index(s)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: _module_name(p))
def test_stages_only_import_downwards(path):
    src = _module_name(path)
    bad = [f"{path.relative_to(ROOT.parent)}:{line}: imports {dst}" + (" (in a function)" if fn else "")
           for line, dst, fn in _imports(path) if not _allowed(src, dst)]
    assert not bad, "\n".join(bad)


STANDALONE = ROOT / "standalone"


@pytest.mark.parametrize("path", sorted(STANDALONE.glob("*.py")), ids=lambda p: p.name)
def test_the_standalone_runtime_imports_only_itself_torch_and_triton(path):
    """A compiled module's runtime is a verbatim copy of mixc/standalone in a folder beside it,
    imported under another name where only torch and Triton are installed: its files import one
    another relatively (`from .binding import ...`), and besides only the standard library,
    torch and triton; nothing of mixc by name, no package of its own beyond the folder."""
    import sys
    tree = ast.parse(path.read_text(encoding="utf-8"))
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            if node.level != 1 or not node.module or not (STANDALONE / f"{node.module}.py").exists():
                bad.append(f"{path.name}:{node.lineno}: from {'.' * node.level}{node.module or ''} import ...")
            continue
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module] if isinstance(node, ast.ImportFrom) else [])
        for name in names:
            top = name.split(".")[0]
            if top not in ("torch", "triton", "__future__") and top not in sys.stdlib_module_names:
                bad.append(f"{path.name}:{node.lineno}: imports {name}")
    assert not bad, "\n".join(bad)


def test_the_standalone_runtime_is_a_flat_folder_of_python_files():
    """`mixc compile -o DIR` copies mixc/standalone's .py files (write_runtime): a subfolder or
    a data file there would not travel with the module."""
    extra = [p.name for p in STANDALONE.iterdir() if p.name != "__pycache__" and p.suffix != ".py"]
    assert not extra, extra


def test_no_import_cycles():
    """No module reaches itself through module-level imports (a cycle hidden in a function
    body counts too: function-level imports are part of the graph)."""
    graph = {}
    names = {_module_name(p) for p in MODULES}
    for p in MODULES:
        deps = set()
        for _, dst, _ in _imports(p):
            while dst not in names and "." in dst:      # `from mixc.dsl import ir` -> mixc.dsl.ir, else up
                dst = dst.rpartition(".")[0]
            if dst in names and dst != "mixc":          # the package root holds only __version__ and load
                deps.add(dst)
        graph[_module_name(p)] = deps - {_module_name(p)}
    cycles = []
    state: dict[str, int] = {}

    def visit(node, stack):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])
    assert not cycles, "\n".join(cycles)


def test_the_dump_names_are_the_pipeline_stages():
    from mixc import cli, pipeline
    assert cli.DUMPS == pipeline.DUMPS
    assert set(pipeline.DUMPS) <= set(pipeline.STAGES)


def _function_imports(path: Path) -> list[tuple[int, str, str]]:
    """(line, its text, the line above) of each import inside a function body."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    tree = ast.parse(text)
    found = {n.lineno for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return [(i, lines[i - 1].strip(), lines[i - 2] if i > 1 else "") for i in sorted(found)]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: _module_name(p))
def test_function_level_imports_say_why(path):
    """An import inside a function exists only to load lazily (torch, Triton, sympy, lark,
    jinja2, ... kept off `mixc --help`, `mixc check`, `import mixc` or a compiled module's
    import) or for an optional dependency, and a comment on its line or the line above says
    which; any other import belongs at module level."""
    rel = path.relative_to(ROOT.parent).as_posix()
    bad = [f"{rel}:{line}: {text}" for line, text, above in _function_imports(path)
           if "#" not in text and "#" not in above]
    assert not bad, ("function-level imports without a comment saying why (lazy: ..., optional: ...); "
                     "move them to module level or say why not:\n" + "\n".join(bad))


def test_check_and_explain_import_no_torch():
    """`mixc check` and `mixc explain` read, derive and print: they pay for neither torch nor
    Triton (about 4 s of imports); the pipeline loads the runtime only to run an op."""
    import subprocess
    import sys
    code = ("import io, sys, contextlib\n"
            "from mixc import cli\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
            "    cli.main(['check', 'gla']); cli.main(['explain', 'gated_delta_rule'])\n"
            "print(sorted(m for m in ('torch', 'triton', 'jinja2') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
