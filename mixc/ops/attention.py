"""fla 0.6's attention ops: softmax attention (fla.ops.attn.parallel_attn, on the library specs
attention and swa) and Based's second-order Taylor approximation of it (fla.ops.based, on the
spec based). fla returns the output alone from each."""
from __future__ import annotations

from .fla_call import Call, FlaOp, fla_function, scale_of

FORGET_GATE = ("a forget gate on the attention scores (fla's forgetting attention): no library spec computes "
               "it (attention and swa are plain softmax attention)")
SINK_BIAS = "an attention-sink logit per head: no library spec computes it"


def _attention_spec(a: Call) -> str:
    return "attention" if a.window_size is None else "swa"


def _attention(a: Call) -> dict:
    args = dict(q=a.q, k=a.k, v=a.v, **scale_of(a))
    return args if a.window_size is None else dict(args, window=a.window_size)


parallel_attn = fla_function(FlaOp(
    "parallel_attn", "fla.ops.attn", "attention", "parallel",
    "q, k, v, g=None, scale=None, window_size=None, cu_seqlens=None, chunk_indices=None, *, sink_bias=None",
    _attention, refused={"g": FORGET_GATE, "sink_bias": SINK_BIAS}, choose=_attention_spec,
    specs=("attention", "swa"), returns="output",
    notes={"q": "[B, T, HQ, K]; k and v may have fewer heads H, HQ % H == 0 (GQA, as fla)",
           "window_size": "None: causal attention (spec attention); W: the last W tokens, t - W < s <= t "
                          "(spec swa's window)"}))


def _based(a: Call) -> dict:
    return dict(q=a.q, k=a.k, v=a.v, **scale_of(a), use_norm=a.use_norm)


_BASED_NOTES = {"use_norm": "the spec's flag: divide by the Taylor normalizer + 1e-6 (as fla)"}
fused_chunk_based = fla_function(FlaOp(
    "fused_chunk_based", "fla.ops.based", "based", "chunk", "q, k, v, scale=None, use_norm=True", _based,
    returns="output", notes=_BASED_NOTES))
parallel_based = fla_function(FlaOp(
    "parallel_based", "fla.ops.based", "based", "parallel", "q, k, v, scale=None, use_norm=True", _based,
    returns="output", notes=_BASED_NOTES))

__all__ = ["parallel_attn", "fused_chunk_based", "parallel_based"]
