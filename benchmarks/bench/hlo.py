"""Reading a compiled step's HLO text (``compiled.as_text()``).

One reader for the benchmark's columns and the tests' assertions
(tests/test_performance.py): conditionals, parameter-sized copies and selects, kernels
(fusions), instructions, the bytes a good step moves, and how many instructions read an entry
argument.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import numpy as np

_COMP = re.compile(r"^(?:ENTRY )?%([\w.\-]+) \(.*\) -> .* \{$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+) = (.*?) ([\w\-]+)\((.*)$")
_NAME = re.compile(r"%([\w.\-]+)")
_LAYOUT = re.compile(r"\{[^}]*\}")
_ARRAY = re.compile(r"\b(pred|s8|u8|s16|u16|f16|bf16|s32|u32|f32|s64|u64|f64)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2}
_BYTES |= {"s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
# Instructions that move no data of their own.
_FREE = {
    "parameter",
    "tuple",
    "get-tuple-element",
    "bitcast",
    "constant",
    "conditional",
    "call",
    "while",
    "after-all",
    "partition-id",
    "replica-id",
}

Computations = dict[str, list[dict[str, Any]]]


def parse_hlo(text: str) -> tuple[Computations, str]:
    """``{computation: [instruction, ...]}`` and the entry computation's name.

    An instruction is a dict: ``name``; ``shape``, its result's type without layouts
    (``f32[64,32]``, ``(pred[], pred[])``); ``op``; ``operands``, the names it reads;
    ``rest``, the text after ``op(`` (``index=``, ``branch_computations=``, metadata);
    ``line``, the whole line without its backslashes (``op_name="grads['w']"``).
    """
    comps: Computations = {}
    cur = entry = None
    for line in text.splitlines():
        m = _COMP.match(line)
        if m:
            cur = m.group(1)
            comps[cur] = []
            entry = cur if line.startswith("ENTRY") else entry
            continue
        m = _INSTR.match(line) if cur else None
        if m:
            name, shape, op, rest = m.groups()
            comps[cur].append(
                {
                    "name": name,
                    "shape": _LAYOUT.sub("", shape),
                    "op": op,
                    "rest": rest,
                    "operands": _NAME.findall(rest.split(")")[0]),
                    "line": line.replace("\\", ""),
                }
            )
    return comps, entry


def branches(conditional: dict[str, Any]) -> list[str]:
    """The branch computations of a ``conditional`` instruction, in order."""
    return _NAME.findall(conditional["rest"].split("branch_computations={")[1].split("}")[0])


def _shape_bytes(shape: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        total += _BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
    return total


def bytes_moved(text: str) -> int:
    """Bytes read and written by the kernels a good step runs (an estimate: each
    top-level instruction's operands and result, once; conditionals: the branch that
    moves more, i.e. the update)."""
    comps, entry = parse_hlo(text)

    def walk(comp: str) -> int:
        shapes = {i["name"]: i["shape"] for i in comps[comp]}
        total = 0
        for ins in comps[comp]:
            if ins["op"] == "conditional":
                total += max(walk(b) for b in branches(ins))
            elif ins["op"] not in _FREE:
                total += _shape_bytes(ins["shape"])
                total += sum(_shape_bytes(shapes.get(o, "")) for o in ins["operands"])
        return total

    return walk(entry)


def _count(comps: Computations, op: str | None, shapes: set[str] | None) -> int:
    return sum(
        1
        for c in comps.values()
        for i in c
        if (op is None or i["op"] == op) and (shapes is None or i["shape"] in shapes)
    )


def count(text: str, op: str | None = None, shapes: set[str] | None = None) -> int:
    """How many instructions are ``op`` (any op where None) with a result shape in ``shapes``
    (any where None; shapes as ``shape_strings`` writes them)."""
    return _count(parse_hlo(text)[0], op, shapes)


def shape_strings(params) -> set[str]:
    """The float32 and float16 shapes of the leaves of ``params``, as the HLO writes them."""
    out = set()
    for p in jax.tree_util.tree_leaves(params):
        dims = ",".join(str(d) for d in p.shape)
        out |= {f"f32[{dims}]", f"f16[{dims}]"}
    return out


def hlo_stats(text: str, param_shapes: set[str]) -> dict[str, int]:
    """The benchmark's HLO columns; ``param_shapes`` from ``shape_strings(params)``."""
    comps, _ = parse_hlo(text)
    return {
        "conditionals": _count(comps, "conditional", None),
        "param_sized_copies": _count(comps, "copy", param_shapes),
        "param_sized_selects": _count(comps, "select", param_shapes),
        "kernels": _count(comps, "fusion", None),
        "instructions": _count(comps, None, None),
        "bytes_moved": bytes_moved(text),
    }


def reads(text: str, label: str) -> int:
    """How many instructions read the entry argument ``label`` (its ``op_name``, e.g.
    ``grads['w']``).

    Follows the value through tuples into the conditional's branches; a fusion that reads it
    counts once, wherever the read happens.
    """
    comps, entry = parse_hlo(text)
    start = [
        i["name"]
        for i in comps[entry]
        if i["op"] == "parameter" and f'op_name="{label}"' in i["line"]
    ]
    if len(start) != 1:
        raise ValueError(f"entry argument {label!r} found {len(start)} times, not once")
    todo, total = [(entry, start[0])], 0
    while todo:
        comp, name = todo.pop()
        for ins in comps[comp]:
            if name not in ins["operands"]:
                continue
            if ins["op"] in ("get-tuple-element", "bitcast"):
                todo.append((comp, ins["name"]))
            elif ins["op"] == "tuple":
                k = ins["operands"].index(name)
                for cond in comps[comp]:
                    if cond["op"] != "conditional" or ins["name"] not in cond["operands"]:
                        continue
                    branch = branches(cond)[cond["operands"].index(ins["name"]) - 1]
                    arg = next(i["name"] for i in comps[branch] if i["op"] == "parameter")
                    for g in comps[branch]:
                        if (
                            g["op"] == "get-tuple-element"
                            and arg in g["operands"]
                            and re.search(rf"\bindex={k}\b", g["rest"])
                        ):
                            todo.append((branch, g["name"]))
            else:
                total += 1
    return total
