"""``check_checkpoint``, ``restore_flax``, ``restore_orbax``: a checkpoint checked, then restored.

Re-exported by ``lossscale_jax.checkpoint`` (its docstring tells the whole story).
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lossscale_jax.checkpoint import _policy_state
from lossscale_jax.checkpoint._flax_serialization import FIELDS, POLICY_STATE
from lossscale_jax.engine._policy import LossScalePolicy, check_policy
from lossscale_jax.engine._state import LossScaleState, is_loss_scale_state
from lossscale_jax.errors import CheckpointError, CheckpointPolicyError, CheckpointVersionError

# Fields whose presence marks a subtree of a checkpoint as a loss-scale state.
_MARKERS = frozenset({"scale", "growth_count", "hysteresis_count"})
# Fields added after 0.1.0, of LossScaleState and of the states holding it
# (LossScalingState, LossScalingMultiStepsState), with what each holds. A checkpoint
# without them was saved by an earlier version.
_ADDED_FIELDS = {
    "recent_overflow_rate": "the recent overflow rate",
    "range_peak": "HeadroomScale's held peak of the range (0 under other policies)",
    "margin": "HeadroomScale's margin (0 under other policies)",
}
_ADDED_OWNER_FIELDS = {
    "leaf_overflow": "the per-leaf overflow record",
    "window_range": (
        "the window's measured range under accumulation (HeadroomScale's; now kept, 0, under "
        "every policy, so a checkpoint moves between policies)"
    ),
    "window_leaf_overflow": "the per-leaf record of the window in progress",
}


# Fields only one front-end's state has, and the front-end; otherwise loss_scaling's.
_FRONT_END_FIELDS = (
    ("layers", "layerwise_scaling"),
    ("mini_step", "loss_scaling_multi_steps"),
    ("acc_grads", "loss_scaling_multi_steps"),
)


def _front_end(table: dict[tuple[str, ...], Any], owner: tuple[str, ...]) -> str:
    """The front-end whose state holds the loss-scale state under ``owner``."""
    fields = {p[len(owner)] for p in table if len(p) > len(owner) and p[: len(owner)] == owner}
    for field, name in _FRONT_END_FIELDS:
        if field in fields:
            return name
    return "loss_scaling"


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _leaf_table(tree: Any) -> dict[tuple[str, ...], tuple[tuple[int, ...], str]]:
    """``{path: (shape, dtype name)}`` for every leaf; paths as tuples of strings."""
    table = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        shape = tuple(getattr(leaf, "shape", np.shape(leaf)))
        dtype = getattr(leaf, "dtype", None)
        dtype = np.dtype(dtype).name if dtype is not None else np.asarray(leaf).dtype.name
        table[tuple(_key_name(k) for k in path)] = (shape, dtype)
    return table


def _loss_scale_prefixes(paths: Any) -> list[tuple[str, ...]]:
    children: dict[tuple[str, ...], set[str]] = {}
    for path in paths:
        if path:
            children.setdefault(path[:-1], set()).add(path[-1])
    return sorted(p for p, names in children.items() if _MARKERS <= names)


def _fmt(path: tuple[str, ...]) -> str:
    return "/".join(path) if path else "<root>"


def _is_value(x: Any) -> bool:
    return isinstance(x, np.ndarray | np.generic | jax.Array | int | float | bool)


_NO_VALUES = (
    "check_checkpoint(policy=...) needs the checkpoint's values; an Orbax metadata tree has "
    "none: use restore_orbax(path, target, policy=policy), which checks after reading them."
)


def _saved_states(tree: Any) -> list[tuple[str, LossScaleState]]:
    """Every loss-scale state of ``tree``, with where it sits.

    ``tree`` holds values: a restored pytree (``LossScaleState`` nodes) or a
    ``flax.serialization`` state dict (a dict of the fields per loss-scale state).
    """
    states: list[tuple[str, LossScaleState]] = []
    for path, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_loss_scale_state)[0]:
        if isinstance(x, LossScaleState):
            states.append((_fmt(tuple(_key_name(k) for k in path)), x))
    if states:
        return states
    for prefix in _loss_scale_prefixes(_leaf_table_paths(tree)):
        node = _node(tree, prefix)
        values = {n: node[n] for n in FIELDS if n in node}
        if not all(_is_value(v) for v in jax.tree_util.tree_leaves(values)):
            raise TypeError(_NO_VALUES)
        states.append((_fmt(prefix), _as_state(values)))
    return states


def _node(tree: Any, prefix: tuple[str, ...]) -> Any:
    for name in prefix:
        tree = tree[name] if isinstance(tree, dict) else tree[int(name)]
    return tree


def _as_state(values: dict[str, Any]) -> LossScaleState:
    """A ``LossScaleState`` of the saved field values (any leading axes; a field the
    checkpoint lacks is 0, which ``conform`` reads as nothing measured; a policy's own
    state is ``None`` if it lacks one)."""
    own = jax.tree_util.tree_map(jnp.asarray, values.get(POLICY_STATE))
    arrays = {n: jnp.asarray(values.get(n, 0)) for n in FIELDS if n != POLICY_STATE}
    return LossScaleState(**arrays, policy_state=own)


def _check_policy(tree: Any, policy: LossScalePolicy | None) -> None:
    """Raises ``CheckpointPolicyError`` for a loss-scale state ``policy`` would not hold.

    A state may carry leading axes (one value per device, from ``jax.pmap``): every
    element is checked.
    """
    if policy is None:
        return
    policy = check_policy(policy)
    for where, state in _saved_states(tree):
        if not _is_value(state.scale):
            raise TypeError(_NO_VALUES)
        have = np.asarray(state.scale, np.float32)
        want = np.asarray(policy.conform(state).scale, np.float32)
        same = (have == want) | (np.isnan(have) & np.isnan(want))
        if not np.all(same):
            index = np.unravel_index(int(np.flatnonzero(~same)[0]), have.shape)
            at = f" (element {tuple(int(i) for i in index)} of {have.shape})" if have.ndim else ""
            raise CheckpointPolicyError(
                f"The checkpoint's loss-scale state at {where!r} has scale "
                f"{float(have[index])!r}{at}, which {policy!r} would not hold (it keeps "
                f"{float(want[index])!r}): it was saved under another policy. To continue "
                "under this one, restore without policy= and call "
                "lossscale_jax.switch_policy(restored, policy) (it moves the scale and keeps "
                "the counters)."
            )


def _leaf_table_paths(tree: Any) -> list[tuple[str, ...]]:
    return [
        tuple(_key_name(k) for k in path)
        for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]
    ]


def check_checkpoint(target: Any, saved: Any, *, policy: LossScalePolicy | None = None) -> None:
    """Raises ``ValueError`` unless ``saved`` has the structure of ``target``.

    Rule::

      paths, shapes and dtypes of saved's leaves == those of target's leaves
      (a LossScaleState present in one and absent in the other is named as such;
       the fields an earlier version did not save are named as such)
      if policy: every saved loss-scale state is one policy holds
                 (policy.conform(state).scale == state.scale)

    A mismatch with ``policy`` raises rather than warns: resuming under
    another policy is a decision (``switch_policy`` makes it in one call), and a
    warning in a long log is easy to miss.

    Args:
      target: the optimizer state to restore into (e.g. a fresh ``tx.init(params)``).
      saved: the checkpoint's tree: a restored pytree, a ``flax.serialization``
        state dict, or an Orbax metadata tree (leaves with ``shape`` and ``dtype``).
      policy: optional; the policy the restored state will be used with.

    Raises:
      errors.CheckpointError: (a ``ValueError``) naming the missing loss-scale
        state, or the first leaves that are missing, unexpected or of another
        shape or dtype; ``errors.CheckpointVersionError`` for fields an earlier
        version did not save; ``errors.CheckpointPolicyError`` for a loss-scale
        state whose scale ``policy`` would not hold.
      TypeError: if ``policy`` is given with an Orbax metadata tree (no values).

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import lossscale_jax as lsj
      >>> params = {"w": jnp.zeros(2)}
      >>> target = lsj.loss_scaling(optax.adam(1e-3), lsj.DynamicScale()).init(params)
      >>> try:
      ...     lsj.check_checkpoint(target, optax.adam(1e-3).init(params))
      ... except ValueError as e:
      ...     print(str(e).split(":")[0])
      The checkpoint holds no loss-scale state
    """
    want = _leaf_table(target)
    have = _leaf_table(saved)
    want_ls = _loss_scale_prefixes(want)
    have_ls = _loss_scale_prefixes(have)
    if want_ls and not have_ls:
        raise CheckpointError(
            "The checkpoint holds no loss-scale state: the optimizer state expects one at "
            f"{', '.join(_fmt(p) for p in want_ls)!r} (lossscale_jax.loss_scaling), so the "
            "checkpoint was probably saved without loss scaling. Restore it into the inner "
            "optimizer's state and put it in a fresh state: "
            "tx.init(params)._replace(inner_state=restored)."
        )
    if have_ls and not want_ls:
        raise CheckpointError(
            "The checkpoint holds a loss-scale state at "
            f"{', '.join(_fmt(p) for p in have_ls)!r} but the optimizer state has none: build "
            "the optimizer with lossscale_jax.loss_scaling(...) as when the checkpoint was saved."
        )
    for prefix in want_ls:
        if prefix in have_ls:
            mine, theirs = (_front_end(table, prefix[:-1]) for table in (want, have))
            if mine != theirs:
                raise CheckpointError(
                    f"The checkpoint holds the state of lossscale_jax.{theirs}(...) at "
                    f"{_fmt(prefix[:-1])!r}; the optimizer state is "
                    f"lossscale_jax.{mine}(...)'s. A checkpoint restores into the front-end "
                    f"that saved it: build the optimizer with {theirs}(...) to resume as saved, "
                    f"or restore it into that front-end's state and carry its loss_scale and "
                    f"inner_state over: {mine}'s tx.init(params)._replace(loss_scale="
                    "old.loss_scale, inner_state=old.inner_state) (accumulated gradients of an "
                    "unfinished window are dropped)."
                )
    added = {
        **{(n, False): d for n, d in _ADDED_FIELDS.items()},
        **{(n, True): d for n, d in _ADDED_OWNER_FIELDS.items()},
    }
    gaps = [
        (path, note)
        for prefix in want_ls
        for (name, owner), note in added.items()
        for path in [(prefix[:-1] if owner else prefix) + (name,)]
        if path in want and path not in have
    ]
    if gaps:
        listed = "; ".join(f"{_fmt(p)} ({note})" for p, note in gaps)
        raise CheckpointVersionError(
            "The checkpoint was saved by an earlier version of lossscale_jax: it lacks "
            f"{listed}. Fill them in before restoring: see docs/reliability.md, "
            "'Checkpoints from an earlier version'."
        )
    for prefix in want_ls:
        if prefix in have_ls:
            mine = {p[-1] for p in want if p[:-1] == prefix}
            theirs = {p[-1] for p in have if p[:-1] == prefix}
            if mine != theirs:
                raise CheckpointError(
                    f"The checkpoint's loss-scale state at {_fmt(prefix)!r} does not match "
                    f"LossScaleState: missing fields {sorted(mine - theirs)}, unknown fields "
                    f"{sorted(theirs - mine)}."
                )
            _policy_state.check_policy_state(_fmt(prefix), prefix, want, have)
    missing = [p for p in want if p not in have]
    unexpected = [p for p in have if p not in want]
    if missing or unexpected:
        raise CheckpointError(
            "The checkpoint does not match the optimizer state's structure: "
            f"{len(missing)} leaves missing from the checkpoint "
            f"{[_fmt(p) for p in missing[:3]]}, {len(unexpected)} unexpected "
            f"{[_fmt(p) for p in unexpected[:3]]}. Was it saved from another optimizer?"
        )
    for path, (shape, dtype) in want.items():
        if have[path] != (shape, dtype):
            raise CheckpointError(
                f"The checkpoint's leaf {_fmt(path)!r} has shape {have[path][0]} and dtype "
                f"{have[path][1]}; the optimizer state expects shape {shape} and dtype {dtype}."
            )
    _check_policy(saved, policy)


def restore_flax(
    target: Any, encoded: bytes | dict[str, Any], *, policy: LossScalePolicy | None = None
) -> Any:
    """Restores ``target``'s structure from ``flax.serialization`` output, checked first.

    Rule::

      state_dict = msgpack_restore(encoded) if bytes else encoded
      check_checkpoint(to_state_dict(target), state_dict, policy=policy)
      return from_state_dict(target, state_dict)

    Args:
      target: an optimizer state of the right structure (e.g. ``tx.init(params)``).
      encoded: bytes from ``flax.serialization.to_bytes(opt_state)``, or the state
        dict from ``flax.serialization.to_state_dict(opt_state)``.
      policy: optional; refuse a loss-scale state this policy would not hold
        (see ``check_checkpoint``).

    Returns:
      The restored optimizer state (leaves as NumPy arrays, bit-identical).

    Raises:
      ValueError: as ``check_checkpoint``.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from flax import serialization
      >>> import lossscale_jax as lsj
      >>> tx = lsj.loss_scaling(optax.adam(1e-3), lsj.DynamicScale(init_scale=8.0))
      >>> state = tx.init({"w": jnp.zeros(2)})
      >>> restored = lsj.restore_flax(state, serialization.to_bytes(state))
      >>> float(restored.loss_scale.scale)
      8.0
    """
    from flax import serialization

    state_dict: Any  # whatever the bytes hold; check_checkpoint compares it with target
    if isinstance(encoded, bytes | bytearray):
        state_dict = serialization.msgpack_restore(bytes(encoded))
    elif isinstance(encoded, dict):
        state_dict = encoded
    else:
        raise TypeError(
            f"encoded must be bytes from flax.serialization.to_bytes or a state dict, "
            f"got {type(encoded).__name__}."
        )
    check_checkpoint(serialization.to_state_dict(target), state_dict)
    restored = serialization.from_state_dict(target, state_dict)
    _check_policy(restored, policy)
    return restored


def restore_orbax(
    path: str | os.PathLike[str],
    target: Any,
    *,
    checkpointer: Any = None,
    policy: LossScalePolicy | None = None,
) -> Any:
    """Restores an optimizer state saved with Orbax, checking its structure first.

    Rule::

      check_checkpoint(target, checkpointer.metadata(path))   # before reading any array
      restored = checkpointer.restore(path, target)
      if policy: check every loss-scale state of restored against policy
      return restored

    Args:
      path: the checkpoint directory, as given to ``checkpointer.save``.
      target: an optimizer state of the right structure (e.g. ``tx.init(params)``);
        its leaves' shapes, dtypes and shardings are used for the restore.
      checkpointer: an ``orbax.checkpoint`` checkpointer with ``metadata`` and
        ``restore``; default ``orbax.checkpoint.StandardCheckpointer()``.
      policy: optional; refuse a loss-scale state this policy would not hold
        (see ``check_checkpoint``).

    Returns:
      The restored optimizer state.

    Raises:
      ValueError: as ``check_checkpoint``.

    Examples:
      >>> import tempfile, os, jax.numpy as jnp, optax
      >>> import orbax.checkpoint as ocp
      >>> import lossscale_jax as lsj
      >>> tx = lsj.loss_scaling(optax.adam(1e-3), lsj.DynamicScale(init_scale=8.0))
      >>> state = tx.init({"w": jnp.zeros(2)})
      >>> path = os.path.join(tempfile.mkdtemp(), "opt")
      >>> with ocp.StandardCheckpointer() as ckptr:
      ...     ckptr.save(path, state)
      >>> float(lsj.restore_orbax(path, state).loss_scale.scale)
      8.0
    """
    import orbax.checkpoint as ocp

    ckptr = checkpointer if checkpointer is not None else ocp.StandardCheckpointer()
    meta = ckptr.metadata(path)
    tree = getattr(meta, "item_metadata", meta)
    tree = getattr(tree, "tree", tree)
    check_checkpoint(target, tree)
    nodes = [_node(tree, p) for p in _loss_scale_prefixes(_leaf_table_paths(tree))]
    if _policy_state.saved_before_policy_state(nodes):
        restored = _policy_state.restore_without_policy_state(ckptr, path, target)
    else:
        restored = ckptr.restore(path, target)
    _check_policy(restored, policy)
    return restored
