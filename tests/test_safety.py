"""Scoped patching, thread isolation, no mutation, and clear errors."""


import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import peex_interop as px
from models import MLP, while_hooked_elsewhere
from peex_interop._engine import _patching, _transforms


class Inherited(eqx.nn.Linear):
    """Inherits `__call__`: hooking it must leave no attribute of its own behind."""


class WithInherited(eqx.Module):
    mlp: MLP
    inherited: Inherited

    def __call__(self, x):
        return self.inherited(self.mlp(x))


# Taken at import, before any hooked call: the attributes every hooked call must restore.
OWN_CALLS = {cls: vars(cls).get("__call__") for cls in (eqx.nn.Linear, MLP, Inherited, WithInherited)}
JAX_FUNCTIONS = {(owner, name): _patching.current(owner, name) for owner, name, _ in _transforms.transform_patches()}
assert {(jax.vmap, _patching.WRAPPED_FUNCTION), (jax.lax.scan, _patching.WRAPPED_FUNCTION)} <= set(JAX_FUNCTIONS)


def assert_unpatched():
    for cls, original in OWN_CALLS.items():
        assert vars(cls).get("__call__") is original, cls
    for (owner, name), original in JAX_FUNCTIONS.items():
        assert _patching.current(owner, name) == original, name


def model_and_input():
    return MLP(3, 4, 2, key=jax.random.key(0)), jnp.linspace(-1.0, 1.0, 3)


def test_patches_are_undone_after_success_and_exceptions():
    model, x = model_and_input()
    px.ForwardHook(model, log_fn=px.IdentityLog())(x)
    assert_unpatched()

    def boom(_):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom") as info:
        px.ForwardHook(model, log_fn=boom)(x)
    assert any("layer 'linear1'" in note for note in info.value.__notes__)
    assert_unpatched()
    with pytest.raises(RuntimeError):
        eqx.filter_jit(lambda h, x: h(x))(px.ForwardHook(model, hook_fn=boom), x)
    assert_unpatched()


def test_inherited_call_gets_no_own_attribute_after_success_or_exception():
    keys = jax.random.split(jax.random.key(0), 2)
    model = WithInherited(MLP(3, 4, 2, key=keys[0]), Inherited(2, 2, key=keys[1]))
    x = jnp.linspace(-1.0, 1.0, 3)
    during = []

    def record_patch(y):
        # Seen from inside the call: the subclass is patched with an attribute of its own,
        # so the check after the call tests a real removal.
        during.append("__call__" in vars(Inherited))
        return y

    _, log = px.ForwardHook(model, log_fn=record_patch, where="inherited")(x)
    assert during == [True]
    np.testing.assert_allclose(log["inherited"], model(x), rtol=1e-6)
    assert_unpatched()

    def boom(_):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        px.ForwardHook(model, log_fn=boom, where="inherited")(x)
    assert_unpatched()


def test_user_model_is_not_mutated():
    model, x = model_and_input()
    before = jax.tree.leaves(model)
    copies = [np.asarray(leaf) for leaf in before]
    hooked = px.ForwardHook(model, hook_fn=lambda y: y * 0, log_fn=px.IdentityLog())
    hooked(x)
    after = jax.tree.leaves(model)
    assert all(a is b for a, b in zip(before, after))
    for leaf, copy in zip(after, copies):
        np.testing.assert_array_equal(leaf, copy)
    np.testing.assert_allclose(model(x), MLP(3, 4, 2, key=jax.random.key(0))(x))


def test_concurrent_threads_do_not_see_each_others_hooks():
    model, x = model_and_input()
    # While the other thread sits inside its hooked call (classes patched), this
    # thread's plain and differently hooked calls see nothing of it.
    (hooked_out, hooked_log), (plain, (other_out, other_log)) = while_hooked_elsewhere(
        lambda pause: px.ForwardHook(model, hook_fn=lambda y: 10 * y, log_fn=pause)(x),
        lambda: (model(x), px.ForwardHook(model, log_fn=px.MeanLog())(x)),
    )
    np.testing.assert_allclose(plain, MLP(3, 4, 2, key=jax.random.key(0))(x))
    np.testing.assert_allclose(other_out, plain)
    assert set(other_log) == {"linear1", "linear2"}
    np.testing.assert_allclose(other_log["linear1"], jnp.mean(model.linear1(x)), rtol=1e-6)
    h1 = 10 * model.linear1(x)
    np.testing.assert_allclose(hooked_out, 10 * model.linear2(jax.nn.relu(h1)), rtol=1e-5)
    assert_unpatched()


def test_hook_changing_shape_names_layer_expected_and_got():
    model, x = model_and_input()
    with pytest.raises(px.HookError, match=r"hook_fn at layer 'linear1'.*expected float32\[4\], got float32\[5\]"):
        px.ForwardHook(model, hook_fn=lambda y: jnp.concatenate([y, y[:1]]) if y.shape == (4,) else y)(x)
    with pytest.raises(px.HookError, match=r"layer 'linear2'.*expected float32\[2\], got int32\[2\]"):
        px.ForwardHook(model, hook_fn=lambda y: y.astype(jnp.int32), where="linear2")(x)

    @eqx.filter_grad
    def grad(hooked, x):
        return jnp.sum(hooked(x))

    with pytest.raises(px.HookError, match=r"hook_fn \(backward\) at layer 'linear1'"):
        grad(px.BackwardHook(model, hook_fn=lambda ct: ct[:1], where="linear1").init(x), x)


def test_non_module_model_gets_a_hint():
    with pytest.raises(TypeError, match=r"wraps an equinox.Module.*eqx.nn.Lambda"):
        px.ForwardHook(lambda x: x)
    with pytest.raises(TypeError, match=r"equinox\.Module"):
        px.BackwardHook({"w": jnp.ones(2)})


def test_backward_without_init_is_an_error_not_a_silent_drop():
    model, x = model_and_input()
    with pytest.raises(px.HookError, match=r"no cotangent slot for layer 'linear1'.*init"):
        jax.grad(lambda h: jnp.sum(h(x)))(px.BackwardHook(model, log_fn=px.IdentityLog()))


def test_plain_callables_are_wrapped_as_modules():
    model, x = model_and_input()
    hooked = px.ForwardHook(model, hook_fn=lambda y: y + 1.0, log_fn=jnp.max)
    assert isinstance(hooked.hook_fn, px.FunctionHook) and isinstance(hooked.log_fn, px.FunctionLog)
    out, log = eqx.filter_jit(lambda h, x: h(x))(hooked, x)
    h1 = model.linear1(x) + 1.0
    np.testing.assert_allclose(log["linear1"], jnp.max(h1), rtol=1e-6)
    np.testing.assert_allclose(out, model.linear2(jax.nn.relu(h1)) + 1.0, rtol=1e-6)
