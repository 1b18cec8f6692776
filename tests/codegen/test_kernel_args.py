"""Each kernel's argument list has one definition (mixc/standalone/kernel_args.py): the template
signature is printed from it, runtime/launch.py and standalone/support.py launch by it, and
tools/aot.py types it. Checked on every library spec, and by changing the definition: a renamed
argument and a reordered list change all three, and the kernels still compute the same."""
import dataclasses
import importlib.util
import inspect
import itertools
import types

import pytest
import torch

import mixc
from helpers import random_args
from mixc import pipeline
from mixc.standalone import kernel_args as ka
from mixc.codegen.launch_plan import chunk_stages, kernel_name, stage_kernel_name
from mixc.derive.layout import kernel_layout
from mixc.dsl import library_names
from mixc.runtime import launch
from mixc.runtime.signature import bind
from mixc.standalone.support import CompiledOp
from mixc.tools import aot


def _plans():
    """Every library recurrence at each flag assignment (as the snapshot of generated modules)."""
    for name in library_names("recurrent"):
        m = pipeline.spec(name)
        flags = [f.name for f in m.flags]
        for values in itertools.product([False, True], repeat=min(len(flags), 4)):
            yield pipeline.derive(m, dict(zip(flags, values)))


@pytest.mark.parametrize("plan", list(_plans()), ids=lambda p: p.name + "".join(f"-{k}" for k, v in p.flags if v))
def test_every_kernel_signature_is_its_definition(plan):
    """The generated kernels' parameters (names, order, constexpr or not), the AOT signature's
    and the launch call's are the definition's, for every form of every library spec."""
    mod = pipeline.load(plan)
    assert set(mod.METADATA["kernels"]) == set(plan.layout.kernel_args)
    for form, kname, kernel in _kernels(plan, mod):
        args = plan.layout.kernel_args[form]
        params = inspect.signature(inspect.unwrap(kernel.fn)).parameters
        assert [(n, "constexpr" in str(p.annotation)) for n, p in params.items()] == \
            [(a.name, a.constexpr) for a in args.args], kname
        sig, const = aot.signature(kernel, plan, {d: 16 for d in plan.ir.dim_names})
        assert list(sig) == [a.name for a in args.args]
        assert [n for n, t in sig.items() if t == "constexpr"] == list(const)
        # the launch: positional up to the first constexpr, the rest by name, each once
        assert list(args.positional) + [k for _, k in args.named] == [a.key for a in args.args]
        assert len(set(args.positional) | {k for _, k in args.named}) == len(args.args)
    # a compiled module's runtime builds the same lists from METADATA's names
    assert ka.metadata_kernel_args(mod.METADATA) == plan.layout.kernel_args


def _kernel_names(plan) -> list[tuple[str, str]]:
    """(form, name) of every kernel of the plan: a chunked form's one per stage."""
    return [(form, stage_kernel_name(plan, form, s)) for form in plan.layout.kernel_args if form.startswith("chunk")
            for s in chunk_stages(plan, form)] + \
        [(form, kernel_name(plan, form)) for form in plan.layout.kernel_args if not form.startswith("chunk")]


def _kernels(plan, mod) -> list[tuple]:
    """(form, name, kernel) of every kernel of the module."""
    return [(form, name, getattr(mod, name)) for form, name in _kernel_names(plan)]


class _Recorder:
    """A kernel that records its launches."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *a, **kw: self.calls.append((a, kw))


def _module(plan, tmp_path, tag):
    """The module generated from plan, imported from a file (Triton reads kernels' source)."""
    path = tmp_path / f"kargs_{tag}.py"
    path.write_text(pipeline.render(plan))
    spec = importlib.util.spec_from_file_location(f"kargs_{tag}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return path.read_text(), mod


def _replan(plan):
    """The plan with its layout derived again (after the definition changed)."""
    ka.kernel_args.cache_clear()
    return dataclasses.replace(plan, layout=kernel_layout(plan))


@pytest.fixture
def fresh_definition():
    ka.kernel_args.cache_clear()
    yield
    ka.kernel_args.cache_clear()


def test_a_renamed_argument_changes_the_signature_the_launches_and_aot(monkeypatch, tmp_path, fresh_definition):
    """Renaming a role in the definition (IS_VARLEN -> IS_PACKED, p_cu_seqlens -> p_offsets)
    renames the template's parameter, the name launch.py and support.py pass it by (their calls
    still bind to the kernel's parameters) and the AOT signature's key."""
    op = mixc.load("gla")                   # loaded (and cached) before the definition changes
    kw, _ = random_args(op.ir, B=2, T=5, H=2, sizes={"K": 4, "V": 4}, dtype=torch.float32, seed=3)
    bound = bind(op.ir, kw)
    monkeypatch.setitem(ka.ROLES, "varlen", ka.ROLES["varlen"]._replace(name="IS_PACKED"))
    monkeypatch.setitem(ka.ROLES, "cu_seqlens", ka.ROLES["cu_seqlens"]._replace(name="p_offsets"))
    plan = _replan(op.plan())
    # the body still says IS_VARLEN and p_cu_seqlens (hooks and templates name them): only the
    # signature is under test, so the kernels are not run
    text, renamed = _module(plan, tmp_path, "renamed")     # never pipeline.load: the cache keeps the real one
    for _, name in _kernel_names(plan):
        block = text[text.index(f"def {name}("):]
        block = block[:block.index("\n):")]
        assert "    IS_PACKED: tl.constexpr," in block and "p_offsets" in block
        assert "IS_VARLEN" not in block and "p_cu_seqlens" not in block

    rec = _Recorder()
    monkeypatch.setattr(launch, "module_for", lambda *a: types.SimpleNamespace(
        **{name: rec for _, name in _kernel_names(plan)}))

    def kernel_fn(form):         # a Python function with the renamed kernel's parameters
        args = plan.layout.kernel_args[form].args
        params = [inspect.Parameter(a.name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for a in args]
        return inspect.Signature(params)

    for form, go in [("recurrent_fwd", lambda: launch.recurrent_forward(plan, bound, output_final_state=True)),
                     ("chunk_fwd", lambda: launch.chunk_forward(plan, bound, output_final_state=True))]:
        rec.calls.clear()
        go()
        a, k = rec.calls[-1]
        got = kernel_fn(form).bind(*a, **{n: v for n, v in k.items() if n not in ka.LAUNCH_OPTIONS}).arguments
        assert got["IS_PACKED"] is False and got["p_offsets"] is not None and "IS_VARLEN" not in k

    # a compiled module's runtime: the same names from the same definition
    meta = renamed.METADATA
    rec.calls.clear()
    CompiledOp(meta, {name: rec for _, name in _kernel_names(plan)})(**kw, mode="chunk")
    got = kernel_fn("chunk_fwd").bind(*rec.calls[-1][0], **rec.calls[-1][1]).arguments
    assert got["IS_PACKED"] is False

    sig, const = aot.signature(types.SimpleNamespace(__name__="gla_chunk_fwd_walk"), plan, {"K": 16, "V": 16})
    assert sig["IS_PACKED"] == "constexpr" and const["IS_PACKED"] is False and sig["p_offsets"] == "*i32"
    assert "IS_VARLEN" not in sig and "p_cu_seqlens" not in sig


def _shuffled(build):
    """A form's definition with its lines before the first constexpr in another order: the
    options first, then the states' buffers, then the rest (T and H ahead of the inputs)."""
    def form(*names):
        lines = build(*names)
        first = next(i for i, line in enumerate(lines) if any(a.constexpr for a in line.args))
        head, tail = lines[:first], lines[first:]

        def rank(line):
            roles = {a.role for a in line.args}
            return (0 if roles & {"option"} else 1 if roles & {"init", "ckpt"} else 2 if roles & {"T"} else 3)
        return sorted([line for line in head if line.args], key=rank) + tail
    return form


@pytest.mark.parametrize("name,mode", [("gla", "recurrent"), ("gla", "chunk"), ("mamba2", "recurrent"),
                                       ("mamba2", "chunk")])
def test_a_reordered_definition_launches_the_same_numbers(name, mode, monkeypatch, tmp_path, fresh_definition):
    """Reordering the definition reorders the kernel's parameters and both launches' arguments
    with it: the generated kernels, launched by runtime/launch.py (the chunked forms in one walk
    and in two launches) and by a compiled module's standalone/support.py, compute what the
    unchanged ones do (outputs and gradients), and match the float64 reference."""
    op = mixc.load(name)
    args, _ = random_args(op.ir, B=2, T=9, H=2, sizes={}, dtype=torch.float32, seed=21, requires_grad=True)
    leaves = list(args.values())
    want, _ = op(**args, mode=mode)
    do = torch.randn(want.shape, generator=torch.Generator().manual_seed(5))
    g_want = dict(zip(args, torch.autograd.grad((want * do).sum(), leaves)))

    for form in ka.FORMS:
        monkeypatch.setitem(ka._FORMS, form, _shuffled(ka._FORMS[form]))
    plan = _replan(op.plan())
    text, mod = _module(plan, tmp_path, f"{name}_{mode}")
    head = text[text.index(f"def {name}_recurrent_fwd("):]
    assert head.index("    v_") < head.index("    p_init_") < head.index("    T, H,") < head.index("    p_out,")
    got, grads = {}, {}
    # runtime/launch.py on the reordered kernels
    monkeypatch.setattr(launch, "module_for", lambda plan_, device: mod)
    bound = bind(op.ir, {k: v.detach() for k, v in args.items()})
    for phases in ((1, 2) if mode == "chunk" else (None,)):
        monkeypatch.setattr(launch, "CHUNK_PHASES", phases)
        if mode == "chunk":
            C = plan.layout.chunk_size
            o, _, ck = launch.chunk_forward(plan, bound, output_final_state=False, checkpoints=True, C=C)
            dx, dp, _ = launch.chunk_backward(plan, bound, ck, do, None, C=C)
        else:
            o, _, ck = launch.recurrent_forward(plan, bound, output_final_state=False, checkpoints=True)
            dx, dp, _ = launch.recurrent_backward(plan, bound, ck, do, None)
        got[f"launch {phases}"], grads[f"launch {phases}"] = o, dx | dp
    # standalone/support.py (a compiled module's op) on the same kernels, with gradients
    o, _ = mod.op(**args, mode=mode)
    got["support"], grads["support"] = o, dict(zip(args, torch.autograd.grad((o * do).sum(), leaves)))
    for k, v in got.items():
        torch.testing.assert_close(v, want.detach(), rtol=1e-5, atol=1e-5, msg=k)
        assert grads[k].keys() == g_want.keys()
        for x in g_want:
            torch.testing.assert_close(grads[k][x], g_want[x], rtol=1e-4, atol=1e-4, msg=f"{k}: d{x}")
    ref, _ = op.reference(**{k: v.detach() for k, v in args.items()})
    torch.testing.assert_close(got["support"].double(), ref, rtol=1e-4, atol=1e-4)
