"""A compiled module (`mixc compile -o DIR`) binds and checks a call's arguments with the same
code as mixc.load's op (standalone/binding.py; issue 30, memory safety): the reproducers that
crashed the compiled module (bad cu_seqlens values: heap corruption; CK <= 0; chunk = 7, a
Triton error) or that it took wrongly (output_final_state='no', an int64 or meta state), and a
fuzz of both with the same random arguments, valid and not: one refuses exactly where the
other does, with the same message, and where both run they return the same numbers."""
from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import mixc
from helpers import random_args, random_state
from mixc.cli import main
from mixc.runtime.signature import ArgumentError

SPECS = ("simple_gla", "gla", "delta_rule")
FAST = settings(max_examples=12, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large])
SLOW = settings(max_examples=150, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """name -> (the compiled module, mixc.load's op), compiled once for the file."""
    out, mods = tmp_path_factory.mktemp("compiled"), {}
    for name in SPECS:
        assert main(["compile", name, "-o", str(out)]) == 0
        spec = importlib.util.spec_from_file_location(f"compiled_binding_{name}", out / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        mods[name] = (mod, mixc.load(name))
    return mods


def _args(op, T=32, seed=5):
    args, sizes = random_args(op.ir, B=1, T=T, H=2, sizes={"K": 8, "V": 8}, dtype=torch.float32, seed=seed)
    return args, sizes


# ---- the reproducers: each crashed the compiled module or was taken wrongly ----

BAD_CALLS = {
    "cu_past_T_then_back": (dict(cu_seqlens=torch.tensor([0, 40, 32])), "cu_seqlens: offsets must be non-decreasing"),
    "cu_negative": (dict(cu_seqlens=torch.tensor([0, -8, 32])), "cu_seqlens: offsets must be non-decreasing"),
    "cu_ends_past_T": (dict(cu_seqlens=torch.tensor([0, 16, 64])), r"cu_seqlens: must start at 0 and end at T = 32"),
    "cu_ends_before_T": (dict(cu_seqlens=torch.tensor([0, 16])), r"cu_seqlens: must start at 0 and end at T = 32"),
    "cu_a_list": (dict(cu_seqlens=[0, 16, 32]), "cu_seqlens: expected a 1-D int32 or int64 tensor .* got list"),
    "CK_negative": (dict(CK=-4, mode="recurrent"), "CK: expected a positive int .* got -4"),
    "CK_zero": (dict(CK=0, mode="recurrent"), "CK: expected a positive int .* got 0"),
    "chunk_7": (dict(chunk=7), r"chunk: expected a power of two >= 16 \(a matmul block\), got 7"),
    "scale_huge": (dict(scale=10 ** 400), "scale: expected a finite number"),
    "scale_nan": (dict(scale=math.nan), "scale: expected a finite number, got nan"),
    "output_final_state_no": (dict(output_final_state="no"), "output_final_state: expected True or False, got 'no'"),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_the_compiled_module_refuses_what_the_op_refuses(case, compiled):
    mod, op = compiled["simple_gla"]
    args, _ = _args(op)
    extra, match = BAD_CALLS[case]
    for call in (op, mod.op):
        with pytest.raises(ArgumentError, match=match):
            call(**args, **extra)


@pytest.mark.parametrize("how", ["int64", "meta", "shape"])
def test_the_compiled_module_checks_the_states_dtype_and_device(how, compiled):
    mod, op = compiled["simple_gla"]
    args, sizes = _args(op, T=4)
    st0 = random_state(op.ir, 1, 2, sizes, dtype=torch.float32)["S"]
    bad = {"int64": (st0 * 10).long(), "meta": st0.to("meta"), "shape": st0[:, :, :-1]}[how]
    match = {"int64": r"initial_state\['S'\]: expected a floating-point tensor .* got dtype torch.int64",
             "meta": r"initial_state\['S'\]: on device meta, but q is on cpu",
             "shape": r"initial_state\['S'\]: expected shape \[B=1, H=2, K=8, V=8\]"}[how]
    for call in (op, mod.op):
        with pytest.raises(ArgumentError, match=match):
            call(**args, initial_state={"S": bad})


def test_the_compiled_module_runs_packed_sequences_as_the_op(compiled):
    """Valid offsets still run: rows of every sequence written (T = 32 split at 11 and 27)."""
    mod, op = compiled["simple_gla"]
    args, _ = _args(op)
    cu = torch.tensor([0, 11, 27, 32])
    o1, s1 = op(**args, cu_seqlens=cu, output_final_state=True)
    o2, s2 = mod.op(**args, cu_seqlens=cu, output_final_state=True)
    assert torch.isfinite(o2).all()         # MIXC_POISON: an unwritten row would be NaN
    torch.testing.assert_close(o2, o1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s2["S"], s1["S"], rtol=1e-5, atol=1e-5)


# ---- the fuzz: the same random arguments to both ----

def _outcome(fn):
    try:
        return "ran", fn()
    except ArgumentError as e:            # anything else: a traceback from inside, the test fails
        return "refused", str(e)


def _same_refusal(m1: str, m2: str) -> bool:
    # an option default without a finite value: the op quotes the spec's expression, which a
    # compiled module (no spec language) has not; both name the option
    if m1.startswith("option '") and "its default" in m1:
        return m2.startswith(m1[:m1.index("its default")])
    # the modes each takes differ by design (the compiled module has the kernels' only)
    if m1.startswith("mode: "):
        return m2.startswith("mode: ")
    return m1 == m2


def _bad_tensor(draw, x: torch.Tensor):
    how = draw(st.sampled_from(["int", "rank", "dim", "bf16", "f64", "strided", "meta", "list"]))
    if how == "int":
        return (x * 8).to(torch.int32)
    if how == "rank":
        return x.unsqueeze(-1)
    if how == "dim":
        return torch.cat([x, x[..., :1]], dim=-1)
    if how == "bf16":
        return x.to(torch.bfloat16)
    if how == "f64":
        return x.double()
    if how == "strided":                    # the same values, not contiguous
        return x.transpose(0, -1).contiguous().transpose(0, -1)
    if how == "meta":
        return x.to("meta")
    return x.tolist()


def _offsets(draw, T: int, bad: bool):
    cuts = sorted(draw(st.lists(st.integers(0, T), max_size=3)))
    valid = [0] + cuts + [T]
    kind = draw(st.sampled_from(["unsorted", "negative", "past_T", "short", "list", "float", "2d"] if bad
                                else ["int64", "int32"]))
    if kind in ("int64", "int32"):
        return torch.tensor(valid, dtype=getattr(torch, kind))
    if kind == "unsorted":
        return torch.tensor([0, T + 3, T])
    if kind == "negative":
        return torch.tensor([0, -draw(st.integers(1, 9)), T])
    if kind == "past_T":
        return torch.tensor(valid[:-1] + [T + draw(st.integers(1, 40))])
    if kind == "short":
        return torch.tensor(valid[:-1])
    if kind == "list":
        return valid
    if kind == "float":
        return torch.tensor(valid, dtype=torch.float32)
    return torch.tensor(valid).unsqueeze(0)


def _state(draw, op, n, H, sizes, dtype, bad: bool):
    kind = draw(st.sampled_from(["int64", "meta", "shape", "missing", "a_string", "extra"] if bad
                                else ["valid", "bare", "f16"]))
    s = random_state(op.ir, n, H, sizes, seed=draw(st.integers(0, 99)), dtype=dtype)
    name = op.ir.states[0].name
    if kind == "valid":
        return s
    if kind == "bare":
        return s[name]
    if kind == "f16":
        return {name: s[name].half()}
    if kind == "int64":
        return {name: (s[name] * 10).long()}
    if kind == "meta":
        return {name: s[name].to("meta")}
    if kind == "shape":
        return {name: s[name][:, :, :-1]}
    if kind == "missing":
        return {}
    if kind == "extra":
        return {**s, "Z": s[name]}
    return "S"


BAD_NUMBERS = [0, -4, 7, 24, 2.0, True, "16", 10 ** 40]
# what one call gets wrong, if anything (valid calls first: derandomized runs start there)
FAULTS = ["none", "tensor", "cu_seqlens", "initial_state", "output_final_state", "mode", "CK", "chunk", "scale",
          "flag", "extra"]


def _draw_call(op, packed, B, T, H, dtype, K, V, seed, draw):
    args, sizes = random_args(op.ir, B=B, T=T, H=H, sizes={"K": K, "V": V}, dtype=dtype, seed=seed)
    fault = draw(st.sampled_from(FAULTS[:1] * 4 + FAULTS[1:]))
    kw = dict(args)
    if fault == "tensor":                       # one tensor of the wrong kind, shape, dtype or device
        k = draw(st.sampled_from(sorted(args)))
        kw[k] = _bad_tensor(draw, args[k])
    if packed or fault == "cu_seqlens":
        kw["cu_seqlens"] = cu = _offsets(draw, T, fault == "cu_seqlens")
        n = len(cu) - 1 if isinstance(cu, torch.Tensor) and cu.dim() == 1 and fault != "cu_seqlens" else 1
    else:
        n = B
    if fault == "initial_state" or draw(st.booleans()):
        kw["initial_state"] = _state(draw, op, n, H, sizes, dtype, fault == "initial_state")
    if fault == "output_final_state":
        kw["output_final_state"] = draw(st.sampled_from(["no", 1, None, torch.tensor(True)]))
    elif draw(st.booleans()):
        kw["output_final_state"] = draw(st.booleans())
    if fault == "mode":
        kw["mode"] = draw(st.sampled_from(["fast", "Chunk", ["auto"]]))
    elif draw(st.booleans()):
        kw["mode"] = draw(st.sampled_from(["auto", "chunk", "recurrent"]))
    if fault == "CK" or draw(st.booleans()):
        kw["CK"] = draw(st.sampled_from(BAD_NUMBERS)) if fault == "CK" else draw(st.integers(1, 40))
    if fault == "chunk" or draw(st.booleans()):
        kw["chunk"] = draw(st.sampled_from(BAD_NUMBERS)) if fault == "chunk" else draw(st.sampled_from([16, 32]))
    if fault == "scale":
        kw["scale"] = draw(st.sampled_from([math.nan, math.inf, -math.inf, 10 ** 400, "0.5", True, [0.5]]))
    elif draw(st.booleans()):
        kw["scale"] = draw(st.one_of(st.floats(-4, 4, allow_nan=False), st.integers(-3, 3),
                                     st.just(torch.tensor(0.25)), st.just(None)))
    if name_has_flag(op) and (fault == "flag" or draw(st.booleans())):
        # the compiled value (False) only: a compiled module serves the one it was compiled with
        kw["use_qk_l2norm_in_kernel"] = draw(st.sampled_from(["no", 0, None] if fault == "flag" else [False]))
    if fault == "extra":
        kw[draw(st.sampled_from(["bogus", "state", "q2", "cp_group_"]))] = args[op.ir.inputs[0].name]
    return kw


def name_has_flag(op) -> bool:
    return any(o.kind == "bool" for o in op.ir.options)


def _compare(compiled, draw):
    name = draw(st.sampled_from(SPECS))
    packed = draw(st.booleans())
    B, T, H = (1 if packed else draw(st.integers(1, 2))), draw(st.integers(1, 20)), draw(st.integers(1, 2))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    K, V, seed = draw(st.integers(1, 9)), draw(st.integers(1, 9)), draw(st.integers(0, 2 ** 16))
    mod, op = compiled[name]
    kw = _draw_call(op, packed, B, T, H, dtype, K, V, seed, draw)
    (r1, v1), (r2, v2) = _outcome(lambda: op(**kw)), _outcome(lambda: mod.op(**kw))
    assert r1 == r2, f"mixc.load's op {r1} ({v1 if r1 == 'refused' else ''}), the compiled module {r2} " \
                     f"({v2 if r2 == 'refused' else ''})"
    event(r1 if r1 == "ran" else f"refused: {v1.split(':')[0]}")
    if r1 == "refused":
        assert _same_refusal(v1, v2), (v1, v2)
        return
    (o1, s1), (o2, s2) = v1, v2
    tol = 1e-4 if o1.dtype == torch.float32 else 1e-5
    torch.testing.assert_close(o2, o1, rtol=tol, atol=tol)
    assert (s1 is None) == (s2 is None)
    for k in s1 or {}:
        torch.testing.assert_close(s2[k], s1[k], rtol=tol, atol=tol)


@FAST
@given(data=st.data())
def test_fuzz_compiled_module_against_the_op(compiled, data):
    _compare(compiled, data.draw)


@pytest.mark.slow
@SLOW
@given(data=st.data())
def test_fuzz_compiled_module_against_the_op_long(compiled, data):
    _compare(compiled, data.draw)
