"""DeltaProduct written as the paper does (examples/gated_delta_product_nested.mix: the second
Householder step projects the state the first one left, k2 @ (a S + b1 k1 (v1 - k1 @ (a S)))),
against the float64 loop from fla's naive_recurrent_gated_delta_product
(test_reference_new_specs.gdp_loop) and the hand-expanded library spec, in the float64
reference, the torch backend, decode and the recurrent kernels, with every gradient."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import mixc
from helpers import case_id, random_state
from kernel_checks import check_against_reference

from .test_reference_new_specs import TOL, assert_close, assert_gradients_match, gdp_loop, make_case

NESTED = Path(__file__).resolve().parents[2] / "examples" / "gated_delta_product_nested.mix"
CASES = {"plain": {}, "l2norm": {"use_qk_l2norm_in_kernel": True}}
_NESTED = []


def nested():
    if not _NESTED:
        _NESTED.append(mixc.load(str(NESTED)))
    return _NESTED[0]


def _case(flags: str, **kw):
    """Inputs drawn as for the library spec (unit keys or, with the norm, keys of any length;
    beta in (0, 1); log gates <= 0): both specs take the same arguments."""
    return make_case("gated_delta_product" + ("-l2norm" if flags == "l2norm" else ""), **kw)


@pytest.mark.parametrize("mode", ["reference", "torch"])
@pytest.mark.parametrize("flags", list(CASES))
def test_nested_matches_loop_and_library(flags, mode):
    B, T, H = 2, 9, 2
    lib, args, sizes, call, full = _case(flags, B=B, T=T, H=H, n=3, seed=13, requires_grad=True)
    s0 = random_state(lib.ir, B, H, sizes, seed=6, requires_grad=True)
    o, fin = nested()(**args, **call, initial_state=s0, output_final_state=True, mode=mode)
    o_lib, fin_lib = lib(**args, **call, initial_state=s0, output_final_state=True, mode=mode)
    o_l, fin_l = gdp_loop(args, full, s0)
    assert o.dtype == torch.float64
    st_tol = TOL if mode == "reference" else 1e-6    # the torch backend's states are float32
    assert_close(o, o_l, f"{flags} {mode}: output vs the loop")
    assert_close(o, o_lib, f"{flags} {mode}: output vs the library spec")
    assert_close(fin["S"], fin_l["S"], f"{flags} {mode}: final state vs the loop", tol=st_tol)
    assert_close(fin["S"], fin_lib["S"], f"{flags} {mode}: final state vs the library spec", tol=st_tol)
    assert_gradients_match(f"{flags} {mode}", o, fin, o_l, fin_l, args, s0,
                           tol=1e-9 if mode == "reference" else 1e-6)


def test_nested_step_matches_loop():
    """Decoding token by token from a random state equals the loop over the sequence."""
    B, T, H = 2, 5, 2
    lib, args, sizes, call, full = _case("plain", B=B, T=T, H=H, n=3, seed=19)
    s0 = random_state(lib.ir, B, H, sizes, seed=2)
    o_l, fin_l = gdp_loop(args, full, s0)
    st = s0
    for t in range(T):
        o, st = nested().step(**{k: v[:, t] for k, v in args.items()}, **call, state=st)
        assert_close(o, o_l[:, t], f"step {t}", tol=1e-5)
    assert_close(st["S"], fin_l["S"], "state after the steps", tol=1e-5)


@pytest.mark.parametrize("flags", [pytest.param("plain", id="plain-" + case_id(B=1, T=20, H=2, K=8)),
                                   pytest.param("l2norm", id="l2norm-" + case_id(B=1, T=20, H=2, K=8),
                                                marks=pytest.mark.slow)])
def test_nested_recurrent_kernels_match_loop(flags):
    """The recurrent kernels (Triton's interpreter, float32): forward, final state and every
    gradient against the float64 loop, within 4x the float32 torch backend's error."""
    _, args, sizes, call, full = _case(flags, B=1, T=20, H=2, n=8, seed=31, dtype=torch.float32,
                                       requires_grad=True)
    s0 = random_state(nested().ir, 1, 2, sizes, seed=4, dtype=torch.float32, requires_grad=True)
    check_against_reference(nested(), call, args, s0, torch.float32, mode="recurrent",
                            formula=lambda a, s: gdp_loop(a, full, s))
