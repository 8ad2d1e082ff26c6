"""Reading a compiled step's HLO text (``compiled.as_text()``).

One reader for the benchmark's columns and the tests' assertions
(tests/test_performance.py): conditionals, parameter-sized copies and selects, kernels
(fusions), instructions, the bytes a good step moves, and how many instructions read an entry
argument.

It reads XLA:CPU's and XLA:GPU's text alike. Where they differ: a conditional is
``branch_computations={%b0, %b1, ...}`` (an index picks the branch; XLA:CPU, and jax's
``lax.cond`` as lowered) or ``true_computation=%t, false_computation=%f`` (a predicate;
XLA:GPU rewrites a two-branch conditional on ``convert(pred)`` so); XLA:GPU wraps runs of
kernels into ``call``s (command buffers), which the byte estimate and ``reads`` follow into;
element types beyond XLA:CPU's usual ones (``f8e4m3fn``, ``c64``, ...) have their sizes; and
XLA (jaxlib 0.11) prints a read of one element of a tuple-shaped value as an operand
``%name#k`` (no ``get-tuple-element`` of its own), which reads element ``k`` only.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import numpy as np

_COMP = re.compile(r"^(?:ENTRY )?%([\w.\-]+) \(.*\) -> .* \{$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+) = (.*?) ([\w\-]+)\((.*)$")
_NAME = re.compile(r"%([\w.\-]+)")
# An operand: a name, and ``#k`` where it reads element k of a tuple-shaped value.
_OPERAND = re.compile(r"%([\w.\-]+)(?:#(\d+))?")
_COMMENT = re.compile(r"/\*.*?\*/")
_LAYOUT = re.compile(r"\{[^}]*\}")
# An array type: element type, then dimensions (``f32[64,32]``, ``pred[]``; a bounded
# dynamic dimension, ``<=8``, counts at its bound).
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[((?:<=)?\d*(?:,(?:<=)?\d+)*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2}
_BYTES |= {"s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_BYTES |= {"s4": 1, "u4": 1, "s2": 1, "u2": 1, "s1": 1, "u1": 1}  # packed types: an upper bound
_F8 = re.compile(r"f8e\d+m\d+\w*|f4e\d+m\d+\w*|f6e\d+m\d+\w*|f8e8m0fnu")  # 1 byte or less
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
    ``elements``, beside each operand the tuple element it reads (``%name#k``: ``k``), else
    None; ``rest``, the text after ``op(`` (``index=``, ``branch_computations=``, metadata);
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
            operands = _OPERAND.findall(_operand_text(rest))
            comps[cur].append(
                {
                    "name": name,
                    "shape": _LAYOUT.sub("", shape),
                    "op": op,
                    "rest": rest,
                    "operands": [o for o, _ in operands],
                    "elements": [int(k) if k else None for _, k in operands],
                    "line": line.replace("\\", ""),
                }
            )
    return comps, entry


def _operand_text(rest: str) -> str:
    """The operand list of an instruction: ``rest`` up to the ``)`` that closes ``op(``
    (an operand printed with a tuple type, ``((f32[], f32[]) %p)``, has parentheses of its
    own)."""
    depth = 1
    for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return rest[:i]
    return rest


_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_TRUE = re.compile(r"\btrue_computation=%([\w.\-]+)")
_FALSE = re.compile(r"\bfalse_computation=%([\w.\-]+)")
_CALLS = re.compile(r"\bto_apply=%([\w.\-]+)")


def branches(conditional: dict[str, Any]) -> list[str]:
    """The branch computations of a ``conditional`` instruction, in the order of the
    operands they take: branch ``k`` takes operand ``k + 1``.

    ``branch_computations={%b0, %b1}`` (an index picks the branch) gives ``[b0, b1]``;
    ``true_computation=%t, false_computation=%f`` (a predicate; XLA:GPU) gives ``[t, f]``,
    since ``conditional(pred, true_operand, false_operand)`` passes operand 1 to ``t``.
    """
    rest = conditional["rest"]
    m = _BRANCHES.search(rest)
    if m:
        return _NAME.findall(m.group(1))
    t, f = _TRUE.search(rest), _FALSE.search(rest)
    if t and f:
        return [t.group(1), f.group(1)]
    raise ValueError(
        f"conditional %{conditional['name']}: neither branch_computations= nor "
        f"true_computation=/false_computation= in {rest[:200]!r}"
    )


def _called(ins: dict[str, Any]) -> str | None:
    """The computation a ``call`` runs (XLA:GPU's command buffers are calls), else None."""
    m = _CALLS.search(ins["rest"]) if ins["op"] == "call" else None
    return m.group(1) if m else None


def _element_bytes(dtype: str) -> int:
    if dtype in _BYTES:
        return _BYTES[dtype]
    if _F8.fullmatch(dtype):
        return 1
    raise ValueError(f"HLO element type {dtype!r}: its size is not known to bench/hlo.py")


def tuple_element(shape: str, k: int) -> str:
    """Element ``k`` of a tuple shape as ``parse_hlo`` keeps it (``(f32[4], (pred[],
    s32[]))``, element 1: ``(pred[], s32[])``)."""
    text = _COMMENT.sub("", shape).strip()
    if not text.startswith("("):
        raise ValueError(f"element {k} of {shape[:80]!r}: not a tuple shape")
    parts, depth, start = [], 0, 1
    for i, ch in enumerate(text):
        depth += {"(": 1, "[": 1, ")": -1, "]": -1}.get(ch, 0)
        if (ch == "," and depth == 1) or (ch == ")" and depth == 0):
            parts.append(text[start:i].strip())
            start = i + 1
    parts = [p for p in parts if p]
    if not 0 <= k < len(parts):
        raise ValueError(f"element {k} of {shape[:80]!r}: the tuple has {len(parts)}")
    return parts[k]


def _operand_shapes(ins: dict[str, Any], shapes: dict[str, str]) -> list[str]:
    """The shapes ``ins`` reads: each operand's, or the one element of it ``%name#k`` reads
    (an operand defined elsewhere, e.g. in an excerpt, reads nothing)."""
    out = []
    for name, k in zip(ins["operands"], ins["elements"], strict=True):
        shape = shapes.get(name, "")
        out.append(tuple_element(shape, k) if k is not None and shape else shape)
    return out


def _shape_bytes(shape: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        if dtype in ("token", "opaque"):
            continue
        sizes = [int(d.removeprefix("<=")) for d in dims.split(",") if d]
        total += _element_bytes(dtype) * int(np.prod(sizes or [1]))
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
            elif _called(ins):
                total += walk(_called(ins))
            elif ins["op"] not in _FREE:
                total += _shape_bytes(ins["shape"])
                total += sum(_shape_bytes(s) for s in _operand_shapes(ins, shapes))
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

    Follows the value through tuples into the conditional's branches (where the tuple feeds
    more than one branch, the branch that reads it most: a step runs one) and into the
    computations ``call``s run; a fusion that reads it counts once, wherever the read happens.
    """
    comps, entry = parse_hlo(text)
    start = [
        i["name"]
        for i in comps[entry]
        if i["op"] == "parameter" and f'op_name="{label}"' in i["line"]
    ]
    if len(start) != 1:
        raise ValueError(f"entry argument {label!r} found {len(start)} times, not once")
    return _reads(comps, entry, start[0])


def _parameter(comps: Computations, comp: str, number: int) -> str:
    return next(
        i["name"]
        for i in comps[comp]
        if i["op"] == "parameter" and re.match(rf"{number}\)", i["rest"])
    )


def _reads(comps: Computations, comp: str, name: str, element: int | None = None) -> int:
    """Instructions that read ``name`` in ``comp`` (element ``element`` of it, where it is a
    tuple: read as ``%name#k`` or through a ``get-tuple-element``), following it as ``reads``
    says."""
    total = 0
    for ins in comps[comp]:
        at = [
            p
            for p, (o, k) in enumerate(zip(ins["operands"], ins["elements"], strict=True))
            if o == name and k == element
        ]
        if element is not None and ins["op"] == "get-tuple-element" and ins["operands"] == [name]:
            if re.search(rf"\bindex={element}\b", ins["rest"]):
                total += _reads(comps, comp, ins["name"])
            continue
        if not at:
            continue
        if ins["op"] in ("get-tuple-element", "bitcast"):
            total += _reads(comps, comp, ins["name"])
        elif _called(ins):
            callee = _called(ins)
            for p in at:
                total += _reads(comps, callee, _parameter(comps, callee, p))
        elif ins["op"] == "tuple":
            for k in at:  # its element k: read as ``%tuple#k``, or in a conditional's branch
                total += _reads(comps, comp, ins["name"], k)
                total += _branch_reads(comps, comp, ins["name"], k)
        else:
            total += 1
    return total


def _branch_reads(comps: Computations, comp: str, tup: str, k: int) -> int:
    """Reads of element ``k`` of the tuple ``tup`` inside the branches of the conditionals
    it feeds (where it feeds more than one branch, the branch that reads it most: a step
    runs one)."""
    total = 0
    for cond in comps[comp]:
        if cond["op"] != "conditional" or tup not in cond["operands"]:
            continue
        fed = [b for b, o in zip(branches(cond), cond["operands"][1:], strict=True) if o == tup]
        total += max((_element_reads(comps, b, k) for b in fed), default=0)
    return total


def _element_reads(comps: Computations, branch: str, k: int) -> int:
    """Reads of element ``k`` of a branch's tuple argument."""
    arg = next(i["name"] for i in comps[branch] if i["op"] == "parameter")
    return _reads(comps, branch, arg, k)
