"""Tensor-core FLOPs of one kernel launch from its TTIR: every tt.dot (2 M N K, batched dots
times their batch) times how often it runs, over the launch's grid.

How often: the TTIR is walked like a program, evaluating only its scalar integer arithmetic
(arith.* on i1/i32/i64, tt.get_program_id, the launch's integer arguments; constexprs are
already folded in): scf.for runs its body (lb - ub) / step times, scf.if takes the branch its
condition picks. Values the walk cannot know (anything loaded from memory, floats) are unknown;
a loop bound or branch that needs one makes the count unknown (None), as does scf.while.
The walk runs once with the program ids unknown; if control flow needs them, once per program
(up to MAX_PROGRAMS)."""
from __future__ import annotations

import math
import re

MAX_PROGRAMS = 20000
_LOC = re.compile(r"\s*loc\(.*$")
_RESULT = re.compile(r'^%([\w.$-]+)(?::(\d+))?\s*=\s*"?([\w.]+)"?')
_OP = re.compile(r'^"?([a-z_]+\.[\w.]+)"?')
_VALUE = re.compile(r"%[\w.$-]+(?:#\d+)?")
_SCALAR_ARG = re.compile(r"%([\w.$-]+):\s*(i1|i8|i16|i32|i64)\b")
_TENSOR = re.compile(r"tensor<([\dx]+)x[a-z]\w*>")


def parse(ttir: str) -> tuple[list[str], list[dict]]:
    """(the scalar integer arguments' names, the body as nested nodes {line, op, name, n,
    regions})."""
    raw = ttir.splitlines()
    at = next(i for i, x in enumerate(raw) if x.strip().startswith("tt.func"))
    scalar_args = [a for a, _ in _SCALAR_ARG.findall(raw[at])]
    root: list[dict] = []
    stack = [root]
    nodes: list[dict] = []
    for x in raw[at + 1:]:
        line = _LOC.sub("", x).strip()
        if line.startswith("}"):
            if re.match(r"^\}\s*(else|do)\s*\{", line) and nodes:
                stack.pop()
                nodes[-1]["regions"].append([])
                stack.append(nodes[-1]["regions"][-1])
            elif len(stack) > 1:
                stack.pop()
                nodes.pop()
            continue
        m = _RESULT.match(line)
        om = _OP.match(line)
        node = {"line": line, "op": m.group(3) if m else (om.group(1) if om else ""),
                "name": m.group(1) if m else None, "n": int(m.group(2) or 1) if m else 0, "regions": []}
        stack[-1].append(node)
        if line.endswith("{"):
            node["regions"].append([])
            nodes.append(node)
            stack.append(node["regions"][-1])
    return scalar_args, root


def dot_flops(line: str) -> int:
    """2 M N K (times the batch) of a tt.dot line: `... : tensor<MxK..> * tensor<KxN..> -> tensor<MxN..>`."""
    shapes = [[int(d) for d in s.split("x")] for s in _TENSOR.findall(line.rsplit(" : ", 1)[-1])]
    a, c = shapes[0], shapes[-1]
    return 2 * math.prod(c) * a[-1]


def _div(a, b):
    return None if b == 0 else int(a / b)


_BIN = {"addi": lambda a, b: a + b, "subi": lambda a, b: a - b, "muli": lambda a, b: a * b,
        "divsi": _div, "divui": _div, "remsi": lambda a, b: None if b == 0 else int(math.fmod(a, b)),
        "remui": lambda a, b: None if b == 0 else a % b,
        "ceildivsi": lambda a, b: None if b == 0 else -(-a // b), "floordivsi": lambda a, b: None if b == 0 else a // b,
        "maxsi": max, "minsi": min, "maxui": max, "minui": min, "andi": lambda a, b: a & b,
        "ori": lambda a, b: a | b, "xori": lambda a, b: a ^ b, "shli": lambda a, b: a << b,
        "shrsi": lambda a, b: a >> b, "shrui": lambda a, b: a >> b}
_CMP = {"eq": lambda a, b: a == b, "ne": lambda a, b: a != b, "slt": lambda a, b: a < b,
        "sle": lambda a, b: a <= b, "sgt": lambda a, b: a > b, "sge": lambda a, b: a >= b,
        "ult": lambda a, b: a < b, "ule": lambda a, b: a <= b, "ugt": lambda a, b: a > b, "uge": lambda a, b: a >= b}
_CAST = ("extsi", "extui", "trunci", "index_cast", "index_castui")


def _scalar(node: dict, env: dict) -> None:
    """Evaluate one scalar integer op into env (unknown: left out)."""
    line, op, name = node["line"], node["op"], node["name"]
    if name is None or "tensor<" in line:
        return
    key = "%" + name
    env.pop(key, None)
    vals = _VALUE.findall(line.split("=", 1)[1])
    got = [env.get(v) for v in vals]
    kind = op.split(".")[-1]
    if op == "arith.constant":
        m = re.search(r"constant\s+(-?\d+|true|false)\s*(?::\s*(?:i\d+|index))?$", line)
        if m:
            env[key] = {"true": 1, "false": 0}.get(m.group(1), None)
            if env[key] is None:
                env[key] = int(m.group(1))
    elif op == "tt.get_program_id":
        axis = re.search(r"get_program_id\s+(\w)", line).group(1)
        if env.get("pid_" + axis) is not None:
            env[key] = env["pid_" + axis]
    elif op == "tt.get_num_programs":
        axis = re.search(r"get_num_programs\s+(\w)", line).group(1)
        env[key] = env["grid"]["xyz".index(axis)]
    elif None in got or not got:
        return
    elif op.startswith("arith.") and kind in _BIN and len(got) == 2:
        r = _BIN[kind](*got)
        if r is not None:
            env[key] = r
    elif op == "arith.cmpi":
        pred = re.search(r"cmpi\s+(\w+)", line).group(1)
        env[key] = int(_CMP[pred](*got[:2]))
    elif op == "arith.select" and len(got) == 3:
        env[key] = got[1] if got[0] else got[2]
    elif op.startswith("arith.") and kind in _CAST:
        env[key] = got[0]


def _count(body: list[dict], env: dict) -> float | None:
    total = 0.0
    for node in body:
        op = node["op"]
        if op == "tt.dot":
            total += dot_flops(node["line"])
        elif op == "scf.for":
            m = re.search(r"scf\.for\s+(%[\w.$-]+)\s*=\s*(%[\w.$-]+)\s+to\s+(%[\w.$-]+)\s+step\s+(%[\w.$-]+)", node["line"])
            iv, lb, ub, st = m.group(1), env.get(m.group(2)), env.get(m.group(3)), env.get(m.group(4))
            if None in (lb, ub, st) or st <= 0:
                if _has_dot(node["regions"]):
                    return None
                continue
            inner = node["regions"][0]
            if not any(n["regions"] for n in inner):          # no control flow inside: a count per trip
                one = _count(inner, dict(env))
                if one is None:
                    return None
                total += one * len(range(lb, ub, st))
                continue
            for i in range(lb, ub, st):
                e = dict(env)
                e[iv] = i
                one = _count(inner, e)
                if one is None:
                    return None
                total += one
        elif op == "scf.if":
            cond = env.get(_VALUE.findall(node["line"].split("scf.if", 1)[1])[0])
            branches = [_count(r, dict(env)) for r in node["regions"]] + ([0.0] if len(node["regions"]) == 1 else [])
            if cond is not None:
                total += branches[0] if cond else branches[1]
            elif branches[0] == branches[1] and branches[0] is not None:
                total += branches[0]
            else:
                return None
        elif node["regions"]:
            if _has_dot(node["regions"]):       # scf.while and other region ops with dots inside
                return None
        else:
            _scalar(node, env)
    return total


def _has_dot(regions) -> bool:
    return any(n["op"] == "tt.dot" or _has_dot(n["regions"]) for r in regions for n in r)


def launch_flops(ttir: str, scalars: dict, grid) -> float | None:
    """Tensor-core FLOPs of one launch (None: unknown, with grid None too)."""
    if grid is None:
        return None
    args, body = parse(ttir)
    if not _has_dot([body]):
        return 0.0
    env = {"%" + a: int(scalars[a]) for a in args if isinstance(scalars.get(a), int)}
    env["grid"] = grid
    once = _count(body, dict(env))
    n = math.prod(grid)
    if once is not None:
        return once * n
    if n > MAX_PROGRAMS:
        return None
    total = 0.0
    for z in range(grid[2]):
        for y in range(grid[1]):
            for x in range(grid[0]):
                got = _count(body, dict(env, pid_x=x, pid_y=y, pid_z=z))
                if got is None:
                    return None
                total += got
    return total
