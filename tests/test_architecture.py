"""The package's layout rules (docs/architecture.md), read from its source.

- no module over 450 lines (the aim is about 400), no function over 120 lines (its docstring
  aside);
- no import cycle between the package's modules;
- no private name of a public module imported by another module (internals live in
  underscore modules);
- the package is a handful of folders by topic and its public entry modules; imports run one
  way between them (``ORDER``, engine at the bottom, compat at the top), and each folder's
  ``__init__`` docstring says what its modules hold and what it may import;
- every public module path and name of before the folders still imports;
- the Flax, Orbax, matplotlib and Equinox imports sit only in the modules that need them,
  and ``import lossscale_jax`` loads none of them (tests/test_seams.py runs it; Equinox
  loads with ``lsj.compat.mpx`` only, tests/test_compat_mpx_dropin.py).
"""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "lossscale_jax"
MAX_LINES = 450
MAX_FUNCTION_LINES = 120


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_private(module: str) -> bool:
    return module.split(".")[-1].startswith("_")


def _imports(name: str) -> list[tuple[str, str | None]]:
    """``(module, imported name or None)`` for every package import in ``name``'s source."""
    tree = ast.parse(MODULES[name].read_text())
    found: list[tuple[str, str | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, None) for a in node.names if a.name.startswith("lossscale_jax")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith("lossscale_jax"):
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    found.append((sub, None) if sub in MODULES else (node.module, a.name))
    return found


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_is_small(name):
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{name} has {lines} lines"


def _function_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """A function's lines from its ``def`` to its end, its docstring left out."""
    lines = node.end_lineno - node.lineno + 1  # pyright: ignore[reportOptionalOperand]
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        if isinstance(first.value.value, str):
            lines -= first.end_lineno - first.lineno + 1  # pyright: ignore[reportOptionalOperand]
    return lines


@pytest.mark.parametrize("name", sorted(MODULES))
def test_functions_are_short(name):
    long = [
        f"{node.name} (line {node.lineno}): {_function_lines(node)} lines"
        for node in ast.walk(ast.parse(MODULES[name].read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and _function_lines(node) > MAX_FUNCTION_LINES
    ]
    assert not long, f"{name}: {long}"


def test_no_import_cycle():
    graph = {m: {t for t, _ in _imports(m) if t in MODULES and t != m} for m in MODULES}
    # Each package imports its own submodules in __init__: that edge is not a cycle of code.
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in graph[m]:
            if t.startswith(m + "."):
                continue
            if state.get(t) == 1:
                raise AssertionError(f"import cycle: {' -> '.join([*path, m, t])}")
            if t not in state:
                visit(t, [*path, m])
        state[m] = 2

    for m in MODULES:
        if m not in state:
            visit(m, [])


def test_no_private_name_of_a_public_module_is_imported():
    crossing = [
        f"{m} <- {target}.{name}"
        for m in MODULES
        for target, name in _imports(m)
        if name is not None
        and name.startswith("_")
        and not name.startswith("__")
        and not _is_private(target)
    ]
    assert not crossing, crossing


# The parts of the package from the bottom up (docs/architecture.md): a folder, or a module
# beside the package's __init__. A part may import its own modules, errors.py and the parts
# on the floors below it; the front-end modules on one floor may import each other (the
# cycle test above keeps that acyclic). The package's own __init__ sits on top of them all.
ORDER: list[set[str]] = [
    {"errors"},
    {"engine"},
    {"policies"},
    {"taps"},
    {"access"},
    {
        "numerics",
        "stuck",
        "testing",
        "transform",
        "accumulation",
        "fused",
        "gradients",
        "master",
        "flax_utils",
    },
    {"layerwise"},
    {"diagnosis"},
    {"checkpoint"},
    {"compat"},
    {"presets"},
    {"integrations"},
]
FOLDERS = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())


def _part(module: str) -> str:
    return module.split(".")[1] if module != PACKAGE.name else PACKAGE.name


def _floor(part: str) -> int:
    if part == PACKAGE.name:
        return len(ORDER)
    return next(i for i, parts in enumerate(ORDER) if part in parts)


def test_every_part_of_the_package_has_a_floor():
    parts = {_part(m) for m in MODULES} - {PACKAGE.name}
    assert parts == set().union(*ORDER), parts ^ set().union(*ORDER)


def test_the_folders_are_the_parts_by_topic():
    # What a newcomer listing lossscale_jax/ sees: the folders, and the public entry modules.
    assert FOLDERS == sorted(
        [
            "access",
            "checkpoint",
            "compat",
            "diagnosis",
            "engine",
            "integrations",
            "layerwise",
            "policies",
            "taps",
        ]
    )
    loose = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert all(not n.startswith("_") or n == "__init__.py" for n in loose), loose


def test_imports_run_one_way_between_the_parts():
    upward = []
    for m in MODULES:
        own = _part(m)
        for target, _ in _imports(m):
            if target not in MODULES:
                target = target.rsplit(".", 1)[0]
            there = _part(target)
            if there in (own, "errors"):
                continue
            if _floor(there) > _floor(own) or (_floor(there) == _floor(own) and there in FOLDERS):
                upward.append(f"{m} -> {target}")
    assert not upward, upward


def _may_import(folder: str) -> str:
    doc = ast.get_docstring(ast.parse((PACKAGE / folder / "__init__.py").read_text())) or ""
    assert "May import:" in doc, f"{folder}/__init__.py does not say what it may import"
    return doc.split("May import:", 1)[1].split("\n\n", 1)[0]


@pytest.mark.parametrize("folder", FOLDERS)
def test_each_folder_says_what_it_holds_and_what_it_may_import(folder):
    doc = ast.get_docstring(ast.parse((PACKAGE / folder / "__init__.py").read_text())) or ""
    modules = sorted(p.stem for p in (PACKAGE / folder).glob("_*.py") if p.stem != "__init__")
    unnamed = [n for n in modules if f"``{n}``" not in doc]
    assert not unnamed, f"{folder}/__init__.py does not say what {unnamed} hold"
    # Every part the folder imports is named where the docstring says what it may import.
    may = _may_import(folder)
    imported = {
        _part(t if t in MODULES else t.rsplit(".", 1)[0])
        for m in MODULES
        if _part(m) == folder
        for t, _ in _imports(m)
    } - {folder, "errors", PACKAGE.name}
    front_ends = ORDER[5]
    unnamed = [
        p
        for p in sorted(imported)
        if f"``{p}``" not in may
        and f"lossscale_jax.{p}``" not in may
        and not (p in front_ends and "the front-end modules" in may)
        and "everything else in the package" not in may
    ]
    assert not unnamed, f"{folder}/__init__.py imports {unnamed} without saying it may"


@pytest.mark.parametrize(
    "package,allowed",
    [
        (
            "flax",
            {
                "lossscale_jax.flax_utils",
                "lossscale_jax.checkpoint._checkpoint",
                "lossscale_jax.integrations.tunix",
                "lossscale_jax.integrations.tunix._models",
                "lossscale_jax.integrations.tunix._step",
                "lossscale_jax.integrations.tunix._mismatch",
                "lossscale_jax.integrations.tunix._maxtext",
                "lossscale_jax.integrations._host._dtype",
                "lossscale_jax.integrations.easydel",
                "lossscale_jax.integrations.tunix._optimizer",
                "lossscale_jax.integrations.tunix._accumulating_step",
            },
        ),
        (
            "orbax",
            {
                "lossscale_jax.checkpoint._checkpoint",
                "lossscale_jax.integrations.tunix._checkpoint",
            },
        ),
        ("matplotlib", {"lossscale_jax.diagnosis._plot"}),
        (
            "easydel",
            {"lossscale_jax.integrations.easydel", "lossscale_jax.integrations.easydel._sampling"},
        ),
        (
            "tunix",
            {
                "lossscale_jax.integrations.tunix",
                "lossscale_jax.integrations.tunix._checkpoint",
                "lossscale_jax.integrations.tunix._mismatch",
                "lossscale_jax.integrations.tunix._accumulating_step",
            },
        ),
        (
            "equinox",
            {
                "lossscale_jax.compat.mpx",
                "lossscale_jax.compat._mpx_cast",
                "lossscale_jax.compat._mpx_grad",
                "lossscale_jax.compat._mpx_scale",
            },
        ),
        ("mpx", set()),  # compat.mpx reproduces it; the package never imports it
    ],
)
def test_optional_packages_are_imported_only_where_needed(package, allowed):
    users = set()
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                hits = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                hits = [node.module or ""]
            else:
                continue
            if any(h == package or h.startswith(package + ".") for h in hits):
                users.add(name)
    assert users <= allowed, sorted(users - allowed)


# Every public module path of the package and every name it exported before the package was
# laid out in folders by topic (its ``__all__``, the names its own source defined without a
# leading underscore, and the names the docs and the package took from it), generated from the
# code as it stood before the move: each path still imports and each name still resolves there.
NAMES_BEFORE_THE_SPLIT = {
    "lossscale_jax": [
        "Diagnosis",
        "DynamicScale",
        "HeadroomScale",
        "LeafDiagnosis",
        "LossScaleOptimizer",
        "LossScalePolicy",
        "LossScaleState",
        "LossScalingMultiStepsState",
        "LossScalingState",
        "NoScale",
        "StaticScale",
        "TapDiagnosis",
        "TapStats",
        "TolerantDynamicScale",
        "TrainState",
        "__version__",
        "apply_gradients",
        "check_checkpoint",
        "check_overflow",
        "check_overflow_and_range",
        "compat",
        "diagnose",
        "errors",
        "get_loss_scale_state",
        "keep_policy_state",
        "layerwise",
        "layerwise_scaling",
        "loss_scaling",
        "loss_scaling_multi_steps",
        "metrics",
        "overflowed_leaves",
        "reduce_overflow",
        "restore_flax",
        "restore_orbax",
        "scale_loss",
        "set_loss_scale_state",
        "switch_policy",
        "tap",
        "taps",
        "testing",
        "unscale",
        "unscale_and_check",
    ],
    "lossscale_jax.accumulation": ["LossScalingMultiStepsState", "loss_scaling_multi_steps"],
    "lossscale_jax.checkpoint": ["check_checkpoint", "restore_flax", "restore_orbax"],
    "lossscale_jax.compat": [
        "apex",
        "colossalai",
        "cstorch",
        "deepspeed",
        "fairseq",
        "flax",
        "jmp",
        "keras",
        "megatron",
        "metaseq",
        "mindspore",
        "mpx",
        "npu",
        "paddle",
        "torch",
    ],
    "lossscale_jax.compat.apex": ["LossScaler", "update_scale_hysteresis"],
    "lossscale_jax.compat.colossalai": ["DynamicGradScaler", "export_state", "import_state"],
    "lossscale_jax.compat.cstorch": ["GradScaler", "optimizer_step"],
    "lossscale_jax.compat.deepspeed": [
        "DynamicLossScaler",
        "FP16_Optimizer",
        "FP16_UnfusedOptimizer",
        "export_fp16_optimizer_state",
        "export_state",
        "fp16_optimizer_policy",
        "import_fp16_optimizer_state",
        "import_state",
    ],
    "lossscale_jax.compat.fairseq": ["DynamicLossScaler", "export_state", "import_state"],
    "lossscale_jax.compat.flax": [
        "DynamicScale",
        "DynamicScaleResult",
        "dynamic_scale_policy",
        "export_state",
        "import_state",
    ],
    "lossscale_jax.compat.jmp": [
        "DynamicLossScale",
        "NoOpLossScale",
        "Policy",
        "StaticLossScale",
        "all_finite",
        "cast_to_full",
        "cast_to_half",
        "dynamic_loss_scale_policy",
        "export_state",
        "get_policy",
        "half_dtype",
        "import_state",
        "no_op_loss_scale_policy",
        "select_tree",
        "static_loss_scale_policy",
    ],
    "lossscale_jax.compat.keras": ["LossScaleOptimizer", "export_state", "import_state", "policy"],
    "lossscale_jax.compat.megatron": [
        "ConstantGradScaler",
        "DynamicGradScaler",
        "export_state",
        "import_state",
    ],
    "lossscale_jax.compat.metaseq": ["DynamicLossScaler", "export_state", "import_state"],
    "lossscale_jax.compat.mindspore": ["DynamicLossScaleManager", "FixedLossScaleManager"],
    "lossscale_jax.compat.mpx": [
        "BFLOAT16_MAX",
        "DynamicLossScaling",
        "FLOAT16_MAX",
        "all_finite",
        "calculate_scaled_grad",
        "cast_function",
        "cast_to_bfloat16",
        "cast_to_float16",
        "cast_to_float32",
        "cast_to_full_precision",
        "cast_to_half_precision",
        "cast_tree",
        "dynamic_loss_scaling_policy",
        "export_state",
        "filter_grad",
        "filter_value_and_grad",
        "force_full_precision",
        "half_precision_datatype",
        "import_state",
        "optimizer_update",
        "scaled",
        "select_tree",
        "set_half_precision_datatype",
    ],
    "lossscale_jax.compat.npu": [
        "ExponentialUpdateLossScaleManager",
        "FixedLossScaleManager",
        "NPULossScaleOptimizer",
    ],
    "lossscale_jax.compat.paddle": [
        "GradScaler",
        "export_state",
        "import_state",
        "update_loss_scaling",
    ],
    "lossscale_jax.compat.torch": ["GradScaler", "export_state", "import_state", "multi_optimizer"],
    "lossscale_jax.diagnosis": [
        "Diagnosis",
        "LOG2_MAX",
        "LOG2_MIN",
        "LeafDiagnosis",
        "NOISE",
        "NO_SCALING",
        "OVERFLOWS",
        "SCALE_NEEDED",
        "SUBNORMAL_BINADES",
        "TapDiagnosis",
        "UNDERFLOWS",
        "diagnose",
    ],
    "lossscale_jax.errors": [
        "AxisError",
        "CheckpointError",
        "CheckpointPolicyError",
        "CheckpointVersionError",
        "LossScalingError",
        "NestingError",
        "NotAPolicyError",
        "StateNotFoundError",
        "StructureError",
        "TapError",
    ],
    "lossscale_jax.flax_utils": ["FUSED_STATES", "LossScaleOptimizer", "TrainState"],
    "lossscale_jax.fused": ["apply_gradients"],
    "lossscale_jax.layerwise": [
        "LayerMap",
        "LayerScales",
        "LayerWindow",
        "LayerwiseScalingState",
        "discover",
        "factors",
        "layer_metrics",
        "layerwise_scaling",
        "value_and_grad",
    ],
    "lossscale_jax.numerics": [
        "COMPUTE_DTYPES",
        "OVERFLOW_MODES",
        "OverflowMode",
        "at_least_float32",
        "check_overflow",
        "check_overflow_and_range",
        "overflow_flags",
        "unscale",
        "unscale_and_check",
        "validate_compute_dtype",
        "validate_overflow_mode",
    ],
    "lossscale_jax.policies": [
        "DynamicScale",
        "HeadroomScale",
        "LossScalePolicy",
        "LossScaleState",
        "NoScale",
        "RECENT_STEPS",
        "StaticScale",
        "TolerantDynamicScale",
        "initial_state",
    ],
    "lossscale_jax.stuck": ["ON_STUCK", "STUCK_MESSAGE", "check_stuck", "validate_on_stuck"],
    "lossscale_jax.taps": ["Modules", "TapStats", "discover", "recording", "tap", "value_and_grad"],
    "lossscale_jax.testing": ["saturate", "saturating"],
    "lossscale_jax.transform": [
        "ATTRIBUTIONS",
        "AxisName",
        "LossScalingState",
        "get_loss_scale_state",
        "loss_scaling",
        "metrics",
        "overflowed_leaves",
        "reduce_overflow",
        "scale_loss",
        "set_loss_scale_state",
        "switch_policy",
        "validate_attribution",
    ],
}


@pytest.mark.parametrize("module", sorted(NAMES_BEFORE_THE_SPLIT))
def test_public_names_are_where_they_were(module):
    mod = importlib.import_module(module)
    missing = [n for n in NAMES_BEFORE_THE_SPLIT[module] if not hasattr(mod, n)]
    assert not missing, f"{module} lost {missing}"


def test_dir_of_the_package_shows_its_public_names_and_modules():
    import lossscale_jax

    shown = set(dir(lossscale_jax))
    assert set(lossscale_jax.__all__) <= shown
    # no import the package's __init__ made for itself, no internals
    assert not shown & {"Any", "TYPE_CHECKING", "annotations", "importlib", "engine"}, shown
    extra = {n for n in shown - set(lossscale_jax.__all__)}
    assert all(f"lossscale_jax.{n}" in MODULES for n in extra), extra
