"""Layers and models over any spec: MixerLayer (projections, short conv, norm, gate around
an op), MixerLM (a small decoder, hybrids included) and cached generation. docs/nn.md."""
from .layer import MixerLayer
from .lm import MLP, Block, MixerLM, generate, layer_specs, sample
from .roles import DIM_DEFAULTS, INPUT_ROLES, OPTION_DEFAULTS, PARAM_ROLES

__all__ = ["MixerLayer", "MixerLM", "Block", "MLP", "generate", "layer_specs", "sample",
           "INPUT_ROLES", "PARAM_ROLES", "DIM_DEFAULTS", "OPTION_DEFAULTS"]
