"""The user's side of a compiled module, run by tests/codegen/test_standalone.py in a fresh
interpreter where mixc is not importable: `python -I standalone_child.py JOB RESULT [BLOCKED]`.

BLOCKED (comma-separated top-level names, e.g. mixc,lark): a finder first on sys.meta_path
raises ImportError for them before anything is imported, so neither mixc (installed in the
test's environment, editable) nor lark can be reached; in the bare venv of the slow test
there is nothing to block. It imports torch only, then each module the README's way
(`sys.path.insert(0, DIR); import NAME`), runs the calls of JOB (a torch.save'd dict the test
wrote) and torch.save's what came out into RESULT: outputs, final states, gradients, step,
every refusal as (its class's name, whether it is a ValueError and the module's
ArgumentError, its message), the runtime each module imported, and which of mixc, lark,
jinja2 got imported (none may be). This file imports nothing from mixc or the tests."""
import importlib
import importlib.util
import sys


class _Blocked:
    def __init__(self, names):
        self.names = set(names)

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.names:
            raise ImportError(f"{fullname}: blocked (a compiled module must run without it)")
        return None


def _outcome(mod, fn):
    try:
        return ("ran", fn())
    except Exception as e:          # noqa: BLE001 (recorded: the test says what it expects)
        return ("refused", type(e).__name__, isinstance(e, ValueError), isinstance(e, mod.ArgumentError), str(e))


def _detached(x):
    import torch
    if isinstance(x, torch.Tensor):
        return x.detach()
    if isinstance(x, dict):
        return {k: _detached(v) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(_detached(v) for v in x)
    return x


def _run_case(mod, case):
    """The call with gradients of a weighted loss over the output and the final states, a step,
    the bad calls and mode='torch'."""
    import torch
    args = {k: v.clone().requires_grad_(True) for k, v in case["args"].items()}
    state = {k: v.clone().requires_grad_(True) for k, v in case["state"].items()}
    leaves = dict(args, **{f"state:{k}": v for k, v in state.items()})

    def call():
        o, st = mod.op(**args, initial_state=state, output_final_state=True, mode=case["mode"])
        loss = (o * case["w_o"]).sum() + sum((st[k] * case["w_s"][k]).sum() for k in st)
        grads = torch.autograd.grad(loss, list(leaves.values()))
        return {"o": o, "state": st, "grads": dict(zip(leaves, grads))}

    out = {"call": _outcome(mod, call)}
    out["step"] = _outcome(mod, lambda: mod.step(**case["one"], state=case["state"]))
    out["bad"] = [_outcome(mod, lambda kw=kw: mod.op(**dict(case["args"], **kw))) for kw in case["bad"]]
    out["torch_mode"] = _outcome(mod, lambda: mod.op(**case["args"], mode="torch"))
    return _detached(out)


def main(argv):
    job_path, result_path = argv[1], argv[2]
    blocked = [n for n in (argv[3] if len(argv) > 3 else "").split(",") if n]
    if blocked:
        sys.meta_path.insert(0, _Blocked(blocked))
    import torch
    job = torch.load(job_path)
    sys.path.insert(0, job["build"])
    result = {"cases": [], "runtime": {}}
    for case in job["cases"]:
        mod = importlib.import_module(case["module"])
        result["runtime"][case["module"]] = (mod._RUNTIME.__name__, mod._RUNTIME.__file__)
        result["cases"].append(_run_case(mod, case))
    if job.get("lonely"):           # a module file copied without its runtime folder
        spec = importlib.util.spec_from_file_location("lonely_module", job["lonely"])
        lonely = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(lonely)
            result["lonely"] = ("imported",)
        except ImportError as e:
            result["lonely"] = ("ImportError", str(e))
    if job.get("sequence"):         # a sequence mixer's module: its op needs mixc
        name, args = job["sequence"]
        seq = importlib.import_module(name)
        try:
            seq.op(**args)
            result["sequence"] = ("ran",)
        except ImportError as e:
            result["sequence"] = ("ImportError", str(e))
    result["imported"] = sorted(m for m in sys.modules if m.split(".")[0] in ("mixc", "lark", "jinja2"))
    torch.save(result, result_path)


if __name__ == "__main__":
    main(sys.argv)
