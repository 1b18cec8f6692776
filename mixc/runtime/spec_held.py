"""What MixerOp and SequenceOp share: an op is a function of its checked spec alone."""
from __future__ import annotations


class HeldBySpec:
    """An op pickles as its checked spec (plans, modules and custom ops are rebuilt on first
    use), so a layer or model holding it saves whole (torch.save). It holds no data of its own:
    a copy (copy.deepcopy of a model, AveragedModel) shares it."""

    def __reduce__(self):
        return type(self), (self.ir,)

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self
