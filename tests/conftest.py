"""Test configuration: 8 fake CPU devices for multi-device tests.

The device count must be set before JAX initialises its backend, which is why it lives
here. Strict dtype promotion is not global (optax's Adam is not strict-clean); the
library's own code is checked under ``jax.numpy_dtype_promotion("strict")`` in its tests.
"""

import os
import shutil
import tempfile

# The CPU suite by default (make test). make test-gpu sets JAX_PLATFORMS=cuda,cpu: the
# accelerator is JAX's default backend, the CPU platform stays beside it.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

# LSJ_TEST_CPU_DEVICES=1 rehearses on CPU what a one-GPU machine's run skips (the
# multidevice marker below).
jax.config.update("jax_num_cpu_devices", int(os.environ.get("LSJ_TEST_CPU_DEVICES", "8")))
# float32 references are float32: a GPU's default matmul precision is TF32 (10 bits), which
# put the taps' references 5e-5 off there. No effect on CPU.
jax.config.update("jax_default_matmul_precision", "highest")

# One XLA compilation cache for the processes of a run (the xdist workers inherit the
# folder the first process makes): a program compiled again, by another module or on the
# other worker, is read back instead. Removed when the run ends.
_CACHE_OWNER = "LSJ_TEST_COMPILATION_CACHE" not in os.environ
if _CACHE_OWNER:
    os.environ["LSJ_TEST_COMPILATION_CACHE"] = tempfile.mkdtemp(prefix="lsj-test-xla-cache-")
_CACHE = os.environ["LSJ_TEST_COMPILATION_CACHE"]
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_runtest_setup(item):
    """``@pytest.mark.multidevice(n)``: skipped, with the reason, where JAX's default backend
    has fewer than ``n`` devices (a one-GPU machine); the CPU suite has 8 (above)."""
    marker = item.get_closest_marker("multidevice")
    if marker is not None:
        need = marker.args[0] if marker.args else 8
        have = jax.device_count()
        if have < need:
            pytest.skip(
                f"needs {need} devices of the default backend ({jax.default_backend()}), "
                f"this run has {have}; make test runs it on 8 CPU devices"
            )


@pytest.fixture
def platform_formulation():
    """Steps traced in the test take the default backend's own skip formulation (XLA:CPU's
    conditional, XLA:GPU's select), whatever LOSSSCALE_JAX_SKIP forces: for tests of the
    program that backend runs (its temporaries, its kernels). The override is part of JAX's
    trace-cache key, so nothing traced under another formulation is reused."""
    from lossscale_jax.engine import _skip

    platform = {"gpu": "cuda"}.get(jax.default_backend(), jax.default_backend())
    with _skip.formulation(_skip.BY_PLATFORM.get(platform, "cond")):
        yield


def pytest_unconfigure(config):
    if _CACHE_OWNER:
        shutil.rmtree(_CACHE, ignore_errors=True)


from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.load_profile("ci")

# The longest modules first (test time under LOSSSCALE_JAX_SKIP=select, Python 3.13, 2 workers
# on 2 cores, at the time of writing; an example's includes its module fixture's run): with
# ``--dist loadscope --no-loadscope-reorder`` (the Makefile's) xdist hands modules to the
# workers in this order, so the long ones start early and the short ones fill the tail
# (xdist's own reordering, by number of tests, sent the few-test example jobs last). The
# SPREAD modules below come after the four longest others: under ``--dist loadgroup`` each of
# their tests is a unit of its own, and that many units ahead of the examples would start
# those late. A module missing here only runs later; the order changes no test's outcome.
LONGEST_FIRST = (
    "test_performance.py",  # 166 s
    "test_train_gpt.py",  # 96 s
    "test_train_rl.py",  # 92 s
    "test_train_digits.py",  # 66 s
    "test_engine_properties.py",  # 190 s
    "test_docs.py",  # 108 s
    "test_composition.py",  # 56 s
    "test_data_parallel.py",  # 45 s
    "test_train_layerwise.py",  # 41 s
    "test_diagnosis.py",  # 41 s
    "test_reliability_soak.py",  # 39 s
    "test_compat.py",  # 36 s
    "test_headroom.py",  # 33 s
    "test_compat_flax_dropin.py",  # 32 s
    "test_layerwise.py",  # 32 s
    "test_taps.py",  # 31 s
    "test_docs_site.py",  # 29 s
    "test_compat_mpx_dropin.py",  # 26 s
    "test_flax.py",  # 25 s
    "test_attribution.py",  # 23 s
    "test_core_policies.py",  # 20 s
    "test_saturation.py",  # 20 s
    "test_train_equinox.py",  # 19 s
    "test_equinox.py",  # 17 s
    "test_upstream_torch.py",  # 16 s
    "test_reliability_accumulation.py",  # 15 s
    "test_reliability_properties.py",  # 14 s
    "test_core_numerics.py",  # 14 s
    "test_core_transform.py",  # 13 s
    "test_reliability_checkpoint.py",  # 13 s
    "test_doctests.py",  # 12 s
    "test_compat_checkpoints.py",  # 12 s
    "test_upstream_apex.py",  # 12 s
    "test_seams.py",  # 12 s
    "test_compat_torch_world.py",  # 11 s
    "test_skip.py",  # 11 s
)


# Modules whose tests share nothing costly (no module fixture; each cell compiles its own
# step), which alone outlast the rest of a run on many workers: `make test-gpu` (``--dist
# loadgroup``) spreads their tests over the workers, and keeps every other module on one
# worker, as ``--dist loadscope`` does (the group marks below; loadscope ignores them).
SPREAD = ("test_docs.py", "test_engine_properties.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order kept
    for item in items:
        if item.path.name not in SPREAD:
            item.add_marker(pytest.mark.xdist_group(item.path.name))
