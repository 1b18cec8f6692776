"""Everything a user holds pickles, deep-copies and saves whole: MixerOp, SequenceOp, Plan,
MixerLayer, MixerLM (torch.save / torch.load with weights_only=False, copy.deepcopy,
torch.optim.swa_utils.AveragedModel); a loaded copy computes the same outputs."""
import copy
import io
import pickle
import subprocess
import sys

import pytest
import torch

import mixc
from mixc.nn import MixerLayer, MixerLM
from tests.helpers import random_args


def _same(a, b):
    assert a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("name,flags", [("gla", {}), ("delta_rule", {"use_qk_l2norm_in_kernel": True}),
                                        ("mlstm", {}), ("swa", {})],
                         ids=["gla-B2-T12-H2-K4", "delta_rule-l2norm-B2-T12-H2-K4", "mlstm-B2-T12-H2-K4",
                              "swa-B2-T12-H2-K4"])
def test_op_and_plan_pickle_and_compute_the_same(name, flags):
    op = mixc.load(name)
    kw, _ = random_args(op.ir, B=2, T=12, H=2, seed=3)
    o, st = op(**kw, **flags, output_final_state=True, mode="torch")
    for copy_of in (lambda x: pickle.loads(pickle.dumps(x)), copy.deepcopy, copy.copy):
        op2 = copy_of(op)
        assert type(op2) is type(op) and op2.ir == op.ir
        o2, st2 = op2(**kw, **flags, output_final_state=True, mode="torch")
        _same(o, o2)
        for k in st:
            _same(st[k], st2[k])
        plan = op.plan(**flags)
        plan2 = copy_of(plan)
        assert plan2 == plan and plan2.transition == plan.transition and plan2.flags == plan.flags


def test_a_user_spec_pickles_without_its_file(tmp_path):
    path = tmp_path / "mine.mix"
    path.write_text("mixer mine\n  dims K, V\n  input q[K], k[K], v[V], g[]\n  state S[K, V]\n"
                    "  update S = exp(g) * S + k * v\n  output o = q @ S\n")
    op = mixc.load(str(path))
    data = pickle.dumps(op)
    path.unlink()                       # the spec travels in the pickle, not as a path
    op2 = pickle.loads(data)
    assert op2.ir.source.filename == str(path)
    kw, _ = random_args(op.ir, B=1, T=9, H=2, seed=4)
    _same(op(**kw, mode="torch")[0], op2(**kw, mode="torch")[0])


def _lm():
    torch.manual_seed(0)
    return MixerLM(40, 16, 2, ["gated_delta_rule", "swa"], n_heads=2, mode="torch", mlp_ratio=2.0)


def test_models_save_whole_and_load_to_the_same_outputs():
    model = _lm()
    ids = torch.randint(0, 40, (2, 11), generator=torch.Generator().manual_seed(5))
    want = model(ids)[0]
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    _same(want, loaded(ids)[0])
    assert loaded.head.weight is loaded.embed.weight            # tied weights stay tied
    deep = copy.deepcopy(model)
    _same(want, deep(ids)[0])
    with torch.no_grad():                                        # the copy's weights are its own
        deep.blocks[0].mixer.out_proj.weight.add_(1.0)
    _same(want, model(ids)[0])
    layer = MixerLayer("rwkv7", 16, 2, mode="torch")
    x = torch.randn(2, 7, 16, generator=torch.Generator().manual_seed(6))
    _same(layer(x)[0], pickle.loads(pickle.dumps(layer))(x)[0])


def test_averaged_model():
    model = _lm()
    avg = torch.optim.swa_utils.AveragedModel(model)
    avg.update_parameters(model)
    ids = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(7))
    _same(model(ids)[0], avg(ids)[0])


@pytest.mark.slow          # a fresh interpreter: ~7 s on 2 cores
def test_a_saved_model_loads_in_a_fresh_process(tmp_path):
    model = _lm()
    ids = torch.randint(0, 40, (1, 6), generator=torch.Generator().manual_seed(8))
    torch.save({"model": model, "ids": ids, "logits": model(ids)[0]}, tmp_path / "m.pt")
    code = ("import torch; d = torch.load(%r, weights_only=False); "
            "assert torch.equal(d['model'](d['ids'])[0], d['logits']); print('same')" % str(tmp_path / "m.pt"))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "same" in p.stdout, p.stderr[-2000:]
