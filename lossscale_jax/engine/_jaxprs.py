"""JAX's jaxpr types, under every JAX the package admits.

A closed jaxpr is a jaxpr with its constants. Up to JAX 0.11 it is its own class,
``jax.extend.core.ClosedJaxpr``, around an open ``Jaxpr``; JAX 0.12 makes ``Jaxpr`` carry its
constants and keeps ``ClosedJaxpr`` as another name of ``Jaxpr`` (with the old accessors:
``.jaxpr``, ``.consts``, ``ClosedJaxpr(jaxpr, consts)``), in a form that type checkers do not
see as exported. Read from the module, the name type-checks and runs under both.
"""

from __future__ import annotations

from typing import Any

import jax.extend.core as jcore

ClosedJaxpr: Any = vars(jcore)["ClosedJaxpr"]
