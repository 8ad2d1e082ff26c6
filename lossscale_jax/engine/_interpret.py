"""The wiring check's analysis of a traced step: the power of the scale each value carries.

``Powers(scale)`` answers, for a jit tracer of the frame the scale belongs to, the
``_powers.Value`` it carries (the rules are ``_powers``'): it walks back from the tracer
through the operations of the frame (``_tracers``: the step traced so far) to its inputs,
interpreting each once, and interprets the programs an operation holds (a loop's body to a
fixed point of its carry, a conditional's branches, a call's, a remat's, a ``shard_map``'s).
An operation of a backward pass (``transpose`` in its name stack, or inside a program of one
but for a remat's recomputed forward pass) marks the scale it carries as carried by a
cotangent. Results are kept: every later question about the same frame and scale reads them.
"""

from __future__ import annotations

from typing import Any

from lossscale_jax.engine import _powers, _tracers


class Powers:
    """The analysis of one frame against one scale, its results kept for later questions.

    ``value(tracer)`` is the ``_powers.Value`` of a jit tracer of the frame;
    ``backward(tracer)`` whether an operation of a backward pass is among those it depends on.
    """

    def __init__(self, target: Any) -> None:
        self.goal = _tracers.variable(target)
        # A scale that is a constant of the frame (a state made inside the step) is one array
        # that each of its uses may see through a tracer of its own.
        known, value = _tracers.known_value(target)
        self.goal_value = value if known else None
        self.values: dict[Any, tuple[_powers.Value, bool]] = {}  # a frame's variable -> value, bwd
        self.programs: dict[
            tuple[int, tuple[_powers.Value, ...], bool], tuple[list[_powers.Value], bool]
        ] = {}
        self.kept: list[Any] = []  # the programs keyed by id, kept alive
        # A conditional's outputs per branch: (output, index variable, branch) -> value
        self.taken: dict[tuple[Any, Any, int], _powers.Value] = {}

    # -- a frame: walked back from the roots through the tracers' operations --------------

    def value(self, tracer: Any) -> _powers.Value:
        return self._state(tracer)[0]

    def backward(self, tracer: Any) -> bool:
        return self._state(tracer)[1]

    def _state(self, root: Any) -> tuple[_powers.Value, bool]:
        values = self.values
        key = _tracers.variable(root)
        if key is None:
            return self._leaf(root), False
        if key in values:
            return values[key]
        stack = [root]
        while stack:
            t = stack[-1]
            key = _tracers.variable(t)
            if key in values:
                stack.pop()
                continue
            if key is self.goal:
                values[key] = (_powers.SCALE, False)
                stack.pop()
                continue
            eqn = _tracers.producer(t)
            if eqn is None:
                values[key] = (self._leaf(t), False)
                if self.goal_value is not None and _tracers.known_value(t)[1] is self.goal_value:
                    values[key] = (_powers.SCALE, False)
                stack.pop()
                continue
            ins = _tracers.inputs(eqn)
            pending = [
                x for x in ins if (k := _tracers.variable(x)) is not None and k not in values
            ]
            if pending:
                stack.extend(pending)
                continue
            states = [
                self._state(x) if _tracers.variable(x) is None else values[_tracers.variable(x)]
                for x in ins
            ]
            keys = [_tracers.variable(x) for x in ins]
            outs, bwd = self._eqn(eqn, [s[0] for s in states], _tracers.transposed(eqn), keys)
            bwd = bwd or any(s[1] for s in states)
            for var, out in zip(eqn.outvars, outs, strict=False):
                # the scale is the scale, whichever output of its operation is walked first
                values[var] = (_powers.SCALE, False) if var is self.goal else (out, bwd)
            if key not in values:  # pragma: no cover - a tracer that is no output of its eqn
                values[key] = (None, bwd)
            stack.pop()
        return values[_tracers.variable(root)]

    @staticmethod
    def _leaf(tracer: Any) -> _powers.Value:
        """An input of the frame, a literal, or a constant of it."""
        known, value = _tracers.known_value(tracer)
        if not _powers.inexact(getattr(tracer, "aval", None)):
            return _powers.FREE
        return _powers.constant(value) if known else _powers.INPUT

    # -- one operation, and the programs it holds ----------------------------------------

    def _eqn(
        self, eqn: Any, ins: list[_powers.Value], transposed: bool, keys: list[Any]
    ) -> tuple[list[_powers.Value], bool]:
        n_out = len(eqn.outvars)
        name = eqn.primitive.name
        programs = [] if _powers.has_rule(name) else _tracers.programs(eqn)
        inner_bwd = False
        if name == "cond" and programs:
            outs, inner_bwd = self._cond(eqn, programs, ins, keys, transposed)
        elif programs:
            outs, inner_bwd = self._call(name, eqn.params, programs, ins, n_out, transposed)
        elif all(v is _powers.FREE or v is _powers.INPUT for v in ins):
            # most of a step: nothing to carry but, moved or summed, an input of the step
            moved = _powers.moves(name) and any(v is _powers.INPUT for v in ins)
            return [_powers.INPUT if moved else _powers.FREE] * n_out, transposed
        else:
            outs = _powers.apply(name, eqn.params, ins, n_out)
        outs = [
            v if v is _powers.FREE or _powers.inexact(var.aval) else _powers.FREE
            for v, var in zip(outs, eqn.outvars, strict=False)
        ]
        if transposed:
            outs = [_powers.backward(v) for v in outs]
        return outs, transposed or inner_bwd

    def _call(
        self,
        name: str,
        params: dict[str, Any],
        programs: list[Any],
        ins: list[_powers.Value],
        n_out: int,
        transposed: bool,
    ) -> tuple[list[_powers.Value], bool]:
        """The outputs of an operation holding programs: each interpreted."""
        if name == "scan":
            return self._scan(params, programs[0], ins, n_out, transposed)
        if name == "while":
            return self._while(params, ins, transposed)
        program = next(
            (p for p in programs if len(_tracers.open_jaxpr(p).invars) == len(ins)), None
        )
        if program is None or len(_tracers.open_jaxpr(program).outvars) != n_out:
            # a program the rule cannot line up with the operation's operands
            return [_powers.FREE if all(_powers.free(v) for v in ins) else None] * n_out, False
        return self._run(program, ins, transposed)

    def _cond(
        self,
        eqn: Any,
        programs: list[Any],
        ins: list[_powers.Value],
        keys: list[Any],
        transposed: bool,
    ) -> tuple[list[_powers.Value], bool]:
        """A conditional: one of its branches' outputs. An output of an earlier conditional on
        the same index (the residuals a backward pass's conditional reads, which the forward
        one returns in slots its branches share) is taken from the branch of the same number:
        both conditionals take the same branch."""
        index = keys[0]
        branches = []
        for i, program in enumerate(programs):
            mine = [
                self.taken.get((key, index, i), value)
                for key, value in zip(keys[1:], ins[1:], strict=False)
            ]
            branches.append(self._run(program, mine, transposed))
        outs = [_powers.choice([b[0][j] for b in branches]) for j in range(len(eqn.outvars))]
        if index is not None:
            for j, var in enumerate(eqn.outvars):
                for i, b in enumerate(branches):
                    self.taken[(var, index, i)] = b[0][j]
        return outs, any(b[1] for b in branches)

    def _scan(
        self,
        params: dict[str, Any],
        body: Any,
        ins: list[_powers.Value],
        n_out: int,
        transposed: bool,
    ) -> tuple[list[_powers.Value], bool]:
        if "ft_in" in params:  # JAX 0.12: a flat tree of (consts, carry, xs)
            parts = params["ft_in"].update(list(range(len(ins)))).unpack()
            consts, carries = len(list(parts[0])), len(list(parts[1]))
        else:
            consts, carries = int(params["num_consts"]), int(params["num_carry"])
        fixed, xs = ins[:consts], ins[consts + carries :]
        carry = list(ins[consts : consts + carries])
        outs, bwd = self._run(body, fixed + carry + xs, transposed)
        for _ in range(_powers.MAX_POWER):
            joined = [_powers.choice([c, o]) for c, o in zip(carry, outs[:carries], strict=False)]
            if joined == carry:
                break
            carry = joined
            outs, bwd = self._run(body, fixed + carry + xs, transposed)
        else:
            unknown: list[_powers.Value] = [None] * n_out
            return unknown, bwd
        return carry + outs[carries:], bwd

    def _while(
        self, params: dict[str, Any], ins: list[_powers.Value], transposed: bool
    ) -> tuple[list[_powers.Value], bool]:
        body = params["body_jaxpr"]
        cond_n = int(params.get("cond_nconsts", 0))
        body_n = int(params.get("body_nconsts", 0))
        fixed = ins[cond_n : cond_n + body_n]
        carry = list(ins[cond_n + body_n :])
        bwd = False
        for _ in range(_powers.MAX_POWER):
            outs, bwd = self._run(body, fixed + carry, transposed)
            joined = [_powers.choice([c, o]) for c, o in zip(carry, outs, strict=False)]
            if joined == carry:
                return carry, bwd
            carry = joined
        return [None] * len(carry), bwd

    def _run(
        self, program: Any, ins: list[_powers.Value], transposed: bool
    ) -> tuple[list[_powers.Value], bool]:
        """Interprets a program (a jaxpr) from its inputs' values."""
        key = (id(program), tuple(ins), transposed)
        done = self.programs.get(key)
        if done is not None:
            return done
        self.kept.append(program)
        jaxpr = _tracers.open_jaxpr(program)
        env: dict[Any, _powers.Value] = {}
        for var, value in zip(_tracers.constvars(program), _tracers.consts(program), strict=False):
            env[var] = _powers.constant(value) if _powers.inexact(var.aval) else _powers.FREE
        for var, value in zip(jaxpr.invars, ins, strict=False):
            env[var] = value

        def read(atom: Any) -> _powers.Value:
            if _tracers.is_literal(atom):
                return _powers.constant(atom.val) if _powers.inexact(atom.aval) else _powers.FREE
            return env.get(atom, _powers.FREE)

        bwd = False
        for eqn in jaxpr.eqns:
            inner = transposed and not _tracers.rematted(eqn)
            keys = [None if _tracers.is_literal(a) else a for a in eqn.invars]
            outs, e_bwd = self._eqn(
                eqn, [read(a) for a in eqn.invars], inner or _tracers.transposed(eqn), keys
            )
            bwd = bwd or e_bwd
            for var, out in zip(eqn.outvars, outs, strict=False):
                env[var] = out
        result = ([read(a) for a in jaxpr.outvars], bwd)
        self.programs[key] = result
        return result
