"""The specs the nn tests run over, and the layer arguments some of them need."""
from mixc.dsl import library_names

SPECS = library_names()              # every library spec, the non-recurrent ones included


def layer_kwargs(spec: str, T: int) -> dict:
    """Extra MixerLayer arguments: a max_len for params over the tokens, a short window for
    AFT-conv (its op refuses a call shorter than its filter) and sliding-window attention (so
    that the window slides within the test's sequence)."""
    kw = {"max_len": T}
    if spec == "aft_conv":
        kw["head_dims"] = {"L": 3}
    if spec == "swa":
        kw["options"] = {"window": 5}
    return kw
