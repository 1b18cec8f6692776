"""How MixerLayer turns a hidden state into each input of a spec, and how it initializes the
spec's params: one table, keyed by (spec, name) with a fallback by name alone, so that a
library spec gets its paper's parametrization and a user's spec gets a plain projection.

Every per-token input x[dims] of a spec is a slice of one input projection,
Linear(d_model -> n_heads * prod(dims)); its role then says
  - whether it passes through the short causal convolution (+ SiLU) as fla and Mamba do for
    q, k, v and Mamba's x, B, C (`conv`), and
  - how the raw projection becomes the value the op takes (`__call__`), e.g. a log-space
    decay through logsigmoid. A role may own extra per-head parameters (Mamba-2's A_log and
    dt_bias for Gated DeltaNet's gate) and may read inputs computed before it (RWKV-7's b
    from a, HGRN's input from its forget gate): `needs` orders them.
Params of the spec are nn.Parameters of shape [H, *dims]; a ParamRole may store them
reparametrized (A = -exp(A_log) keeps a decay rate negative while training).

The table is documented in docs/nn.md; keep the two in step.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


# ---------------------------------------------------------------- input roles
class Role:
    """A plain projection: the default for an unknown input, so any spec drops in."""

    conv = False
    needs: tuple[str, ...] = ()
    doc = "identity"

    def setup(self, layer: nn.Module, name: str, H: int, shape: tuple[int, ...]) -> None:
        """Create any extra parameters on the layer (named f'{name}_...')."""

    def init_bias(self, bias: torch.Tensor, H: int, shape: tuple[int, ...]) -> None:
        nn.init.zeros_(bias)

    def __call__(self, raw: torch.Tensor, layer: nn.Module, name: str, done: dict) -> torch.Tensor:
        return raw


class Feature(Role):
    """q, k, v, r and Mamba's x, B, C: short conv + SiLU when the layer has a short conv."""

    conv = True
    doc = "short conv + SiLU (identity without the conv)"


class LogSigmoid(Role):
    """A log-space decay in (-inf, 0]: logsigmoid(x) / normalizer. GLA divides by 16 (fla's
    gate_logit_normalizer), which keeps the decay near 1 at init, so memories last."""

    def __init__(self, normalizer: float = 1.0):
        self.normalizer = normalizer
        self.doc = f"logsigmoid(x) / {normalizer:g}" if normalizer != 1 else "logsigmoid(x)"

    def __call__(self, raw, layer, name, done):
        return F.logsigmoid(raw) / self.normalizer


class NegExp(Role):
    """RWKV-6's data-dependent decay: log decay -exp(x); the bias starts spread over channels
    from slow (-exp(-6)) to fast (-exp(1)) decay, as RWKV's decay_speed ramp."""

    doc = "-exp(x), bias ramped -6..1 over channels"

    def init_bias(self, bias, H, shape):
        n = math.prod(shape)
        ramp = torch.linspace(-6.0, 1.0, n) if n > 1 else torch.tensor([-2.5])
        with torch.no_grad():
            bias.copy_(ramp.repeat(H))

    def __call__(self, raw, layer, name, done):
        return -torch.exp(raw)


class BoundedDecay(Role):
    """RWKV-7's log decay: -exp(-1/2) * sigmoid(x), in (-0.607, 0) as fla's RWKV7 layer."""

    doc = "-exp(-0.5) * sigmoid(x)"

    def __call__(self, raw, layer, name, done):
        return -math.exp(-0.5) * torch.sigmoid(raw)


class Sigmoid(Role):
    """beta of the delta rules: the write strength in (0, 1)."""

    doc = "sigmoid(x)"

    def __call__(self, raw, layer, name, done):
        return torch.sigmoid(raw)


def _dt_bias(shape, dt_min=1e-3, dt_max=1e-1) -> torch.Tensor:
    """Mamba's dt init: dt log-uniform in [dt_min, dt_max], stored as softplus^-1(dt)."""
    dt = torch.exp(torch.rand(shape) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    return dt + torch.log(-torch.expm1(-dt))


class MambaGate(Role):
    """Gated DeltaNet's decay, Mamba-2 style (fla's GatedDeltaNet): g = -exp(A_log) *
    softplus(x + dt_bias), with A in [1, 16] and softplus(dt_bias) log-uniform in [1e-3, 1e-1]."""

    doc = "-exp(A_log) * softplus(x + dt_bias); A ~ U[1, 16], dt log-uniform [1e-3, 1e-1]"

    def __init__(self, per_key: bool = False):
        self.per_key = per_key        # KDA: dt_bias per key channel, [H, K] (A_log stays per head)

    def setup(self, layer, name, H, shape):
        layer.register_parameter(f"{name}_A_log", nn.Parameter(torch.log(torch.empty(H).uniform_(1, 16))))
        layer.register_parameter(f"{name}_dt_bias", nn.Parameter(_dt_bias((H,) + (shape if self.per_key else ()))))

    def __call__(self, raw, layer, name, done):
        A = torch.exp(getattr(layer, f"{name}_A_log"))
        if self.per_key:
            A = A[:, None]
        return -A * F.softplus(raw + getattr(layer, f"{name}_dt_bias"))


class Rwkv7RemovalKey(Role):
    """RWKV-7's a = -kk, kk a unit vector per head (here from its own projection)."""

    doc = "-x / |x| over the last dim"

    def __call__(self, raw, layer, name, done):
        return -F.normalize(raw, dim=-1, eps=1e-6)


class Rwkv7Replacement(Role):
    """RWKV-7's b = kk * sigmoid(x) (the in-context learning rate), with kk = -a."""

    needs = ("a",)
    doc = "-a * sigmoid(x)"

    def __call__(self, raw, layer, name, done):
        return -done["a"] * torch.sigmoid(raw)


class ForgetBias(Role):
    """mLSTM's forget gate pre-activation: bias ramped 3..6 over heads (xLSTM), so sigmoid(f)
    starts near 1."""

    doc = "x, bias ramped 3..6 over heads"

    def init_bias(self, bias, H, shape):
        with torch.no_grad():
            bias.copy_(torch.linspace(3.0, 6.0, H).repeat_interleave(max(1, math.prod(shape))))


class HgrnInput(Role):
    """HGRN's input, tied to its forget gate: silu(x) * (1 - exp(g))."""

    needs = ("g",)
    doc = "silu(x) * (1 - exp(g))"

    def __call__(self, raw, layer, name, done):
        return F.silu(raw) * -torch.expm1(done["g"])


class SlotWrite(Role):
    """GSA's slot write weights, tied to its forget gate as the paper's layer ties them:
    s = 1 - exp(g) (its own projection is not read)."""

    needs = ("g",)
    doc = "1 - exp(g) (the paper's 1 - alpha_t; the projection is not read)"

    def __call__(self, raw, layer, name, done):
        return -torch.expm1(done["g"])


# (spec, input) first, then the input name alone; anything else is a plain projection.
INPUT_ROLES: dict = {
    "q": Feature(), "k": Feature(), "v": Feature(), "r": Feature(),
    "beta": Sigmoid(),
    "g": LogSigmoid(),
    ("gla", "g"): LogSigmoid(16.0),
    ("simple_gla", "g"): LogSigmoid(16.0),
    ("gated_delta_rule", "g"): MambaGate(),
    ("rwkv6", "w"): NegExp(),
    ("rwkv7", "w"): BoundedDecay(),
    ("rwkv7", "a"): Rwkv7RemovalKey(),
    ("rwkv7", "b"): Rwkv7Replacement(),
    ("mamba2", "x"): Feature(), ("mamba2", "B"): Feature(), ("mamba2", "C"): Feature(),
    ("mamba2", "dt"): Role(),                 # the spec applies softplus(dt + dt_bias) itself
    ("mamba", "x"): Feature(), ("mamba", "B"): Feature(), ("mamba", "C"): Feature(),
    ("mamba", "dt"): Role(),                  # the spec applies softplus(dt + dt_bias) itself
    ("mamba3", "x"): Feature(), ("mamba3", "B"): Feature(), ("mamba3", "C"): Feature(),
    ("mamba3", "dt"): Role(),                 # the spec applies softplus(dt + dt_bias) itself
    ("mamba3", "lam"): Role(),                # and sigmoid(lam), the trapezoid's weight
    ("hgrn2", "i"): Role(),                   # HGRN2's input (fla: i_proj, no conv)
    ("kda", "g"): MambaGate(per_key=True),    # fla's KDA gate: -exp(A_log) * softplus(x + dt_bias[K])
    ("comba", "p"): Feature(), ("comba", "g"): MambaGate(),
    ("gated_delta_product", "k1"): Feature(), ("gated_delta_product", "k2"): Feature(),
    ("gated_delta_product", "v1"): Feature(), ("gated_delta_product", "v2"): Feature(),
    ("gated_delta_product", "beta1"): Sigmoid(), ("gated_delta_product", "beta2"): Sigmoid(),
    ("gated_delta_product", "g"): MambaGate(),
    ("mlstm", "f"): ForgetBias(),
    ("hgrn", "x"): HgrnInput(),
    ("gsa", "g"): LogSigmoid(8.0),            # GSA's gate_logit_normalizer (tau = 8)
    ("gsa", "s"): SlotWrite(),
    ("s4d", "x"): Feature(),
    ("titans", "eta"): Sigmoid(), ("titans", "theta"): Sigmoid(), ("titans", "alpha"): Sigmoid(),   # gates in (0, 1)
    ("hyena", "x1"): Feature(), ("hyena", "x2"): Feature(),   # Hyena short-convolves every projection
}


def input_role(spec: str, name: str) -> Role:
    return INPUT_ROLES.get((spec, name)) or INPUT_ROLES.get(name) or Role()


# ---------------------------------------------------------------- param roles
class ParamRole:
    """A spec param as an nn.Parameter of shape [H, *dims], normal(0, 0.1) at init, passed as is."""

    frozen = False
    doc = "normal(0, 0.1)"

    def init(self, H: int, shape: tuple[int, ...]) -> torch.Tensor:
        return 0.1 * torch.randn((H,) + shape)

    def value(self, p: torch.Tensor) -> torch.Tensor:
        return p


class Ones(ParamRole):
    doc = "ones (Mamba's and S4's skip D)"

    def init(self, H, shape):
        return torch.ones((H,) + shape)


class NegExpParam(ParamRole):
    """A decay rate kept negative: the module parameter holds A_log = log(-A); the op gets
    A = -exp(A_log)."""

    def __init__(self, kind: str):
        self.kind = kind
        self.doc = {"uniform": "A = -exp(A_log), A ~ U[1, 16] (Mamba-2)",
                    "s4d_real": "A = -exp(A_log), A[n] = -(n + 1) over the first dim (S4D-real)"}[kind]

    def init(self, H, shape):
        if self.kind == "uniform":
            return torch.log(torch.empty((H,) + shape).uniform_(1, 16))
        n = torch.arange(1, shape[0] + 1, dtype=torch.float32) if shape else torch.ones(())
        return torch.log(n.reshape((1, -1) + (1,) * (len(shape) - 1)).expand((H,) + shape).clone())

    def value(self, p):
        return -torch.exp(p)


class Rwkv5Decay(ParamRole):
    """RWKV-5's static decay: the parameter holds time_decay, ramped -6..1 over the channels
    (RWKV's decay_speed); the op gets the log decay w = -exp(time_decay), always <= 0."""

    doc = "time_decay ramped -6..1 over the channels; the op gets w = -exp(time_decay)"

    def init(self, H, shape):
        n = math.prod(shape)
        ramp = torch.linspace(-6.0, 1.0, n) if n > 1 else torch.tensor([-2.5])
        return ramp.reshape(shape).expand((H,) + shape).clone()

    def value(self, p):
        return -torch.exp(p)


class SigmoidParam(ParamRole):
    """A param the spec declares in [0, 1] (HGRN-1's lower bound): the parameter holds its
    logit, N(0, 0.1) at init (a bound near 1/2); the op gets sigmoid of it."""

    doc = "logit N(0, 0.1); the op gets sigmoid(logit), in (0, 1)"

    def value(self, p):
        return torch.sigmoid(p)


class DtBias(ParamRole):
    doc = "softplus^-1(dt), dt log-uniform in [1e-3, 1e-1] (Mamba)"

    def init(self, H, shape):
        return _dt_bias((H,) + shape)


class LogDt(ParamRole):
    doc = "log(dt), dt log-uniform in [1e-3, 1e-1] (S4D)"

    def init(self, H, shape):
        return torch.empty((H,) + shape).uniform_(math.log(1e-3), math.log(1e-1))


class RandomFeatures(ParamRole):
    """Performer's projections: Gaussian, drawn once and not trained."""

    frozen = True
    doc = "standard normal, frozen (Performer's random features)"

    def init(self, H, shape):
        return torch.randn((H,) + shape)


class Constant(ParamRole):
    def __init__(self, value: float, doc: str):
        self.v, self.doc = value, doc

    def init(self, H, shape):
        return torch.full((H,) + shape, self.v)


class DecayingFilter(ParamRole):
    """A long filter over the tokens (first dim T): random taps under an exponential window
    whose rate differs per channel, as Hyena's implicit filters start out."""

    doc = "normal taps * exp(-rate t), rates 0.01..0.3 over channels (Hyena's window)"

    def init(self, H, shape):
        T = shape[0]
        rest = math.prod(shape[1:])
        rate = torch.logspace(math.log10(0.01), math.log10(0.3), max(1, rest)).reshape(shape[1:] or ())
        t = torch.arange(T, dtype=torch.float32).reshape((T,) + (1,) * (len(shape) - 1))
        return 0.3 * torch.randn((H,) + shape) * torch.exp(-rate * t)


class SmallNormal(ParamRole):
    def __init__(self, std: float, doc: str):
        self.std, self.doc = std, doc

    def init(self, H, shape):
        return self.std * torch.randn((H,) + shape)


PARAM_ROLES: dict = {
    "D": Ones(),
    ("mamba2", "A"): NegExpParam("uniform"),
    ("mamba2", "dt_bias"): DtBias(),
    ("mamba3", "A"): NegExpParam("uniform"),
    ("mamba3", "dt_bias"): DtBias(),
    ("mamba", "A"): NegExpParam("s4d_real"),
    ("mamba", "dt_bias"): DtBias(),
    ("s4d", "A"): NegExpParam("s4d_real"),
    ("rwkv5", "w"): Rwkv5Decay(),
    ("hgrn1", "lb"): SigmoidParam(),
    ("s4d", "B"): Ones(),
    ("s4d", "log_dt"): LogDt(),
    ("performer", "W"): RandomFeatures(),
    ("hyena", "h1"): DecayingFilter(), ("hyena", "h2"): DecayingFilter(),
    ("aft_full", "w"): Constant(0.0, "zeros (uniform weights over the past at init)"),
    ("aft_conv", "w"): Constant(0.0, "zeros"),
    ("gmlp", "W"): SmallNormal(1e-3, "near zero (gMLP: the unit starts as z1 * b)"),
    ("gmlp", "b"): Ones(),
    ("mlp_mixer", "W1"): SmallNormal(0.02, "normal(0, 0.02)"),
    ("mlp_mixer", "W2"): SmallNormal(0.02, "normal(0, 0.02)"),
    ("mlp_mixer", "b1"): Constant(0.0, "zeros"), ("mlp_mixer", "b2"): Constant(0.0, "zeros"),
}


def param_role(spec: str, name: str) -> ParamRole:
    return PARAM_ROLES.get((spec, name)) or PARAM_ROLES.get(name) or ParamRole()


# ---------------------------------------------------------------- sizes and options
# Dims whose size is not the head dim by default: state and feature sizes of the papers.
DIM_DEFAULTS: dict = {
    ("mamba2", "N"): 16, ("mamba3", "N"): 16, ("mamba", "N"): 16, ("s4d", "N"): 16,
    ("based", "K"): 16,                   # fla's Based: feature_dim 16
    ("performer", "M"): 32,
    ("aft_conv", "L"): 8,                 # the window of the local position bias
}

# Options the layer passes by default (the user's `options=` override them).
OPTION_DEFAULTS: dict = {
    "delta_rule": {"use_qk_l2norm_in_kernel": True},         # fla's DeltaNet normalizes q, k
    "gated_delta_rule": {"use_qk_l2norm_in_kernel": True},
    "kda": {"use_qk_l2norm_in_kernel": True}, "comba": {"use_qk_l2norm_in_kernel": True},
    "gated_delta_product": {"use_qk_l2norm_in_kernel": True},
    "mlp_mixer": {"causal": True},                           # a decoder's layer must not see ahead
    "gmlp": {"causal": True},
}
