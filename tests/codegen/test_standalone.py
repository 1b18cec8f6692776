"""The compiled module stands alone (issue 33 item 4, issue 31 item 3): `mixc compile NAME -o
DIR` writes DIR/NAME.py and DIR/_mixc_standalone/, a verbatim copy of mixc/standalone (the
binder, the kernels' argument lists, the launches, ArgumentError: the files mixc's own op
imports), and the module runs where mixc cannot be imported.

The fast tests run the module in a fresh `python -I` whose first finder refuses mixc and lark
(mixc is installed editable in the test's environment, so only a finder keeps it out; torch
itself needs sympy and jinja2, which stay importable, and the child checks that neither mixc,
lark nor jinja2 was imported): gla (key-diagonal decay, chunked and recurrent) and delta_rule
(rank-1, chunked) on fresh random inputs, output, final states, every gradient and step equal
to mixc.load's op; a bad argument is the op's ArgumentError, same message; with Triton's
interpreter off, CPU tensors are refused with an error that says why (the module has no torch
form). The slow test builds a bare venv (no site packages; torch, Triton and their declared
requirements only, linked from this environment's installed copies: pip has no index here)
and runs the same calls in it."""
from __future__ import annotations

import filecmp
import importlib.util
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest
import torch

import mixc
from helpers import random_args, random_state
from mixc import standalone
from mixc.cli import main
from mixc.runtime.signature import ArgumentError

CHILD = Path(__file__).with_name("standalone_child.py")
SPECS = ("gla", "delta_rule")
CASES = (("gla", "chunk"), ("gla", "recurrent"), ("delta_rule", "chunk"))
BLOCKED = "mixc,lark"
TOL = dict(rtol=1e-5, atol=1e-5)        # the same kernels and launches: equal but for summation order
TORCH_TOL = dict(rtol=1e-4, atol=1e-4)  # the module's token loop against mixc's chunked torch form / float64


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    out = tmp_path_factory.mktemp("build")
    for name in SPECS + ("swa",):
        assert main(["compile", name, "-o", str(out)]) == 0
    return out


def _weights(x, seed):
    return torch.randn(x.shape, generator=torch.Generator().manual_seed(seed), dtype=x.dtype)


def _expected(name: str, mode: str, seed: int):
    """A case of the job (fresh random inputs) and what mixc.load's op gives on it."""
    op = mixc.load(name)
    args, sizes = random_args(op.ir, B=2, T=9, H=2, sizes={"K": 8, "V": 8}, dtype=torch.float32, seed=seed)
    state = random_state(op.ir, 2, 2, sizes, seed=seed + 1, dtype=torch.float32)
    leaves = {k: v.clone().requires_grad_(True) for k, v in args.items()}
    st_leaves = {k: v.clone().requires_grad_(True) for k, v in state.items()}
    o, st = op(**leaves, initial_state=st_leaves, output_final_state=True, mode=mode)
    w_o, w_s = _weights(o, seed + 2), {k: _weights(v, seed + 3) for k, v in st.items()}
    loss = (o * w_o).sum() + sum((st[k] * w_s[k]).sum() for k in st)
    names = list(leaves) + [f"state:{k}" for k in st_leaves]
    grads = dict(zip(names, torch.autograd.grad(loss, list(leaves.values()) + list(st_leaves.values()))))
    inputs = {d.name for d in op.ir.inputs}
    one = {k: (v[:, 0] if k in inputs else v) for k, v in args.items()}
    k0 = op.ir.inputs[1].name
    bad = [{k0: torch.cat([args[k0], args[k0][..., :1]], -1)},             # a wrong size of K
           {"cu_seqlens": torch.tensor([0, 40, 9])},                          # offsets past T
           {"bogus": args[k0]},                                               # no such argument
           {"initial_state": {"S": state["S"].long()}}]                       # an int64 state
    refusals = []
    for kw in bad:
        with pytest.raises(ArgumentError) as e:
            op(**dict(args, **kw))
        refusals.append(str(e.value))
    case = {"module": name, "mode": mode, "args": args, "state": state, "w_o": w_o, "w_s": w_s, "one": one,
            "bad": bad}
    want = {"o": o.detach(), "state": {k: v.detach() for k, v in st.items()}, "grads": grads,
            "step": op.step(**one, state=state), "refusals": refusals}
    return case, want


def _run_child(python, job: dict, tmp_path: Path, env_extra: dict, blocked: str = BLOCKED) -> dict:
    job_path, result_path = tmp_path / "job.pt", tmp_path / "result.pt"
    torch.save(job, job_path)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MIXC_CACHE_DIR")}
    env.update(env_extra)
    cmd = [str(python), "-I", str(CHILD), str(job_path), str(result_path)] + ([blocked] if blocked else [])
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-4000:]
    return torch.load(result_path)


def _check_ran(got: dict, want: dict, tol: dict = TOL):
    assert got["call"][0] == "ran", got["call"]
    out = got["call"][1]
    torch.testing.assert_close(out["o"], want["o"], **tol)
    assert set(out["state"]) == set(want["state"])
    for k in want["state"]:
        torch.testing.assert_close(out["state"][k], want["state"][k], **tol)
    assert set(out["grads"]) == set(want["grads"])
    for k in want["grads"]:
        torch.testing.assert_close(out["grads"][k], want["grads"][k], **tol, msg=lambda m, k=k: f"d{k}: {m}")
    assert got["step"][0] == "ran", got["step"]
    (o1, s1), (o2, s2) = want["step"], got["step"][1]
    torch.testing.assert_close(o2, o1, **tol)
    for k in s1:
        torch.testing.assert_close(s2[k], s1[k], **tol)


def _check_refusals(got: dict, want: dict):
    """Each bad call: the module's ArgumentError (a ValueError), the op's message word for word."""
    for refusal, message in zip(got["bad"], want["refusals"], strict=True):
        assert refusal[:4] == ("refused", "ArgumentError", True, True), refusal
        assert refusal[4] == message
    kind, name, is_value_error, is_argument_error, text = got["torch_mode"]
    assert (kind, name, is_value_error, is_argument_error) == ("refused", "ArgumentError", True, True)
    assert text.startswith("mode: a compiled module runs its kernels") and "torch and reference backends" in text


def _job(build: Path, seed: int):
    cases, wants = [], []
    for i, (name, mode) in enumerate(CASES):
        case, want = _expected(name, mode, seed + 10 * i)
        cases.append(case)
        wants.append(want)
    return {"build": str(build), "cases": cases}, wants


def test_the_runtime_folder_is_mixcs_standalone_package_verbatim(build):
    """DIR/_mixc_standalone holds mixc/standalone's .py files, byte for byte (no edit, no
    second copy of the rules to keep in step)."""
    source = Path(standalone.__file__).parent
    copied = build / standalone.FOLDER
    names = sorted(p.name for p in source.glob("*.py"))
    assert sorted(p.name for p in copied.iterdir() if p.name != "__pycache__") == names
    match, mismatch, errors = filecmp.cmpfiles(source, copied, names, shallow=False)
    assert (mismatch, errors) == ([], []) and match == names


def test_the_module_runs_where_mixc_cannot_be_imported(build, tmp_path):
    """gla (chunked, recurrent) and delta_rule (chunked) imported the README's way in a `python
    -I` that cannot import mixc or lark, under Triton's interpreter: the output, final states,
    every gradient (inputs, params, initial state) and step equal mixc.load's op's on fresh
    random inputs; bad arguments raise the module's ArgumentError with the op's message; the
    runtime is the copy beside the module; no mixc, lark or jinja2 module was imported; a module
    file without its runtime folder says what is missing, and so does a sequence mixer's module
    (no kernels: torch computes it through mixc) at its first call."""
    job, wants = _job(build, seed=101)
    lonely = tmp_path / "lonely"
    lonely.mkdir()
    shutil.copy(build / "gla.py", lonely / "gla.py")
    job["lonely"] = str(lonely / "gla.py")
    swa = mixc.load("swa")
    job["sequence"] = ("swa", random_args(swa.ir, B=1, T=4, H=2, dtype=torch.float32)[0])
    got = _run_child(sys.executable, job, tmp_path, {"TRITON_INTERPRET": "1"})
    assert got["imported"] == []
    for name in SPECS:
        rt_name, rt_file = got["runtime"][name]
        assert rt_name.startswith("_mixc_standalone_") and rt_name.endswith(".support")
        assert Path(rt_file) == build / standalone.FOLDER / "support.py"
    for g, w in zip(got["cases"], wants, strict=True):
        _check_ran(g, w)
        _check_refusals(g, w)
    kind, message = got["lonely"]
    assert kind == "ImportError" and "its runtime is missing: the folder _mixc_standalone" in message
    assert "mixc is not installed" in message
    assert got["sequence"] == ("ImportError", "mixer 'swa' is a sequence mixer: its module has no kernels and no "
                               "runtime of its own; torch computes it through mixc (mixc.runtime.sequence, from the "
                               "spec), so its op needs mixc installed")


@pytest.mark.parametrize("name", SPECS)
def test_without_the_interpreter_cpu_tensors_run_the_modules_torch_form(build, tmp_path, name):
    """TRITON_INTERPRET unset, where mixc cannot be imported: a call and a step on CPU tensors run
    the module's own torch form (its generated torch_step and token loop, autograd for the
    gradients), equal to mixc.load's op in mode 'torch'; bad arguments are still the op's
    messages."""
    case, want = _expected(name, "torch", seed=7)
    case["mode"] = "auto"           # the module's modes name its kernels; on such tensors each runs the torch form
    env = {"TRITON_INTERPRET": "0"}
    got = _run_child(sys.executable, {"build": str(build), "cases": [case]}, tmp_path, env)
    assert got["imported"] == []
    (g,) = got["cases"]
    _check_ran(g, want, TORCH_TOL)
    _check_refusals(g, want)


def test_an_old_module_without_a_torch_form_refuses_cpu_tensors_saying_why(build, monkeypatch):
    """A module generated before the torch form (no torch_step in it) refuses CPU tensors
    without the interpreter with an ArgumentError that says why and what to do."""
    mod = _load(build / "gla.py", "_old_gla")
    del mod._OP.ns["torch_step"]
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    args, _ = random_args(mixc.load("gla").ir, B=1, T=3, H=2, sizes={"K": 8, "V": 8}, dtype=torch.float32)
    with pytest.raises(mod.ArgumentError) as e:
        mod.op(**args)
    assert "Triton's interpreter is off" in str(e.value) and "compile it again" in str(e.value)


@pytest.mark.parametrize("packed", [False, True], ids=["fixed", "cu_seqlens"])
@pytest.mark.parametrize("name", ["gla", "rwkv4", "mamba3"])      # mamba3: prev() of inputs (shift.py)
def test_the_torch_form_of_a_compiled_module_equals_the_reference(tmp_path, monkeypatch, name, packed):
    """In process, the interpreter off: a compiled module's op on CPU tensors (packed sequences
    too; a stabilized spec) gives the float64 reference's output, final states and gradients,
    and its step the reference step's."""
    assert main(["compile", name, "-o", str(tmp_path)]) == 0
    mod = _load(tmp_path / f"{name}.py", f"_torch_form_{name}")
    op = mixc.load(name)
    args, sizes = random_args(op.ir, B=2, T=5, H=2, sizes={"K": 4, "V": 4}, dtype=torch.float32, seed=3)
    cu = None
    if packed:
        names = {d.name for d in op.ir.inputs}
        args = {k: (v.reshape(1, 10, *v.shape[2:]) if k in names else v) for k, v in args.items()}
        cu = torch.tensor([0, 3, 10])
    init = random_state(op.ir, 2, 2, sizes, seed=4, dtype=torch.float32)
    leaves = {k: v.clone().requires_grad_() for k, v in args.items()}
    ref_leaves = {k: v.detach().double().requires_grad_() for k, v in args.items()}
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    o, st = mod.op(**leaves, initial_state=init, output_final_state=True, cu_seqlens=cu)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ro, rst = op(**ref_leaves, initial_state={k: v.double() for k, v in init.items()}, output_final_state=True,
                 cu_seqlens=cu, mode="reference")
    torch.testing.assert_close(o.double(), ro, **TORCH_TOL)
    for k in rst:
        torch.testing.assert_close(st[k].double(), rst[k], **TORCH_TOL)
    (o.double().sum() + sum(v.double().sum() for v in st.values())).backward()
    (ro.sum() + sum(v.sum() for v in rst.values())).backward()
    for k in leaves:
        torch.testing.assert_close(leaves[k].grad.double(), ref_leaves[k].grad, rtol=1e-3, atol=1e-4)
    names = {d.name for d in op.ir.inputs}
    one = {k: (v[:, 0] if k in names else v) for k, v in random_args(op.ir, B=2, T=1, H=2, sizes={"K": 4, "V": 4},
                                                                   dtype=torch.float32, seed=5)[0].items()}
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    o1, s1 = mod.step(**one, state=init)
    ro1, rs1 = op.reference_step(**one, state=init)
    torch.testing.assert_close(o1.double(), ro1, **TORCH_TOL)
    for k in rs1:
        torch.testing.assert_close(s1[k].double(), rs1[k], **TORCH_TOL)


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_two_builds_keep_their_own_runtime_in_one_process(tmp_path, capsys):
    """A build whose runtime differs (another mixc version's: here one line added to its
    binding.py) and one whose runtime is mixc's own files, imported in one process: the first
    runs its own copy, the second mixc's package (one ArgumentError class with mixc.load's op);
    an edit of a build's runtime changes what its module runs."""
    a, b = tmp_path / "a", tmp_path / "b"
    for out in (a, b):
        assert main(["compile", "simple_gla", "-o", str(out)]) == 0
    binding = b / standalone.FOLDER / "binding.py"
    binding.write_text(binding.read_text() + "\n\n_original_bind = bind\n\n\ndef bind(*a, **k):\n"
                       "    raise ArgumentError('the runtime of build b')\n")
    mod_a, mod_b = _load(a / "simple_gla.py", "standalone_a"), _load(b / "simple_gla.py", "standalone_b")
    assert mod_a._RUNTIME is sys.modules["mixc.standalone.support"]
    assert mod_a.ArgumentError is ArgumentError
    assert Path(mod_b._RUNTIME.__file__) == b / standalone.FOLDER / "support.py"
    assert mod_b.ArgumentError is not ArgumentError
    op = mixc.load("simple_gla")
    args, _ = random_args(op.ir, B=1, T=5, H=2, sizes={"K": 8, "V": 8}, dtype=torch.float32, seed=3)
    o, _ = mod_a.op(**args, mode="recurrent")
    torch.testing.assert_close(o, op(**args, mode="recurrent")[0], rtol=1e-6, atol=1e-6)
    with pytest.raises(mod_b.ArgumentError, match="the runtime of build b"):
        mod_b.op(**args)
    mod_a2 = _load(a / "simple_gla.py", "standalone_a2")       # a's runtime is still mixc's
    assert mod_a2._RUNTIME is mod_a._RUNTIME


def test_compiling_again_replaces_the_runtime_folder(tmp_path, capsys):
    """A second `compile -o` into the same folder leaves one runtime, mixc's current files
    (a stale file of an older copy is gone; a symlink in its place is replaced, not followed)."""
    out = tmp_path / "out"
    assert main(["compile", "gla", "-o", str(out)]) == 0
    (out / standalone.FOLDER / "stale.py").write_text("raise ImportError('stale')\n")
    (out / standalone.FOLDER / "errors.py").write_text("# edited\n")
    assert main(["compile", "gla", "-o", str(out)]) == 0
    copied = out / standalone.FOLDER
    assert not (copied / "stale.py").exists()
    assert filecmp.cmp(copied / "errors.py", Path(standalone.__file__).with_name("errors.py"), shallow=False)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.rmtree(copied)
    copied.symlink_to(elsewhere, target_is_directory=True)
    assert main(["compile", "gla", "-o", str(out)]) == 0
    assert not copied.is_symlink() and list(elsewhere.iterdir()) == []
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []       # no temporary left


# ---- a bare venv: torch, Triton and their requirements, nothing else ----

def _requirements_closure(roots) -> list:
    """The installed distributions of `roots` and of everything they require (markers
    evaluated here, extras left out), as importlib.metadata distributions."""
    from importlib import metadata
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    seen, todo, out = set(), list(roots), []
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        dist = metadata.distribution(name)
        out.append(dist)
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return out


def bare_venv(root: Path, packages=("torch", "triton")) -> tuple[Path, list[str]]:
    """A venv without site packages whose site-packages links the installed files of
    `packages` and their requirements (each distribution's top-level folders and files, its
    .dist-info included): what `pip install torch triton` gives, taken from this environment
    because pip cannot reach an index here (nor re-make wheels of installed packages). Returns
    (its python, the distributions' names); called again on the same root, it adds packages."""
    site = root / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    if not site.is_dir():
        venv.EnvBuilder(system_site_packages=False, with_pip=False, symlinks=True).create(root)
    assert site.is_dir()
    names = []
    for dist in _requirements_closure(packages):
        names.append(dist.metadata["Name"])
        tops = {Path(f).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in sorted(tops):
            src = Path(dist.locate_file(top))
            if src.exists() and not (site / top).exists():
                (site / top).symlink_to(src, target_is_directory=src.is_dir())
    return root / "bin" / "python", names


def _importable(python: Path, names, cwd: Path) -> list[str]:
    code = f"import importlib.util as u; print([n for n in {list(names)!r} if u.find_spec(n)])"
    probe = subprocess.run([str(python), "-I", "-c", code], capture_output=True, text=True, timeout=120, cwd=cwd,
                           env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert probe.returncode == 0, probe.stderr
    return eval(probe.stdout)       # noqa: S307 (a list of names this test printed)


@pytest.mark.slow
def test_the_module_runs_in_a_venv_with_only_torch_and_triton(build, tmp_path):
    """README's claim where it is made: a venv without site packages holding torch, Triton and
    their requirements only (mixc, lark and numpy are not importable there: checked), no finder
    blocking anything. With Triton's interpreter off the module imports, checks a call's
    arguments with the op's messages and runs CPU tensors through its torch form, equal to
    mixc.load's mode 'torch' (on a GPU it would run its kernels); Triton's interpreter imports
    numpy, which triton does not declare, so the interpreted run of the same calls as above adds
    numpy to the venv (and nothing else)."""
    python, names = bare_venv(tmp_path / "venv")
    assert {"torch", "triton"} <= {n.lower() for n in names}
    assert not {"mixc", "lark", "numpy"} & {n.lower() for n in names}
    probe = ("mixc", "lark", "numpy", "torch", "triton", "sympy", "jinja2")
    assert _importable(python, probe, tmp_path) == ["torch", "triton", "sympy", "jinja2"]   # torch requires the last two
    case, want = _expected("gla", "torch", seed=7)
    case["mode"] = "auto"
    got = _run_child(python, {"build": str(build), "cases": [case]}, tmp_path, {"TRITON_INTERPRET": "0"}, blocked="")
    assert got["imported"] == []
    (g,) = got["cases"]
    _check_ran(g, want, TORCH_TOL)
    _check_refusals(g, want)

    python, names = bare_venv(tmp_path / "venv", ("numpy",))
    assert _importable(python, probe, tmp_path) == ["numpy", "torch", "triton", "sympy", "jinja2"]
    job, wants = _job(build, seed=303)
    got = _run_child(python, job, tmp_path, {"TRITON_INTERPRET": "1"}, blocked="")
    assert got["imported"] == []
    for name in SPECS:
        assert Path(got["runtime"][name][1]) == build / standalone.FOLDER / "support.py"
    for g, w in zip(got["cases"], wants, strict=True):
        _check_ran(g, w)
        _check_refusals(g, w)
