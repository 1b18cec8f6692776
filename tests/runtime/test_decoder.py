"""The decode object (runtime/decoder.py, issue 33): dec = op.decoder(state, <params>, mode=...),
o = dec.step(<one token>). Over several chained tokens its outputs and the buffers it updates
equal op.step(..., inplace=True)'s bit for bit and the float64 reference step's; the buffers'
storage is kept; tokens after the first run the bound step (op.step is not called); a bad gate
is refused by name as op.step refuses it (the state untouched); a token that looks different,
cache slots, prev(x) inputs, a stabilized spec and a kernel mode take op.step; bad arguments
are ArgumentErrors naming the argument."""
import pytest
import torch

import mixc
from mixc.runtime.signature import ArgumentError

from helpers import case_id, random_args, random_state

B, H, N_TOKENS = 2, 3, 4
SIZES = {"K": 5, "V": 4, "N": 3, "P": 4, "D": 4}
ID = case_id(B=B, H=H, K=5, V=4)
# the direct in-place step (mode torch) ...
BOUND = ["gla", "rwkv6", "kda", "delta_rule", "mamba2", "linear_attn", "retention"]
# ... and what takes op.step on every token: a stabilized spec (no in-place step), prev(x) inputs
THROUGH_OP_STEP = ["rwkv4", "mlstm", "mamba3"]


def _close(got, want, what):
    torch.testing.assert_close(got.double(), want.double(), rtol=1e-4, atol=1e-5, msg=lambda m: f"{what}: {m}")


def _case(name, seed=0, n=N_TOKENS):
    """n tokens of the inputs ([B, H, *dims] each, float32), the params and a float32 state."""
    op = mixc.load(name)
    args, sizes = random_args(op.ir, B=B, T=n, H=H, sizes=SIZES, seed=seed, dtype=torch.float32)
    names = {d.name for d in op.ir.given_inputs}
    tokens = [{k: v[:, t] for k, v in args.items() if k in names} for t in range(n)]
    params = {k: v for k, v in args.items() if k not in names}
    state = {k: v.float() for k, v in random_state(op.ir, B, H, sizes, seed=seed + 1).items()}
    return op, tokens, params, state


def _count_op_steps(monkeypatch, op) -> list:
    calls, real = [], op.step

    def spy(**kw):
        calls.append(1)
        return real(**kw)
    monkeypatch.setattr(op, "step", spy)
    return calls


@pytest.mark.parametrize("name", BOUND + THROUGH_OP_STEP, ids=[f"{n}-{ID}" for n in BOUND + THROUGH_OP_STEP])
def test_decoder_equals_op_step_in_place_and_the_reference(name, monkeypatch):
    op, tokens, params, state = _case(name, seed=11)
    mine = {k: v.clone() for k, v in state.items()}
    theirs = {k: v.clone() for k, v in state.items()}
    ref_state = {k: v.double() for k, v in state.items()}
    ptrs = {k: v.data_ptr() for k, v in mine.items()}
    dec = op.decoder(mine, mode="torch", **params)
    assert dec.state is mine
    calls = _count_op_steps(monkeypatch, op)
    with torch.no_grad():
        for t, x in enumerate(tokens):
            o = dec.step(**x)
            want, _ = op.step(**x, **params, state=theirs, mode="torch", inplace=True)
            ref_o, ref_state = op.reference_step(**{k: v.double() for k, v in {**x, **params}.items()},
                                                 state=ref_state)
            assert torch.equal(o, want), f"{name} token {t}: output differs from op.step(inplace=True)"
            _close(o, ref_o, f"{name} token {t} output")
            for k in ref_state:
                assert torch.equal(mine[k], theirs[k]), f"{name} token {t} state {k}: differs from op.step's"
                _close(mine[k], ref_state[k], f"{name} token {t} state {k}")
    assert {k: v.data_ptr() for k, v in mine.items()} == ptrs          # updated in place
    # op.step: once per token for the test's own call, plus the decoder's first (binding) step;
    # the decoder's later tokens run the bound step unless the spec has none
    bound = name in BOUND
    assert (dec._run is not None) == bound
    assert len(calls) == N_TOKENS + (1 if bound else N_TOKENS)


def test_positional_inputs_are_the_spec_order():
    op, tokens, params, state = _case("rwkv6", seed=3)
    a, b = ({k: v.clone() for k, v in state.items()} for _ in range(2))
    by_name, by_place = op.decoder(a, mode="torch", **params), op.decoder(b, mode="torch", **params)
    with torch.no_grad():
        for x in tokens:
            o1 = by_name.step(**x)
            o2 = by_place.step(*[x[d.name] for d in op.ir.given_inputs])
            assert torch.equal(o1, o2)
    assert torch.equal(a["S"], b["S"])


def test_a_bad_gate_is_refused_by_name_after_binding_and_the_state_is_untouched():
    op, tokens, params, state = _case("rwkv6", seed=5)
    dec = op.decoder(state, mode="torch", **params)
    with torch.no_grad():
        dec.step(**tokens[0])
        assert dec._run is not None
        before = state["S"].clone()
        bad = dict(tokens[1], w=tokens[1]["w"].clone())
        bad["w"][1, 2, 3] = 0.5                     # a log decay above 0: a growing state
        with pytest.raises(ArgumentError, match=r"w: expected values in \[-inf, 0\].*w\[1, 2, 3\] = 0.5"):
            dec.step(**bad)
        assert torch.equal(state["S"], before)
        nan = dict(tokens[1], w=tokens[1]["w"].clone())
        nan["w"][0, 0, 0] = float("nan")
        with pytest.raises(ArgumentError, match="w: expected values in"):
            dec.step(**nan)
        # check_ranges=False: the caller's promise (no per-token reduction)
        unchecked = op.decoder(state, mode="torch", check_ranges=False, **params)
        unchecked.step(**tokens[0])
        unchecked.step(**bad)


def test_a_token_that_looks_different_is_bound_again_or_refused_by_name():
    op, tokens, params, state = _case("gla", seed=7)
    other = {k: v.clone() for k, v in state.items()}
    dec = op.decoder(state, mode="torch", **params)
    with torch.no_grad():
        dec.step(**tokens[0])
        short = dict(tokens[1], k=tokens[1]["k"][..., :4])
        with pytest.raises(ArgumentError, match=r"^k: "):
            dec.step(**short)
        with pytest.raises(ArgumentError, match=r"missing input 'g'|g: "):
            dec.step(**{k: v for k, v in tokens[1].items() if k != "g"})
        # fewer sequences with their own (smaller) state: a new decoder; the same one refuses
        with pytest.raises(ArgumentError, match=r"state\['S'\]: expected shape"):
            dec.step(**{k: v[:1] for k, v in tokens[1].items()})
        # strided inputs of the same shape: op.step binds them, the result is the same
        again = op.decoder(other, mode="torch", **params)
        again.step(**tokens[0])
        twisted = {k: v.transpose(0, 1).contiguous().transpose(0, 1) for k, v in tokens[1].items()}
        assert torch.equal(dec.step(**twisted), again.step(**tokens[1]))


def test_gradients_are_refused_by_name():
    op, tokens, params, state = _case("gla", seed=9)
    dec = op.decoder(state, mode="torch", **params)
    dec.step(**tokens[0])                           # grad enabled, nothing requires it: runs
    x = dict(tokens[1], q=tokens[1]["q"].clone().requires_grad_())
    with pytest.raises(ArgumentError, match=r"q: requires grad.*inplace"):
        dec.step(**x)
    with torch.no_grad():
        dec.step(**x)


def test_bad_decoder_arguments_are_named():
    op, tokens, params, state = _case("rwkv6", seed=13)
    with pytest.raises(ArgumentError, match=r"^r: an input of 'rwkv6'"):
        op.decoder(state, r=tokens[0]["r"], **params)
    with pytest.raises(ArgumentError, match=r"^bonus: not a param, option or flag of 'rwkv6' \(it has: scale, u\)"):
        op.decoder(state, bonus=1.0, **params)
    with pytest.raises(ArgumentError, match=r"^initial_state: "):
        op.decoder(state, initial_state=state, **params)
    with pytest.raises(ArgumentError, match=r"^mode: expected one of"):
        op.decoder(state, mode="fast", **params)
    with pytest.raises(ArgumentError, match=r"^check_ranges: expected True or False"):
        op.decoder(state, check_ranges="no", **params)
    with pytest.raises(ArgumentError, match=r"^state: expected the state buffers"):
        op.decoder([state["S"]], **params)
    dec = op.decoder(state, mode="torch", **params)
    x = tokens[0]
    with pytest.raises(ArgumentError, match=r"takes 4 inputs \(r, k, v, w\), got 5 positional"):
        dec.step(x["r"], x["k"], x["v"], x["w"], x["w"])
    with pytest.raises(ArgumentError, match=r"^k: given by position and by name"):
        dec.step(x["r"], x["k"], k=x["k"], v=x["v"], w=x["w"])
    half = op.decoder({"S": state["S"].double()}, mode="torch", **params)
    with pytest.raises(ArgumentError, match=r"state\['S'\]: inplace=True writes the state as the kernels keep it, "
                                            r"float32"):
        with torch.no_grad():
            half.step(**x)


def test_cache_slots_take_op_step_with_the_bound_indices():
    op, tokens, params, state = _case("gla", seed=15)
    idx = torch.tensor([3, 0])
    cache = {k: torch.randn((5,) + v.shape[1:]) for k, v in state.items()}
    theirs = {k: v.clone() for k, v in cache.items()}
    dec = op.decoder(cache, mode="torch", state_indices=idx, **params)
    with torch.no_grad():
        for x in tokens:
            o = dec.step(**x)
            want, _ = op.step(**x, **params, state=theirs, state_indices=idx, mode="torch", inplace=True)
            assert torch.equal(o, want)
    assert dec._run is None
    assert torch.equal(cache["S"], theirs["S"])


def test_a_kernel_mode_takes_op_step():
    """mode 'recurrent' (the interpreter on CPU): op.step's replayed launch, every token."""
    op, tokens, params, state = _case("gla", seed=17, n=2)
    mine = {k: v.clone() for k, v in state.items()}
    theirs = {k: v.clone() for k, v in state.items()}
    dec = op.decoder(mine, mode="recurrent", **params)
    with torch.no_grad():
        for x in tokens:
            o = dec.step(**x)
            want, _ = op.step(**x, **params, state=theirs, mode="recurrent", inplace=True)
            torch.testing.assert_close(o, want)
    assert dec._run is None
    torch.testing.assert_close(mine["S"], theirs["S"])


def test_a_replaced_state_entry_is_the_one_updated():
    """dec.state is the caller's dict: an entry replaced between steps is bound again (the
    bound step checks that the buffers are the ones it bound)."""
    op, tokens, params, state = _case("gla", seed=19)
    theirs = {k: v.clone() for k, v in state.items()}
    dec = op.decoder(state, mode="torch", **params)
    with torch.no_grad():
        dec.step(**tokens[0])
        op.step(**tokens[0], **params, state=theirs, mode="torch", inplace=True)
        old = state["S"]
        state["S"] = old.clone()
        kept = old.clone()
        o = dec.step(**tokens[1])
        want, _ = op.step(**tokens[1], **params, state=theirs, mode="torch", inplace=True)
    assert torch.equal(o, want)
    assert torch.equal(state["S"], theirs["S"])
    assert torch.equal(old, kept)                   # the entry no longer in the dict is left alone
    assert dec._run is not None
    # an entry replaced by a buffer op.step refuses: refused by name, not run
    state["S"] = state["S"].double()
    with torch.no_grad(), pytest.raises(ArgumentError, match=r"state\['S'\]: inplace=True writes the state"):
        dec.step(**tokens[2])


# ---- op.step(..., mode="torch", inplace=True) bound per state (decoder.op_step_token) ----

def test_op_step_in_place_binds_per_state_and_checks_each_call(monkeypatch):
    """After a call through its key, op.step keeps the step bound to that state: later calls
    equal the float64 reference; a number option, a param of another shape, a bad gate, a
    replaced buffer each leave the bound step (a new scale is computed with, the rest refused
    by name with the state untouched); a dropped state is not kept alive."""
    import gc
    import weakref
    op, tokens, params, state = _case("rwkv6", seed=21, n=5)
    ref_state = {k: v.double() for k, v in state.items()}
    with torch.no_grad():
        for t, x in enumerate(tokens[:3]):
            o, same = op.step(**x, **params, state=state, mode="torch", inplace=True)
            ref_o, ref_state = op.reference_step(**{k: v.double() for k, v in {**x, **params}.items()},
                                                 state=ref_state)
            assert same is state
            _close(o, ref_o, f"token {t} output")
            _close(state["S"], ref_state["S"], f"token {t} state")
        assert id(state) in op._tokens
        # a number option not in the bound call: computed with (equal to the reference's)
        x = tokens[3]
        o, _ = op.step(**x, **params, scale=0.5, state=state, mode="torch", inplace=True)
        ref_o, ref_state = op.reference_step(**{k: v.double() for k, v in {**x, **params}.items()}, scale=0.5,
                                             state=ref_state)
        _close(o, ref_o, "scale 0.5 output")
        _close(state["S"], ref_state["S"], "scale 0.5 state")
        before = state["S"].clone()
        bad = dict(tokens[4], w=tokens[4]["w"].clone())
        bad["w"][0, 1, 2] = 0.25
        with pytest.raises(ArgumentError, match=r"w: expected values in \[-inf, 0\].*w\[0, 1, 2\] = 0.25"):
            op.step(**bad, **params, state=state, mode="torch", inplace=True)
        with pytest.raises(ArgumentError, match=r"^u: "):
            op.step(**tokens[4], u=params["u"][..., :3], state=state, mode="torch", inplace=True)
        assert torch.equal(state["S"], before)
        state["S"] = state["S"].double()
        with pytest.raises(ArgumentError, match=r"state\['S'\]: inplace=True writes the state"):
            op.step(**tokens[4], **params, state=state, mode="torch", inplace=True)
        # a tensor state, bound, then dropped by its caller: not kept alive by the op
        S = before.clone()
        for x in tokens[:2]:
            op.step(**x, **params, state=S, mode="torch", inplace=True)
        assert id(S) in op._tokens
        gone = weakref.ref(S)
        del S
        gc.collect()
        assert gone() is None
