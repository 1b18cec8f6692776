"""The torch backend one token at a time (issue 33 item 1): the generated torch_step (functional,
autograd), torch_step_ (in place: mul_ / addcmul_ on the buffers) and torch_tokens (the token
loop of a prefill), codegen/torch_step.py, against the float64 reference on fresh random
inputs: outputs, states (several tokens chained), gradients; the in-place step with and
without cache slots; stabilized specs with gates past exp's range stay finite."""
import glob
import math
import os

import pytest
import torch

import mixc
from mixc import pipeline
from mixc.standalone.shift import Carry
from mixc.runtime import torch_step as torch_step_rt
from mixc.runtime.cache import load_module
from mixc.runtime.signature import bind
from mixc.standalone import torch_tokens as torch_tokens_driver

from helpers import case_id, random_args, random_state

SPECS = sorted(n for n in (os.path.basename(p)[:-4] for p in glob.glob(os.path.join(
    os.path.dirname(mixc.__file__), "specs", "*.mix"))) if not mixc.load(n).is_sequence)
B, H, T = 2, 2, 5
SIZES = {"K": 4, "V": 3}
ID = case_id(B=B, H=H, K=4, V=3)


def _close(got, want, what, rtol=1e-4, atol=1e-5):
    torch.testing.assert_close(got.double(), want.double(), rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def _tokens(op, seed, n=T, dtype=torch.float32, requires_grad=False):
    """n tokens of every input ([B, H, *dims] each), the params, and the sizes."""
    args, sizes = random_args(op.ir, B=B, T=n, H=H, sizes=SIZES, seed=seed, dtype=dtype, requires_grad=requires_grad)
    names = {d.name for d in op.ir.inputs}
    steps = [{k: (v[:, t] if k in names else v) for k, v in args.items()} for t in range(n)]
    return args, steps, sizes


def _f64(d):
    return {k: v.detach().double() for k, v in d.items()}


def test_every_recurrent_library_spec_is_covered():
    assert {"gla", "gated_delta_rule", "rwkv4", "mlstm", "mamba2", "rwkv7"} <= set(SPECS)


@pytest.mark.parametrize("name", SPECS, ids=[f"{n}-{ID}" for n in SPECS])
def test_step_equals_the_reference_over_chained_tokens(name):
    """Functional, in place, and in place into cache slots: each token's output and state."""
    op = mixc.load(name)
    _, steps, sizes = _tokens(op, seed=3)
    state = {k: v.float() for k, v in random_state(op.ir, B, H, sizes, seed=4).items()}
    buffers = {k: v.clone() for k, v in state.items()}
    slots, idx = 5, torch.tensor([3, 1])
    cache = {k: torch.randn((slots,) + v.shape[1:]) for k, v in state.items()}
    for k in cache:
        cache[k][idx] = state[k]
    untouched = {k: v[[0, 2, 4]].clone() for k, v in cache.items()}
    ref_state = _f64(state)
    for t, one in enumerate(steps):
        ref_o, ref_state = op.reference_step(**_f64(one), state=ref_state)
        o, state = op.step(**one, state=state, mode="torch")
        with torch.no_grad():
            oi, same = op.step(**one, state=buffers, mode="torch", inplace=True)
            oc, _ = op.step(**one, state=cache, state_indices=idx, mode="torch", inplace=True)
        assert same is buffers
        for label, got in (("step", o), ("in place", oi), ("slots", oc)):
            _close(got, ref_o, f"{name} token {t} output ({label})")
        for k in ref_state:
            _close(state[k], ref_state[k], f"{name} token {t} state {k}")
            _close(buffers[k], ref_state[k], f"{name} token {t} state {k} (in place)")
            _close(cache[k][idx], ref_state[k], f"{name} token {t} state {k} (slots)")
    for k in cache:
        assert torch.equal(cache[k][[0, 2, 4]], untouched[k])


@pytest.mark.parametrize("name", SPECS, ids=[f"{n}-{ID}" for n in SPECS])
def test_step_gradients_equal_the_reference(name):
    op = mixc.load(name)
    args, steps, sizes = _tokens(op, seed=5, n=1)
    one = {k: v.detach().float().requires_grad_() for k, v in steps[0].items()}
    state = {k: v.float().requires_grad_() for k, v in random_state(op.ir, B, H, sizes, seed=6).items()}
    ref_one = {k: v.detach().double().requires_grad_() for k, v in one.items()}
    ref_state = {k: v.detach().double().requires_grad_() for k, v in state.items()}
    o, st = op.step(**one, state=state, mode="torch")
    ro, rst = op.reference_step(**ref_one, state=ref_state)
    _gradients_agree((o, st), (ro, rst), [("d", one, ref_one), ("dstate", state, ref_state)], name, seed=7)


def _gradients_agree(got, want, leaves, name: str, seed: int) -> None:
    """Backpropagate one random weighting of (output, states) through mixc's result and the
    float64 reference's; each leaf's gradient (leaves: (label, mixc's leaves, the reference's))
    must agree."""
    (o, st), (ro, rst) = got, want
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(ro.shape, generator=gen, dtype=torch.float64)
    ws = {k: torch.randn(v.shape, generator=gen, dtype=torch.float64) for k, v in rst.items()}

    def loss(o, st):
        return (o.double() * w).sum() + sum((st[k].double() * ws[k]).sum() for k in ws)
    loss(o, st).backward()
    loss(ro, rst).backward()
    for label, mine, ref in leaves:
        for k in mine:
            what = f"{name} {label}{k}" if label == "d" else f"{name} {label}[{k}]"
            _close(mine[k].grad, ref[k].grad, what, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("packed", [False, True], ids=["fixed", "cu_seqlens"])
@pytest.mark.parametrize("name", SPECS, ids=[f"{n}-{ID}-T{T}" for n in SPECS])
def test_token_loop_equals_the_reference_with_gradients(name, packed, monkeypatch):
    """The prefill's token loop (every spec: the runtime takes it for some, mode 'torch'):
    outputs, final states and the gradients of inputs, params and the initial state; in blocks
    of 4 tokens (the state carried from block to block, a packed sequence split across two)."""
    monkeypatch.setattr(torch_tokens_driver, "TOKEN_BLOCK", 4)
    op = mixc.load(name)
    args, _, sizes = _tokens(op, seed=8, n=6)
    n_seq = B
    if packed:                      # B sequences of 2 and 4 tokens packed in one row
        names = {d.name for d in op.ir.inputs}
        args = {k: (v[:1].reshape(1, 6, *v.shape[2:]) if k in names else v) for k, v in args.items()}
        cu = torch.tensor([0, 2, 6])
    else:
        cu = None
    args = {k: v.float().requires_grad_() for k, v in args.items()}
    init = {k: v.float().requires_grad_() for k, v in random_state(op.ir, n_seq, H, sizes, seed=9).items()}
    ref_args = {k: v.detach().double().requires_grad_() for k, v in args.items()}
    ref_init = {k: v.detach().double().requires_grad_() for k, v in init.items()}
    carry = Carry(op.ir, args, init, cu)     # prev(x) of inputs: the op's derived prev_x (standalone/shift.py)
    bound = bind(op.ir, dict(carry.kwargs, initial_state=carry.state, cu_seqlens=cu)).expanded()
    o, st = torch_step_rt.torch_tokens(op.plan(), bound, output_final_state=True, dtype=torch.float32)
    st = carry.final(st)
    ro, rst = op(**ref_args, initial_state=ref_init, output_final_state=True, cu_seqlens=cu, mode="reference")
    _close(o, ro, f"{name} output")
    for k in rst:
        _close(st[k], rst[k], f"{name} final {k}")
    _gradients_agree((o, st), (ro, rst), [("d", args, ref_args), ("dinit", init, ref_init)], name, seed=10)


@pytest.mark.parametrize("block", [4, 64], ids=["blocks-of-4", "one-block"])
@pytest.mark.parametrize("packed", [False, True], ids=["fixed", "cu_seqlens"])
@pytest.mark.parametrize("name", SPECS, ids=[f"{n}-{ID}-T7" for n in SPECS])
def test_token_loop_without_gradients_writes_every_output_row(name, packed, block, monkeypatch):
    """Without autograd the token loop copies each token's output into one buffer (NaN under
    MIXC_POISON until written): equal to the float64 reference, in blocks of 4 tokens (packed:
    sequences of 5 and 2 tokens, the first split across blocks) and in one block."""
    monkeypatch.setattr(torch_tokens_driver, "TOKEN_BLOCK", block)
    op = mixc.load(name)
    args, _, sizes = _tokens(op, seed=12, n=7)
    cu, n_seq = None, B
    if packed:
        names = {d.name for d in op.ir.inputs}
        args = {k: (v[:1] if k in names else v) for k, v in args.items()}
        cu = torch.tensor([0, 5, 7])
    args = {k: v.float() for k, v in args.items()}
    init = {k: v.float() for k, v in random_state(op.ir, n_seq, H, sizes, seed=13).items()}
    carry = Carry(op.ir, args, init, cu)
    bound = bind(op.ir, dict(carry.kwargs, initial_state=carry.state, cu_seqlens=cu)).expanded()
    with torch.no_grad():
        o, st = torch_step_rt.torch_tokens(op.plan(), bound, output_final_state=True, dtype=torch.float32)
    st = carry.final(st)
    ro, rst = op(**{k: v.double() for k, v in args.items()}, initial_state={k: v.double() for k, v in init.items()},
                 output_final_state=True, cu_seqlens=cu, mode="reference")
    _close(o, ro, f"{name} output")
    for k in rst:
        _close(st[k], rst[k], f"{name} final {k}")


@pytest.mark.parametrize("name,loop", [("rwkv4", True), ("hgrn", True), ("mamba", True), ("mlstm", False),
                                       ("gla", False), ("gated_delta_rule", False)])
def test_mode_torch_takes_the_token_loop_where_the_chunked_form_has_no_matmul(name, loop, monkeypatch):
    """Elementwise and value-diagonal classes and short vector states loop over the tokens;
    matrix states (stabilized too) take the chunked form."""
    op = mixc.load(name)
    args, _, _ = _tokens(op, seed=11, n=6)
    called = []
    real = torch_step_rt._driver.tokens
    monkeypatch.setattr(torch_step_rt._driver, "tokens", lambda *a, **k: called.append(1) or real(*a, **k))
    o, _ = op(**{k: v.float() for k, v in args.items()}, mode="torch")
    ro, _ = op(**args, mode="reference")
    _close(o, ro, name)
    assert bool(called) == loop


def test_rwkv4_keys_past_exp_range_stay_finite_and_equal_the_shifted_reference():
    """RWKV-4's WKV is unchanged when the keys and the state's log scale move together: with
    keys near 200 (exp overflows float32 past 88) the step and the prefill stay finite and equal
    the float64 reference run on k - c with the state scaled by exp(-c)."""
    op = mixc.load("rwkv4")
    args, steps, sizes = _tokens(op, seed=12, n=4)
    c = 200.0
    big = {k: (v + c if k == "k" else v).float() for k, v in args.items()}
    o, st = op(**big, mode="torch", output_final_state=True)
    ref, _ = op(**args, mode="reference", output_final_state=True)
    assert torch.isfinite(o).all()
    _close(o, ref, "prefill output")
    state = {k: v.abs() for k, v in random_state(op.ir, B, H, sizes, seed=13).items()}
    one = {k: (v + c if k == "k" else v).float() for k, v in steps[0].items()}
    o1, _ = op.step(**one, state={k: v.float() for k, v in state.items()}, mode="torch")
    ro1, _ = op.reference_step(**_f64(steps[0]), state={k: v * math.exp(-c) for k, v in state.items()})
    assert torch.isfinite(o1).all()
    _close(o1, ro1, "step output")


def test_mlstm_input_gates_past_exp_range_keep_outputs_finite():
    op = mixc.load("mlstm")
    args, steps, sizes = _tokens(op, seed=14, n=4)
    big = {k: (v + 300 if k == "i" else v).float() for k, v in args.items()}
    o, _ = op(**big, mode="torch")
    assert torch.isfinite(o).all()
    state = {k: v.float() for k, v in random_state(op.ir, B, H, sizes, seed=15).items()}
    one = {k: (v + 300 if k == "i" else v).float() for k, v in steps[0].items()}
    o1, st = op.step(**one, state=state, mode="torch")
    assert torch.isfinite(o1).all()
    assert not torch.isfinite(st["C"]).all()        # the spec's own state overflows: returned as is


def test_the_in_place_step_writes_the_buffers_without_a_new_state():
    """gla's torch_step_ updates S with mul_ and addcmul_; mlstm (stabilized) has none and is
    copied back; the replayed call (second and later) gives the same numbers."""
    op = mixc.load("gla")
    mod = load_module(op.plan())
    source = open(mod.__file__).read()
    body = source.split("def torch_step_(")[1].split("\ndef ")[0]
    assert "s_S.mul_(" in body and "s_S.addcmul_(" in body and "s_S =" in body.split("s_S.mul_")[0]
    assert load_module(mixc.load("mlstm").plan()).torch_step_ is None
    _, steps, sizes = _tokens(op, seed=16, n=3)
    state = {k: v.float() for k, v in random_state(op.ir, B, H, sizes, seed=17).items()}
    buf = {k: v.clone() for k, v in state.items()}
    ptr = buf["S"].data_ptr()
    for one in steps:
        want, state = op.step(**one, state=state, mode="torch")
        with torch.no_grad():
            got, _ = op.step(**one, state=buf, mode="torch", inplace=True)
        _close(got, want, "output", rtol=1e-6, atol=1e-6)
        _close(buf["S"], state["S"], "state", rtol=1e-6, atol=1e-6)
    assert buf["S"].data_ptr() == ptr
    assert any(isinstance(r, torch_step_rt.TorchStep) for r in op._fast.values())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_step_in_float32(dtype):
    op = mixc.load("gated_delta_rule")
    _, steps, sizes = _tokens(op, seed=18, n=1)
    one = {k: v.to(dtype) for k, v in steps[0].items()}
    state = {k: v.float() for k, v in random_state(op.ir, B, H, sizes, seed=19).items()}
    o, st = op.step(**one, state=state, mode="torch")
    want, want_st = op.step(**{k: v.float() for k, v in one.items()}, state=state, mode="torch")
    assert o.dtype == dtype and st["S"].dtype == torch.float32
    _close(o, want, "output", rtol=1e-2, atol=1e-2)
    _close(st["S"], want_st["S"], "state", rtol=1e-6, atol=1e-6)


USER_SPECS = {
    # B_t that does not factor into key (x) value, a state declared [V, K]: printed as written
    "unfactored": """mixer unfactored
  dims   K, V
  input  q[K], k[K], v[V], g[K]
  state  S[V, K]
  update S = exp(g) * S + k * v + q * v
  output o = q @ S
""",
    # the output reads q @ prev(S) and q @ S: the in-place step must read the first before it writes
    "prev_and_new": """mixer prev_and_new
  dims   K, V
  input  q[K], k[K], v[V]
  state  S[K, V], z[K]
  update S = S + k * v
  update z = 0.5 * z + k
  output o = (q @ S) / (1 + abs(q @ z)) + q @ prev(S)
""",
    # `head` in an elementwise update: the token loop reads it only through a hoisted slice
    # (the typed fuzzer's find: _head was defined only where the hoisted lines named it)
    "head_in_update": """mixer head_in_update
  dims   K, V
  input  q[K], k[K], v[V]
  param  P[K, V]
  state  S[K, V], z[K]
  update S = S + P
  update z = z * (0.1 * head) + k
  output o = q @ S + q @ z
""",
}


@pytest.mark.parametrize("name", list(USER_SPECS))
def test_user_specs_step_in_place_and_loop_equal_the_reference(name):
    from mixc.pipeline import from_text
    op = from_text(USER_SPECS[name])
    args, steps, sizes = _tokens(op, seed=20, n=3)
    state = {k: v.float() for k, v in random_state(op.ir, B, H, sizes, seed=21).items()}
    buf = {k: v.clone() for k, v in state.items()}
    ref = _f64(state)
    for one in steps:
        ro, ref = op.reference_step(**_f64(one), state=ref)
        o, state = op.step(**one, state=state, mode="torch")
        with torch.no_grad():
            oi, _ = op.step(**one, state=buf, mode="torch", inplace=True)
        _close(o, ro, "step")
        _close(oi, ro, "in place")
        for k in ref:
            _close(state[k], ref[k], f"state {k}")
            _close(buf[k], ref[k], f"state {k} in place")
    bound = bind(op.ir, dict(args)).expanded()
    o, st = torch_step_rt.torch_tokens(op.plan(), bound, output_final_state=True, dtype=torch.float32)
    ro, rst = op(**args, output_final_state=True, mode="reference")
    _close(o, ro, "token loop")
    for k in rst:
        _close(st[k], rst[k], f"token loop final {k}")


def test_a_number_option_given_as_a_tensor_is_read_on_every_step():
    """scale as a 0-d tensor: its value is read per call, never replayed from an earlier one."""
    op = mixc.load("gla")
    _, steps, sizes = _tokens(op, seed=22, n=1)
    state = {k: v.float() for k, v in random_state(op.ir, B, H, sizes, seed=23).items()}
    outs = [op.step(**steps[0], scale=torch.tensor(s), state=state, mode="torch")[0] for s in (0.5, 2.0)]
    _close(outs[1], 4 * outs[0], "scale 2.0 against 0.5")


@pytest.mark.parametrize("name", ["delta_rule", "gated_delta_rule", "kda", "comba"])
def test_delta_rules_step_reads_the_decayed_state_once_as_written_by_hand(name):
    """The in-place step of a rank-1 correction is the update a person writes (bench/decode_cpu's
    hand-written ones): S decayed first, then u = beta (v - k^T S) from one read of it, one
    addcmul_ (no -1 * beta, no k * exp(g) before the read: each op ~2 us of a ~60 us step)."""
    import inspect
    src = inspect.getsource(load_module(mixc.load(name).plan()).torch_step_)
    body = [x.strip() for x in src.splitlines() if "s_S" in x and "_s['S']" not in x]
    assert "-1.0" not in src, src
    reads = [x for x in body if "@ s_S" in x]
    assert len(reads) == 2, src                    # the correction's read and the output's
    if name != "delta_rule":
        assert body[0].startswith("s_S.mul_("), src
    assert sum(".addcmul_(" in x for x in body) == 1, src


VALUE_PROJECTIONS = ["S + sum(S, V) + v", "S + (v + sum((g + S), V))", "S + sum(S, V) + k * v"]


@pytest.mark.parametrize("update", VALUE_PROJECTIONS, ids=["sum-V-plus-v", "sum-V-of-g-plus-S", "sum-V-plus-kv"])
def test_a_projection_over_a_value_dim_is_kept_in_the_step_and_the_token_loop(update):
    """The general class's sum(S, V) contracts a value dim: the step's pieces hold a projection
    over the key dims only, and dropped this one (mode torch 194 off a reference of 195) or
    failed to print it (the typed fuzzer's `-m slow` finds): the update is printed as written."""
    text = (f"mixer m\n dims K, V\n input q[K], k[K], v[V], g[]\n state S[K, V]\n update S = {update}\n"
            " output o = q @ S\n")
    op = pipeline.from_text(text, "m.mix")
    args, steps, sizes = _tokens(op, seed=11, dtype=torch.float64)
    state = random_state(op.ir, B, H, sizes, seed=12)
    ref, ref_final = op(**args, initial_state=state, mode="reference", output_final_state=True)
    got, got_final = op(**args, initial_state=state, mode="torch", output_final_state=True)
    _close(got, ref, f"{update}: output (mode torch)", rtol=1e-9, atol=1e-9)
    _close(got_final["S"], ref_final["S"], f"{update}: final state (mode torch)", rtol=1e-9, atol=1e-9)
    st = dict(state)
    for t, one in enumerate(steps):
        o, st = op.step(**one, state=st, mode="torch")
        _close(o, ref[:, t], f"{update}: token {t} (op.step)", rtol=1e-9, atol=1e-9)
