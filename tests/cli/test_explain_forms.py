"""`mixc explain` and `mixc check` list as forms what runs (the runtime's own decision), never
print Python's None, and warn about the library's gates not at all (issue 32 item 5)."""
import pytest

from mixc.cli import main
from range_specs import HGRN1, HGRN1_UNRANGED

# Mamba-3's trapezoid with the caller shifting the inputs: its input term is a sum of two outer
# products, the sum-of-outer-products class's chunked form (mixc/classes/outer_sum.py).
SHIFTED = """mixer shifted
  dims   N, P
  input  x[P], xp[P], B[N], Bp[N], C[N], dt[] in [0, inf), lam[] in [0, 1]
  param  A[] in (-inf, 0]
  let    a = exp(dt * A)
  state  h[N, P]
  update h = a * h + (1 - lam) * dt * a * Bp * xp + lam * dt * B * x
  output y = C @ h
"""

# An input term that is no sum of outer products: no chunked kernel takes it.
NOT_OUTER = """mixer shifted
  dims   N, P
  input  x[P], B[N], C[N], dt[] in [0, inf)
  param  A[] in (-inf, 0]
  let    a = exp(dt * A)
  state  h[N, P]
  update h = a * h + dt * tanh(B * x)
  output y = C @ h
"""


def test_a_sum_of_outer_products_lists_its_chunked_form(capsys, tmp_path):
    out = run(capsys, tmp_path, "explain", SHIFTED)
    assert "class: sum of outer products\nforms: chunk, recurrent, step\n" in out
    assert "B_t = sum_m k_m v_m^T, m = 2 outer products" in out and "None" not in out


def run(capsys, tmp_path, command, text, name="m.mix"):
    path = tmp_path / name
    path.write_text(text)
    assert main([command, str(path)]) == 0
    return capsys.readouterr().out


def test_a_refused_chunked_form_is_not_listed(capsys, tmp_path):
    out = run(capsys, tmp_path, "explain", NOT_OUTER)
    assert "forms: recurrent, step\n" in out and "chunk," not in out.split("kernels:")[0]
    assert "no chunked kernel: the input term of state h is not an outer product key (x) value" in out
    assert "parallel form: none generated (the input term of state h is not an outer product key (x) value)" in out
    assert "None" not in out
    assert "input    dt[B, T, H] in [0, inf)" in out and "param    A[H] in (-inf, 0]" in out
    out = run(capsys, tmp_path, "check", NOT_OUTER)
    assert out.startswith("ok: shifted (") and "forms: recurrent, step\n" in out
    assert "note: no chunked form: the input term of state h is not an outer product key (x) value" in out
    assert "warning" not in out        # dt >= 0 and A <= 0 declared: the log decay is <= 0


def test_hgrn1_lists_the_chunked_form_it_runs(capsys, tmp_path):
    assert "forms: chunk, recurrent, step\n" in run(capsys, tmp_path, "check", HGRN1)
    out = run(capsys, tmp_path, "check", HGRN1_UNRANGED)
    assert "forms: recurrent, step\n" in out and "can be negative" in out
    assert "declare the ranges of lb that make it >= 0" in out


@pytest.mark.parametrize("name", ["gla", "gated_delta_rule"])
def test_library_gates_are_not_warned_about(capsys, name):
    assert main(["check", name]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"ok: {name}") and "warning" not in out and "None" not in out


def test_a_warning_names_the_spec_s_own_values_once(capsys, tmp_path):
    """A Hedgehog-style normalizer: the warning quotes the denominator as written (was the
    readout symbols _r1, _r2 with their inlined feature maps), once."""
    text = """mixer hh
  dims   K, V
  input  q[K], k[K], v[V]
  let    phi_q = q * q - 1, phi_k = k * k - 1
  state  S[K, V], z[K]
  update S = S + phi_k * v
  update z = z + phi_k
  output o = (phi_q @ S) / (phi_q @ z + 1e-6)
"""
    out = run(capsys, tmp_path, "check", text)
    assert out.count("warning:") == 1
    assert "the output divides by phi_q @ z + 1e-06, which is not provably nonzero" in out
    assert "_r" not in out


def test_the_plan_dump_lists_the_forms_that_run(capsys, tmp_path):
    import json
    path = tmp_path / "m.mix"
    path.write_text(NOT_OUTER)
    assert main(["explain", str(path), "--dump", "plan"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["forms"] == ["recurrent", "step"] and plan["states"][0]["forms"] == ["recurrent", "step"]
