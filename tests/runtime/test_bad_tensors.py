"""How the op reacts to bad tensor arguments (issue 6).

Every error is an ArgumentError whose message names the argument and gives the expected and
the actual shape, dtype or device; test_signature.py has the first cases of each kind, this
file the rest. Strided inputs must work like their contiguous copies, and the kernels must
write every element of their outputs (MIXC_POISON=1 fills them with NaN first) and none of
their inputs. Shapes stay tiny: the kernels run in Triton's interpreter."""
import os
import re

import pytest
import torch

import mixc
from mixc.standalone import launcher
from mixc.runtime.signature import ArgumentError

from helpers import random_args, random_state

B, T, H, K, V = 1, 5, 2, 4, 4         # B = 1 so that cu_seqlens may be passed


@pytest.fixture(scope="module")
def gla():
    return mixc.load("gla")


@pytest.fixture(scope="module")
def rwkv6():            # a spec with a param: u [H, K]
    return mixc.load("rwkv6")


@pytest.fixture(scope="module")
def delta_rule():       # a scalar per head: beta [B, T, H]
    return mixc.load("delta_rule")


def _args(op):
    args, _ = random_args(op.ir, B=B, T=T, H=H, sizes={"K": K, "V": V}, dtype=torch.float32)
    return args


def _state(op):
    return random_state(op.ir, B, H, {"K": K, "V": V}, dtype=torch.float32)


def _token(args):
    """One token per sequence, as step() takes it: [B, H, *dims]."""
    return {name: x[:, 0] for name, x in args.items()}


def _op(request, name):
    return request.getfixturevalue(name)


def _raises(op, args, match, **kw):
    # mode="torch": the check comes before any backend, and should it not fire the torch
    # backend fails fast instead of running the interpreter
    with pytest.raises(ArgumentError, match=match):
        op(**args, mode="torch", **kw)


# ---- 1. shapes: rank, and sizes that disagree between arguments -------------------------

@pytest.mark.parametrize("spec,change,match", [
    pytest.param("gla", lambda a: a.update(v=a["v"][..., None]),
                 r"v: expected an input of shape \[B, T, H, V\] \(rank 4\), got shape \[1, 5, 2, 4, 1\] \(rank 5\)",
                 id="gla-v-rank5"),
    # a scalar per head given a trailing axis of 1, as some callers keep it
    pytest.param("delta_rule", lambda a: a.update(beta=a["beta"][..., None]),
                 r"beta: expected an input of shape \[B, T, H\] \(rank 3\), got shape \[1, 5, 2, 1\] \(rank 4\)",
                 id="delta_rule-beta-trailing-1"),
    pytest.param("rwkv6", lambda a: a.update(u=a["u"][None]),
                 r"u: expected a per-head param of shape \[H, K\] \(rank 2\), got shape \[1, 2, 4\] \(rank 3\)",
                 id="rwkv6-u-rank3"),
    # q binds K = 4 first; g (the last K-sized input) disagrees
    pytest.param("gla", lambda a: a.update(g=a["g"][..., :3]),
                 r"g: dim K \(axis 3\) is 3, but q gives K = 4; expected shape \[B=1, T=5, H=2, K=4\], "
                 r"got \[1, 5, 2, 3\]", id="gla-g-K-vs-q"),
    pytest.param("gla", lambda a: a.update(k=a["k"][:, :3]),
                 r"k: dim T \(axis 1\) is 3, but q gives T = 5; expected shape \[B=1, T=5, H=2, K=4\], "
                 r"got \[1, 3, 2, 4\]", id="gla-k-T-vs-q"),
    # an input's heads must divide H, the most of any input's (one with fewer is grouped)
    pytest.param("gla", lambda a: a.update(v=torch.cat([a["v"], a["v"][:, :, :1]], 2)),
                 r"q: has 2 heads \(axis 2\), which do not divide H = 3 \(v's heads\); an input shared by "
                 r"groups of heads", id="gla-q-H-vs-v"),
    pytest.param("gla", lambda a: a.update(g=torch.cat([a["g"], a["g"]])),
                 r"g: dim B \(axis 0\) is 2, but q gives B = 1; expected shape \[B=1, T=5, H=2, K=4\], "
                 r"got \[2, 5, 2, 4\]", id="gla-g-B-vs-q"),
    pytest.param("delta_rule", lambda a: a.update(beta=a["beta"][:, :4]),
                 r"beta: dim T \(axis 1\) is 4, but q gives T = 5; expected shape \[B=1, T=5, H=2\], got \[1, 4, 2\]",
                 id="delta_rule-beta-T-vs-q"),
    # a param's H and K checked against the inputs'
    pytest.param("rwkv6", lambda a: a.update(u=a["u"][:, :3]),
                 r"u: dim K \(axis 1\) is 3, but r gives K = 4; expected shape \[H=2, K=4\], got \[2, 3\]",
                 id="rwkv6-u-K-vs-r"),
])
def test_shape_errors(request, spec, change, match):
    op = _op(request, spec)
    args = _args(op)
    change(args)
    _raises(op, args, match)


# ---- 2. dtypes -------------------------------------------------------------------------

FLOATS = r"expected a floating-point tensor \(float16, bfloat16, float32 or float64\), got dtype "


@pytest.mark.parametrize("spec,name,dtype", [
    pytest.param("gla", "k", torch.int64, id="gla-k-int64"),
    pytest.param("gla", "g", torch.bool, id="gla-g-bool"),
    pytest.param("gla", "v", torch.complex64, id="gla-v-complex64"),
    pytest.param("gla", "q", torch.complex128, id="gla-q-complex128"),
    pytest.param("gla", "q", torch.float8_e4m3fn, id="gla-q-float8"),      # floating, but not one we compute in
    pytest.param("delta_rule", "beta", torch.uint8, id="delta_rule-beta-uint8"),
    pytest.param("rwkv6", "u", torch.int32, id="rwkv6-u-int32"),
])
def test_dtype_errors(request, spec, name, dtype):
    op = _op(request, spec)
    args = _args(op)
    args[name] = args[name].to(dtype)
    _raises(op, args, re.escape(f"{name}: ") + FLOATS + re.escape(str(dtype)))


@pytest.mark.parametrize("dtype", [torch.int32, torch.complex64], ids=str)
def test_state_dtype_errors(gla, dtype):
    _raises(gla, _args(gla), r"initial_state\['S'\]: " + FLOATS + re.escape(str(dtype)),
            initial_state={"S": _state(gla)["S"].to(dtype)})


@pytest.mark.parametrize("mode", ["torch", "recurrent", "chunk"])
@pytest.mark.parametrize("dtypes", [
    pytest.param({"v": torch.float64, "g": torch.float64}, id="q32-v64"),
    pytest.param({"q": torch.float64}, id="q64-rest32"),
])
def test_mixed_float_dtypes_are_allowed(gla, mode, dtypes):
    """The rule (signature.py's docstring): inputs may mix float dtypes; each is read in its
    own dtype, the output takes the first input's (q's) dtype, each gradient its tensor's.
    float64 values that float32 holds exactly give the all-float32 result."""
    base = _args(gla)
    mixed = {n: x.to(dtypes.get(n, x.dtype), copy=True).requires_grad_() for n, x in base.items()}
    plain = {n: x.clone().requires_grad_() for n, x in base.items()}
    o, _ = gla(**mixed, mode=mode)
    o_ref, _ = gla(**plain, mode=mode)
    assert o.dtype == mixed["q"].dtype
    torch.testing.assert_close(o.float(), o_ref)
    o.sum().backward()
    o_ref.sum().backward()
    for n, x in mixed.items():
        assert x.grad.dtype == x.dtype, n
        torch.testing.assert_close(x.grad.float(), plain[n].grad, msg=n)


# ---- 3. devices (no GPU here: the "meta" device stands in for a second one) ---------------

def _meta(name):
    return lambda a, kw: a.update({name: a[name].to("meta")})


@pytest.mark.parametrize("spec,change,match", [
    pytest.param("gla", _meta("k"),
                 r"k: on device meta, but q is on cpu; inputs, params and states must be on one device",
                 id="gla-k-meta"),
    # the first tensor sets the device: the message then blames the next one, naming both
    pytest.param("gla", _meta("q"), r"k: on device cpu, but q is on meta", id="gla-q-meta"),
    pytest.param("rwkv6", _meta("u"), r"u: on device meta, but r is on cpu", id="rwkv6-param-u-meta"),
    pytest.param("gla", lambda a, kw: kw.update(initial_state={"S": torch.zeros(B, H, K, V, device="meta")}),
                 r"initial_state\['S'\]: on device meta, but q is on cpu", id="gla-state-meta"),
    pytest.param("gla", lambda a, kw: kw.update(cu_seqlens=torch.tensor([0, 2, 5], device="meta")),
                 r"cu_seqlens: on device meta, which holds no offsets to check; pass it on the CPU",
                 id="gla-cu_seqlens-meta"),
])
def test_mixed_devices(request, spec, change, match):
    op = _op(request, spec)
    args, kw = _args(op), {}
    change(args, kw)
    _raises(op, args, match, **kw)


@pytest.mark.parametrize("mode", ["torch", "recurrent", "chunk", "auto"])
def test_every_tensor_on_meta_is_refused_where_values_are_read(gla, mode):
    """Inputs all on the meta device: mode torch raised torch's 'Tensor.item() cannot be called
    on meta tensors' from inside mixc (issue 30); every mode that reads values names the input,
    the float64 reference propagates the shapes."""
    meta = {n: x.to("meta") for n, x in _args(gla).items()}
    with pytest.raises(ArgumentError, match=rf"q: on device meta, which holds no values; mode '\w+' computes"):
        gla(**meta, mode=mode)
    with pytest.raises(ArgumentError, match=r"q: on device meta, which holds no values"):
        gla.step(**_token(meta), state={"S": torch.zeros(B, H, K, V, device="meta")}, mode=mode)
    o, _ = gla(**meta, mode="reference")
    assert o.device.type == "meta" and o.shape == (B, T, H, V)


@pytest.mark.parametrize("kind", ["nested", "jagged", "sparse"])
def test_nested_and_sparse_tensors_are_refused_by_name(gla, kind):
    """A nested (strided or jagged) or sparse input raised torch's internal errors ('NestedTensorImpl
    doesn't support sizes', 'expand is unsupported for Sparse tensors')."""
    args = _args(gla)
    if kind == "sparse":
        args["k"] = args["k"].to_sparse()
        match = r"k: expected a dense \(strided\) tensor of shape \[B, T, H, K\], got layout torch.sparse_coo"
    else:
        rows = [args["k"][0], args["k"][0, :3]]
        args["k"] = torch.nested.nested_tensor(rows, layout=torch.jagged if kind == "jagged" else torch.strided)
        match = r"k: expected a dense \(strided\) tensor .* got a nested tensor; pack sequences"
    _raises(gla, args, match)


def test_step_state_on_another_device(gla):
    with pytest.raises(ArgumentError, match=r"state\['S'\]: on device meta, but q is on cpu"):
        gla.step(**_token(_args(gla)), state={"S": torch.zeros(B, H, K, V, device="meta")})


# ---- 4. missing, unknown and misplaced arguments ------------------------------------------

GLA_TAKES = "q, k, v, g, scale, initial_state, output_final_state, cu_seqlens"


@pytest.mark.parametrize("spec,change,match", [
    pytest.param("rwkv6", lambda a: a.pop("u"), r"missing param 'u' of shape \[H, K\]", id="missing-param"),
    pytest.param("delta_rule", lambda a: a.pop("beta"), r"missing input 'beta' of shape \[B, T, H\]",
                 id="missing-scalar-input"),
    # an unknown keyword is named, and the message lists every argument the op takes
    pytest.param("gla", lambda a: a.update(u=a["q"]),
                 rf"unexpected argument 'u' for mixer 'gla'; it takes {GLA_TAKES}$", id="unknown"),
    pytest.param("gla", lambda a: a.update(intial_state=None, beta=a["q"]),
                 rf"unexpected arguments 'beta', 'intial_state' for mixer 'gla'; it takes {GLA_TAKES}$",
                 id="two-unknown-one-a-typo"),
    # a param where an input belongs and the reverse: the rank tells them apart
    pytest.param("rwkv6", lambda a: a.update(u=a["r"]),
                 r"u: expected a per-head param of shape \[H, K\] \(rank 2\), got shape \[1, 5, 2, 4\] \(rank 4\)",
                 id="input-passed-as-param"),
    pytest.param("rwkv6", lambda a: a.update(r=a["u"]),
                 r"r: expected an input of shape \[B, T, H, K\] \(rank 4\), got shape \[2, 4\] \(rank 2\)",
                 id="param-passed-as-input"),
])
def test_argument_name_errors(request, spec, change, match):
    op = _op(request, spec)
    args = _args(op)
    change(args)
    _raises(op, args, match)


def test_step_unknown_argument_lists_steps_arguments(gla):
    # step() has no output_final_state: the message must not offer it
    with pytest.raises(ArgumentError, match=r"unexpected argument 'output_final_state' for step\(\) of mixer 'gla'; "
                                            r"it takes q, k, v, g, scale, state$"):
        gla.step(**_token(_args(gla)), state=_state(gla), output_final_state=True)


# ---- 5. strided inputs ---------------------------------------------------------------------

def _strided(x, layout):
    """A non-contiguous view of a fresh buffer, its values those of x (expanded: of x's first
    slice along axis 1)."""
    if layout == "transposed":          # axes 1 and 2 swapped in memory
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "step2":               # every other element along axis 1
        big = x.new_zeros(x.shape[:1] + (2 * x.shape[1],) + x.shape[2:])
        big[:, ::2] = x
        return big[:, ::2]
    if layout == "inner-step2":         # the last axis strided: the kernels assume it unit-stride
        big = x.new_zeros(x.shape[:-1] + (2 * x.shape[-1],))
        big[..., ::2] = x
        return big[..., ::2]
    if layout == "expanded":            # stride 0 along axis 1
        return x[:, :1].expand(x.shape)
    raise ValueError(layout)


@pytest.mark.parametrize("mode", ["torch", "recurrent", "chunk"])
@pytest.mark.parametrize("layout", ["transposed", "step2", "inner-step2", "expanded"])
def test_strided_inputs_match_contiguous(gla, mode, layout):
    """Views (inputs, initial state and the output's gradient) give what their contiguous
    copies give, forward and backward."""
    args, st = _args(gla), _state(gla)
    views = {n: _strided(x, layout).detach().requires_grad_() for n, x in args.items()}
    s_view = _strided(st["S"], layout).detach().requires_grad_()
    assert not any(x.is_contiguous() for x in (*views.values(), s_view))       # else this tests nothing
    copies = {n: x.detach().contiguous().requires_grad_() for n, x in views.items()}
    s_copy = s_view.detach().contiguous().requires_grad_()

    do = _strided(torch.randn(B, T, H, V, generator=torch.Generator().manual_seed(3)), layout)
    results = []
    for a, s in ((views, s_view), (copies, s_copy)):
        o, fin = gla(**a, initial_state=s, output_final_state=True, mode=mode)
        o.backward(do)
        results.append((o, fin["S"], *(x.grad for x in a.values()), s.grad))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want)


# ---- 6. cu_seqlens (test_signature.py has: not ending at T, not starting at 0, decreasing,
# float, B != 1) ------------------------------------------------------------------------------

@pytest.mark.parametrize("cu,match", [
    pytest.param(torch.tensor([[0, 2, 5]]), r"cu_seqlens: expected a 1-D int32 or int64 tensor of sequence offsets, "
                 r"got dtype torch.int64, shape \[1, 3\]", id="2d"),
    pytest.param(torch.tensor([0, 2, 5], dtype=torch.int16), r"cu_seqlens: expected a 1-D int32 or int64 .*"
                 r"got dtype torch.int16, shape \[3\]", id="int16"),
    pytest.param([0, 2, 5], r"cu_seqlens: expected a 1-D int32 or int64 tensor of sequence offsets, got list",
                 id="list"),
    pytest.param(torch.tensor([0, 3, 2, 5]), r"cu_seqlens: offsets must be non-decreasing, got 3 then 2 "
                 r"\(cu_seqlens\[1\] > cu_seqlens\[2\]\)", id="decreasing-names-the-offsets"),
    pytest.param(torch.tensor([0, -1, 5]), r"non-decreasing, got 0 then -1", id="negative"),
    pytest.param(torch.tensor([0, 2, 6]), r"cu_seqlens: must start at 0 and end at T = 5, got \[0, 2, 6\]",
                 id="past-T"),
    pytest.param(torch.tensor([0]), r"must start at 0 and end at T = 5, got \[0\]", id="one-offset"),
    pytest.param(torch.tensor([], dtype=torch.int32), r"must start at 0 and end at T = 5, got \[\]", id="empty"),
])
def test_cu_seqlens_errors(gla, cu, match):
    _raises(gla, _args(gla), match, cu_seqlens=cu)


def test_cu_seqlens_refused_by_step(gla):
    with pytest.raises(ArgumentError, match=r"cu_seqlens: not accepted by step\(\)"):
        gla.step(**_token(_args(gla)), state=_state(gla), cu_seqlens=torch.tensor([0, 1]))


# ---- 7. states (test_signature.py has: dims swapped, an extra key, a missing one of two) ---

@pytest.mark.parametrize("kw,match", [
    pytest.param(dict(initial_state={"S": torch.zeros(2, H, K, V)}),
                 r"initial_state\['S'\]: expected shape \[B=1, H=2, K=4, V=4\], got \[2, 2, 4, 4\]", id="B"),
    pytest.param(dict(initial_state={"S": torch.zeros(H, K, V)}),
                 r"initial_state\['S'\]: expected shape \[B=1, H=2, K=4, V=4\], got \[2, 4, 4\]", id="no-B-axis"),
    # two packed sequences need two states
    pytest.param(dict(initial_state={"S": torch.zeros(1, H, K, V)}, cu_seqlens=torch.tensor([0, 2, 5])),
                 r"initial_state\['S'\]: expected shape \[N=2, H=2, K=4, V=4\], got \[1, 2, 4, 4\]",
                 id="N-with-cu_seqlens"),
    pytest.param(dict(initial_state={}), r"initial_state: missing state 'S' \(expected \[B, H, K, V\]\)",
                 id="missing-key"),
    pytest.param(dict(initial_state={"S": torch.zeros(2, H, K, V)}, cu_seqlens=torch.tensor([0, 5])),
                 r"initial_state\['S'\]: expected shape \[N=1, H=2, K=4, V=4\], got \[2, 2, 4, 4\]",
                 id="N-too-many-with-cu_seqlens"),
    pytest.param(dict(initial_state=[torch.zeros(1, H, K, V)]),
                 r"initial_state: expected a dict keyed by state name, got list", id="list"),
    pytest.param(dict(initial_state={"S": torch.zeros(1, H, K, V).tolist()}),
                 r"initial_state\['S'\]: expected shape \[B=1, H=2, K=4, V=4\], got list", id="not-a-tensor"),
])
def test_state_errors(gla, kw, match):
    _raises(gla, _args(gla), match, **kw)


@pytest.mark.parametrize("state,match", [
    # step() calls the argument state: so do its messages
    pytest.param({"S": torch.zeros(2, H, K, V)},
                 r"state\['S'\]: expected shape \[B=1, H=2, K=4, V=4\], got \[2, 2, 4, 4\]", id="B"),
    pytest.param({}, r"state: missing state 'S'", id="missing-key"),
    pytest.param({"S": torch.zeros(B, H, K, V), "Z": torch.zeros(B, H, K, V)},
                 r"state: unknown state 'Z'; mixer 'gla' has S", id="extra-key"),
])
def test_step_state_errors(gla, state, match):
    with pytest.raises(ArgumentError, match=match):
        gla.step(**_token(_args(gla)), state=state)


# ---- 8. step() takes one token per sequence ------------------------------------------------

ONE_TOKEN = r"; step\(\) takes one token per sequence, without the T axis"


@pytest.mark.parametrize("spec,tokens,match", [
    pytest.param("gla", T, r"q: expected an input of shape \[B, H, K\] \(rank 3\), got shape \[1, 5, 2, 4\] \(rank 4\)",
                 id="gla-T5"),
    # a sequence of one token still has the T axis
    pytest.param("gla", 1, r"q: expected an input of shape \[B, H, K\] \(rank 3\), got shape \[1, 1, 2, 4\] \(rank 4\)",
                 id="gla-T1"),
    pytest.param("delta_rule", 1, r"q: .* got shape \[1, 1, 2, 4\] \(rank 4\)", id="delta_rule-T1"),
])
def test_step_with_T_axis(request, spec, tokens, match):
    op = _op(request, spec)
    args = {n: x[:, :tokens] for n, x in _args(op).items()}
    with pytest.raises(ArgumentError, match=match + ONE_TOKEN):
        op.step(**args, state=_state(op))


def test_step_with_T_axis_on_one_input_only(delta_rule):
    # q is one token; beta kept its T axis of 1: beta is named
    args = _token(_args(delta_rule))
    args["beta"] = args["beta"][:, None]
    with pytest.raises(ArgumentError, match=r"beta: expected an input of shape \[B, H\] \(rank 2\), got shape "
                                            r"\[1, 1, 2\] \(rank 3\)" + ONE_TOKEN):
        delta_rule.step(**args, state=_state(delta_rule))


def test_step_rejects_unknown_mode(gla):
    try:
        gla.step(**_token(_args(gla)), state=_state(gla), mode="chunked")
    except ArgumentError as e:
        assert re.search(r"mode: expected one of .* got 'chunked'", str(e))
    else:
        raise AssertionError("step(mode='chunked') ran")


def test_step_rejects_initial_state(gla):
    with pytest.raises(ArgumentError, match=r"initial_state: step\(\) takes the state as state="):
        gla.step(**_token(_args(gla)), state=_state(gla), initial_state=_state(gla))


# ---- 9. canary: every output element written, no input written ------------------------------

@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed"])
@pytest.mark.parametrize("mode", ["recurrent", "chunk"])
@pytest.mark.parametrize("spec", ["gla", "delta_rule"])
def test_kernels_write_all_outputs_and_no_inputs(request, spec, mode, packed):
    """Odd sizes (K=5, V=3, T=7, H=3) make the kernels pad every block to a power of two and end
    on a partial chunk. Under MIXC_POISON=1 every output buffer starts as NaN, so an element a
    kernel forgets (or masks away) stays NaN in the output, the final state or a gradient."""
    assert os.environ.get("MIXC_POISON") == "1"              # set by conftest.py; without it this checks nothing
    assert torch.isnan(launcher.empty((2,), torch.float32, "cpu")).all()
    op = _op(request, spec)
    Tc, Hc, sizes = 7, 3, {"K": 5, "V": 3}
    Bc, cu = (1, torch.tensor([0, 3, 7])) if packed else (2, None)
    args, _ = random_args(op.ir, B=Bc, T=Tc, H=Hc, sizes=sizes, dtype=torch.float32, requires_grad=True)
    st = random_state(op.ir, 2, Hc, sizes, dtype=torch.float32, requires_grad=True)
    gen = torch.Generator().manual_seed(5)
    do = torch.randn(Bc, Tc, Hc, sizes["V"], generator=gen)
    dfin = torch.randn(2, Hc, sizes["K"], sizes["V"], generator=gen)
    given = [*args.values(), *st.values(), do, dfin] + ([cu] if packed else [])
    before = [x.detach().clone() for x in given]

    # CK=4: the recurrent forward keeps two checkpoints per sequence, the last chunk partial
    o, fin = op(**args, initial_state=st, output_final_state=True, cu_seqlens=cu, mode=mode,
                **({"CK": 4} if mode == "recurrent" else {}))
    for x, x0 in zip(given, before):
        assert torch.equal(x, x0), "the forward wrote into an argument"
    torch.autograd.backward([o, fin["S"]], [do, dfin])
    for x, x0 in zip(given, before):
        assert torch.equal(x, x0), "the backward wrote into an argument"

    named = {"o": o, "final S": fin["S"], **{f"d{n}": x.grad for n, x in args.items()}, "dS0": st["S"].grad}
    for name, x in named.items():
        assert not torch.isnan(x).any(), f"{name}: {int(torch.isnan(x).sum())} elements left unwritten (NaN)"
