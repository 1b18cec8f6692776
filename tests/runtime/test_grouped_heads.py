"""Grouped heads (issue 18 item 2): an input given with H / G heads is shared by each group of
G heads, head h reading its head h // G (fla's GVA: q, k with fewer heads than v; Mamba-2's
ngroups for B and C). A grouped call must equal the call with the inputs repeated per head, in
outputs, final states and every gradient (a shared head's gradient is its group's sum), in
every mode; the reference is the float64 loop on the repeated inputs."""
import pytest
import torch

import mixc
from mixc.runtime.signature import ArgumentError

from helpers import random_args, random_state

H, G = 4, 2
# spec -> the inputs shared by groups of heads (its class in the comment)
GROUPED = {
    "gated_delta_rule": ("q", "k"),     # rank-1 (Qwen3-Next: 16 q/k heads, 32 value heads)
    "gla": ("q", "k"),                  # key-diagonal decay
    "mamba2": ("B", "C"),               # scalar decay (ngroups)
    "simple_gla": ("q", "k"),           # scalar decay
}


def _case(name, T, seed, shared=None):
    op = mixc.load(name)
    args, sizes = random_args(op.ir, B=2, T=T, H=H, sizes={d.name: 16 for d in op.ir.dims if not d.alias_of},
                              dtype=torch.float32, seed=seed)
    # fresh values per shared head (not a slice of a repeated tensor)
    shared = shared or GROUPED[name]
    grouped = {k: (v[:, :, :H // G].clone() if k in shared else v) for k, v in args.items()}
    state = random_state(op.ir, 2, H, sizes, dtype=torch.float32, seed=seed + 1)
    return op, grouped, state, shared


def _run(op, args, state, shared, *, repeat: bool, **kw):
    """(o, final states, gradients of the args and initial states) in float64, for a weighted
    sum of the output and the final states; repeat=True: the grouped inputs repeated per head
    first (autograd sums each group's gradient into the shared head)."""
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in args.items()}
    st = {k: v.detach().clone().requires_grad_(True) for k, v in state.items()}
    call = {k: (v.repeat_interleave(G, dim=2) if repeat and k in shared else v) for k, v in leaves.items()}
    o, fin = op(**call, initial_state=st, output_final_state=True, **kw)
    gen = torch.Generator().manual_seed(7)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)).sum()
    for f in fin.values():
        loss = loss + (f * torch.randn(f.shape, generator=gen, dtype=torch.float64).to(f.dtype)).sum()
    loss.backward()
    grads = {k: v.grad.double() for k, v in (*leaves.items(), *st.items())}
    return o.double(), {k: v.double() for k, v in fin.items()}, grads


def _close(got, want, tol, what):
    err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
    assert err < tol, f"{what}: relative error {err:.2e}"


def _check(name, T, seed, tol, shared=None, **kw):
    op, args, state, shared = _case(name, T, seed, shared)
    want = _run(op, args, state, shared, repeat=True, mode="reference")
    got = _run(op, args, state, shared, repeat=False, **kw)
    _close(got[0], want[0], tol, "output")
    for k in want[1]:
        _close(got[1][k], want[1][k], tol, f"final state {k}")
    for k in want[2]:
        assert got[2][k].shape == want[2][k].shape
        _close(got[2][k], want[2][k], tol, f"gradient of {k}")


@pytest.mark.parametrize("name", sorted(GROUPED))
@pytest.mark.parametrize("mode", ["reference", "torch"])
def test_grouped_call_equals_repeated_call_host(name, mode):
    _check(name, T=37, seed=3, tol=1e-12 if mode == "reference" else 2e-5, mode=mode)


def test_grouped_call_equals_repeated_call_conv():
    """The convolution form (retention's parallel form) on grouped q, k."""
    _check("retention", T=23, seed=13, tol=2e-5, shared=("q", "k"), mode="conv")


@pytest.mark.parametrize("mode", ["torch", "reference"])
def test_grouped_attention_is_gqa(mode):
    """A sequence mixer (attend) with grouped k, v: GQA, as the repeated call."""
    op = mixc.load("attention")
    args, _ = random_args(op.ir, B=2, T=9, H=H, sizes={"K": 8, "V": 8}, dtype=torch.float64, seed=14)
    kv = {k: args[k][:, :, :H // G].clone() for k in ("k", "v")}
    o, _ = op(**{**args, **kv}, mode=mode)
    o_r, _ = op(**{**args, **{k: x.repeat_interleave(G, dim=2) for k, x in kv.items()}}, mode="reference")
    _close(o.double(), o_r, 1e-12, "output")


@pytest.mark.parametrize("name", ["gated_delta_rule", "mamba2"])
def test_grouped_call_equals_repeated_call_chunk(name):
    """The chunked kernels (chunks of 16 over T = 17: a partial last chunk) read the shared head in place."""
    _check(name, T=17, seed=4, tol=2e-5, mode="chunk", chunk=16)


def test_grouped_packed_sequences_chunk():
    """Packed sequences (cu_seqlens, B = 1): a grouped input's rows are tokens x its heads too."""
    op, args, state, shared = _case("mamba2", T=17, seed=16)
    args = {k: (v[:1] if k in {d.name for d in op.ir.inputs} else v) for k, v in args.items()}
    cu = torch.tensor([0, 6, 17])
    want = _run(op, args, state, shared, repeat=True, mode="reference", cu_seqlens=cu)
    got = _run(op, args, state, shared, repeat=False, mode="chunk", chunk=16, cu_seqlens=cu)
    for a, b, what in [(got[0], want[0], "output"), *((got[1][k], want[1][k], k) for k in want[1]),
                       *((got[2][k], want[2][k], f"gradient of {k}") for k in want[2])]:
        _close(a, b, 2e-5, what)


@pytest.mark.parametrize("name", ["simple_gla"])
def test_grouped_call_equals_repeated_call_recurrent(name):
    _check(name, T=6, seed=5, tol=2e-5, mode="recurrent")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(GROUPED))
@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_grouped_call_equals_repeated_call_kernels_all(name, mode):
    _check(name, T=19, seed=6, tol=2e-5, mode=mode, **({"chunk": 16} if mode == "chunk" else {}))


@pytest.mark.parametrize("mode", ["reference", "torch", "recurrent"])
def test_grouped_step_equals_repeated_step(mode):
    """Decode: one token per sequence, inputs [B, H / G, *dims] for the grouped ones; twice, so
    that the second (recurrent) step replays the first's launch (runtime/fastpath.py)."""
    op, args, state, shared = _case("mamba2", T=2, seed=8)
    st_g = st_r = state
    for t in range(2):
        tok = {k: (v[:, t] if v.dim() >= 3 else v) for k, v in args.items()}     # params as they are
        rep = {k: (v.repeat_interleave(G, dim=1) if k in shared else v) for k, v in tok.items()}
        o_g, st_g = op.step(**tok, state=st_g, mode=mode)
        o_r, st_r = op.step(**rep, state=st_r, mode="reference")
        _close(o_g.double(), o_r, 1e-12 if mode == "reference" else 2e-5, f"step {t} output")
        for k in st_r:
            _close(st_g[k].double(), st_r[k], 1e-12 if mode == "reference" else 2e-5, f"step {t} state {k}")


def test_a_replayed_grouped_call_reads_new_values(monkeypatch):
    """A second call without gradients like the first replays its launches (runtime/fastpath.py,
    keyed by shapes: a grouped call's _group_x with them); fresh values of the same shapes must
    give the reference's numbers."""
    from mixc.runtime import fastpath
    replays = []
    run_step = fastpath.run_step
    monkeypatch.setattr(fastpath, "run_step", lambda *a, **k: replays.append(1) or run_step(*a, **k))
    op, args, state, shared = _case("simple_gla", T=21, seed=10)
    with torch.no_grad():
        for seed in (10, 11):
            _, fresh, st, _ = _case("simple_gla", T=21, seed=seed)
            o, fin = op(**fresh, initial_state=st, output_final_state=True, mode="chunk", chunk=16)
            rep = {k: (v.repeat_interleave(G, dim=2) if k in shared else v) for k, v in fresh.items()}
            o_r, fin_r = op(**rep, initial_state=st, output_final_state=True, mode="reference")
            _close(o.double(), o_r, 2e-5, f"call {seed - 9} output")
            _close(fin["S"].double(), fin_r["S"], 2e-5, f"call {seed - 9} final state")
    assert replays == [1]               # the second call replayed the first's launches


def test_a_compiled_module_takes_grouped_heads(tmp_path):
    """A compiled module's runtime (standalone/support.py: its own binding and launches) on grouped
    B and C: the op's numbers, gradients summed per group; a bad head count refused there too."""
    import importlib.util

    from mixc import pipeline
    op, args, state, shared = _case("mamba2", T=5, seed=12)
    path = tmp_path / "grouped_mamba2.py"
    path.write_text(pipeline.render(op.plan()))
    spec = importlib.util.spec_from_file_location("grouped_mamba2", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    got = _run(mod.op, args, state, shared, repeat=False, mode="recurrent")
    want = _run(op, args, state, shared, repeat=True, mode="reference")
    _close(got[0], want[0], 2e-5, "output")
    for k in want[2]:
        _close(got[2][k], want[2][k], 2e-5, f"gradient of {k}")
    with pytest.raises(ArgumentError, match=r"B: has 3 heads \(axis 2\), which do not divide H = 4"):
        mod.op(**{**args, "B": torch.randn(2, 5, 3, 16)})


@pytest.mark.slow          # dynamo's import and tracing: ~12 s
def test_torch_compile_traces_a_grouped_call():
    """torch.compile(fullgraph=True) through the kernels' custom ops (whose Bound takes H from
    the most heads of any input): the compiled forward and gradients equal the eager ones."""
    op, args, state, shared = _case("simple_gla", T=5, seed=15)
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in args.items()}

    def f(**kw):
        o, st = op(**kw, initial_state=state, output_final_state=True, mode="recurrent")
        return o.pow(2).sum() + st["S"].sum()

    want = torch.autograd.grad(f(**leaves), list(leaves.values()))
    torch._dynamo.reset()
    got = torch.autograd.grad(torch.compile(f, fullgraph=True, backend="aot_eager")(**leaves), list(leaves.values()))
    for k, a, b in zip(leaves, got, want):
        torch.testing.assert_close(a, b, msg=k)


def test_a_head_count_that_does_not_divide_H_is_an_argument_error():
    op, args, state, _ = _case("gated_delta_rule", T=3, seed=9)
    args["k"] = torch.randn(2, 3, 3, 16)             # 3 heads: divides neither 4 nor the q's 2
    with pytest.raises(ArgumentError, match=r"k: has 3 heads \(axis 2\), which do not divide H = 4 \(v's heads\)"):
        op(**args, mode="reference")
    args["k"] = args["q"]
    with pytest.raises(ArgumentError, match=r"initial_state\['S'\]: expected shape \[B=2, H=2"):
        op(**{**args, "v": args["v"][:, :, :2], "g": args["g"][:, :, :2], "beta": args["beta"][:, :, :2]},
           initial_state=state, mode="reference")     # H = 2 now: the state's 4 heads disagree
