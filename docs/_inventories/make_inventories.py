"""Write the intersphinx inventories of the jax, optax, flax and chex names the docs use.

The site links ``optax.chain``, ``lax.cond``, ``nnx.Optimizer`` ... to those libraries'
documentation (``docs/_ext/namelinks.py``, ``intersphinx_mapping`` in ``docs/conf.py``).
Intersphinx reads an inventory (``objects.inv``) per library; downloading them at build
time would make the build depend on the network, so the docs build from small inventories
kept here, one per library, that list only the names the guides and the API reference use,
with the addresses those libraries' published documentation gives them.

``python docs/_inventories/make_inventories.py`` rewrites the ``*.inv`` files from the table
below (no network). ``--check`` downloads each library's published ``objects.inv`` and
reports every name of the table whose address differs there or that it lacks (run it when a
library moves its pages; then correct the table and rewrite). To link another name, add it
to the table and rewrite; ``tests/test_docs_site.py`` checks that the files match the table.

The addresses were read from each library's documentation sources (which page's
``autosummary`` or ``autofunction`` documents the name): jax ``docs/*.rst`` (one page per
name under ``_autosummary/``), optax ``docs/api/*.rst`` (one page per name under
``api/generated/``), flax ``docs_nnx/api_reference/`` (flax.readthedocs.io is the NNX
site) and chex ``docs/api.rst``.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import urllib.request
import zlib

HERE = pathlib.Path(__file__).resolve().parent


def _per_name(page: str, names: str, role: str = "py:function") -> dict[str, tuple[str, str]]:
    """Names documented one per page: ``page.format(name=...)``, anchored at the name."""
    return {n: (role, f"{page.format(name=n)}#{n}") for n in names.split()}


# Library -> (documentation root, {name: (domain:role, address relative to the root)}).
PROJECTS: dict[str, tuple[str, dict[str, tuple[str, str]]]] = {
    "jax": (
        "https://docs.jax.dev/en/latest/",
        {
            **_per_name(
                "_autosummary/{name}.html",
                "jax.jit jax.grad jax.value_and_grad jax.vmap jax.pmap jax.shard_map "
                "jax.checkpoint jax.typeof jax.make_mesh jax.device_put "
                "jax.lax.cond jax.lax.scan jax.lax.map jax.lax.fori_loop jax.lax.while_loop "
                "jax.lax.pmean jax.lax.psum jax.lax.reduce jax.lax.bitcast_convert_type "
                "jax.numpy.where jax.numpy.mean jax.numpy.sum "
                "jax.tree.map jax.tree_util.keystr jax.tree_util.tree_leaves "
                "jax.tree_util.tree_map jax.experimental.checkify.checkify "
                "jax.distributed.initialize",
            ),
            **_per_name("_autosummary/{name}.html", "jax.Array jax.numpy.float32", "py:class"),
            **_per_name("_autosummary/{name}.html", "jax.typing.ArrayLike", "py:data"),
            **_per_name("jax.sharding.html", "jax.sharding.NamedSharding", "py:class"),
            **_per_name("jax.sharding.html", "jax.sharding.PartitionSpec", "py:class"),
            "jax.nn": ("py:module", "jax.nn.html#module-jax.nn"),
        },
    ),
    "optax": (
        "https://optax.readthedocs.io/en/latest/",
        {
            **_per_name(
                "api/generated/{name}.html",
                "optax.adam optax.adamw optax.sgd optax.chain optax.named_chain "
                "optax.partition optax.apply_if_finite optax.lookahead optax.masked "
                "optax.apply_updates optax.conditionally_transform optax.conditionally_mask "
                "optax.clip_by_global_norm optax.add_decayed_weights optax.stateless "
                "optax.with_extra_args_support optax.inject_hyperparams "
                "optax.linear_schedule optax.safe_increment",
            ),
            **_per_name(
                "api/generated/{name}.html",
                "optax.MultiSteps optax.GradientTransformation "
                "optax.GradientTransformationExtraArgs",
                "py:class",
            ),
            **_per_name(
                "api/generated/{name}.html", "optax.Params optax.OptState optax.Updates", "py:data"
            ),
            # optax keeps multi_transform as another name of partition, documented there.
            "optax.multi_transform": (
                "py:function",
                "api/generated/optax.partition.html#optax.partition",
            ),
        },
    ),
    "flax": (
        "https://flax.readthedocs.io/en/latest/",
        {
            "flax.nnx.Optimizer": (
                "py:class",
                "api_reference/flax.nnx/training/optimizer.html#flax.nnx.optimizer.Optimizer",
            ),
            **_per_name("api_reference/flax.nnx/transforms.html", "flax.nnx.jit flax.nnx.grad"),
            **_per_name(
                "api_reference/flax.nnx/variables.html",
                "flax.nnx.BatchStat flax.nnx.Param",
                "py:class",
            ),
            **_per_name(
                "api_reference/flax.training.html",
                "flax.training.train_state.TrainState",
                "py:class",
            ),
        },
    ),
    "chex": (
        "https://chex.readthedocs.io/en/latest/",
        _per_name("api.html", "chex.dataclass"),
    ),
}


def inventory(project: str) -> bytes:
    """The ``objects.inv`` (format 2) of ``project``'s names in the table."""
    _, names = PROJECTS[project]
    header = (
        "# Sphinx inventory version 2\n"
        f"# Project: {project}\n"
        "# Version: latest\n"
        "# The remainder of this file is compressed using zlib.\n"
    )
    body = "".join(f"{n} {role} 1 {uri} -\n" for n, (role, uri) in sorted(names.items()))
    return header.encode() + zlib.compress(body.encode(), 9)


def write() -> None:
    for project in PROJECTS:
        (HERE / f"{project}.inv").write_bytes(inventory(project))
        print(f"wrote {project}.inv ({len(PROJECTS[project][1])} names)")


def check() -> int:
    """Compare the table with each library's published inventory (needs the network)."""
    from sphinx.util.inventory import InventoryFile

    problems = 0
    for project, (root, names) in PROJECTS.items():
        with urllib.request.urlopen(root + "objects.inv", timeout=60) as response:
            published = InventoryFile.loads(response.read(), uri="").data
        addresses = {n: item[2] for table in published.values() for n, item in table.items()}
        for name, (_, uri) in sorted(names.items()):
            # A name the table files under another's anchor (optax.multi_transform is
            # optax.partition) is checked by that anchor.
            if uri not in (addresses.get(name), addresses.get(uri.partition("#")[2])):
                problems += 1
                print(f"{project}: {name}: table {uri}, published {addresses.get(name)}")
    print(f"{problems} difference(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="compare with the published inventories"
    )
    sys.exit(check() if parser.parse_args().check else write())
