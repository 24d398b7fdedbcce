"""The engine finds every name a function is bound to (`_bindings.bindings`), which is
what lets a hooked call reach calls made through `from x import f`: checked against a
plain scan of every loaded module, for functions that hash by identity and for those
that do not (a builtin method of an unhashable object, an unhashable callable), next to
globals that cannot be hashed or compared."""

import sys
import types

import jax
import numpy as np
import pytest

from peex_interop._engine._bindings import bindings


def plain_scan(functions):
    """(module, name) of every global of a loaded module that is one of `functions`."""
    return {
        (id(vars(module)), name)
        for module in list(sys.modules.values())
        if isinstance(getattr(module, "__dict__", None), dict)
        for name, value in list(vars(module).items())
        if any(value is function for function in functions)
    }


def found(functions):
    return {(id(vars(owner)), name) for owner, name in bindings(functions)}


class Unhashable:
    __hash__ = None  # pyright: ignore[reportAssignmentType]

    def __eq__(self, other):
        return np.ones(3) == other

    def __call__(self, x):
        return x


@pytest.fixture
def module():
    """A loaded module binding a function twice, next to values `hash` or `==` would
    trip over."""
    module = types.ModuleType("peex_interop_test_bindings_module")
    listed = [1, 2]

    def layer(x):
        return x

    module.__dict__.update(
        layer=layer, also_layer=layer, listed=listed, append=listed.append, table={"a": 1},
        array=np.arange(3), unhashable=Unhashable(), vmap=jax.vmap,
    )
    sys.modules[module.__name__] = module
    yield module
    del sys.modules[module.__name__]


@pytest.mark.parametrize("name", ["layer", "append", "unhashable", "vmap"])
def test_every_binding_of_a_function_is_found(module, name):
    function = getattr(module, name)
    expected = plain_scan([function])
    assert found([function]) == expected
    assert (id(vars(module)), name) in expected


def test_functions_of_every_kind_are_found_together(module):
    functions = [module.layer, module.append, module.unhashable, jax.vmap, jax.jit]
    assert found(functions) == plain_scan(functions)
    assert {name for owner, name in bindings(functions) if owner is module} == {
        "layer", "also_layer", "append", "unhashable", "vmap"
    }
