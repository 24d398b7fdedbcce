import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import peex_interop as px
from models import MLP, Deep
from peex_interop._engine import glob_to_regex


@pytest.mark.parametrize(
    "pattern, path, hit",
    [
        ("layers.*", "layers.0", True),
        ("layers.*", "layers.0.linear", False),
        ("layers.**", "layers.0.linear", True),
        ("**.linear", "blocks.3.attn.linear", True),
        ("**.linear", "linear", True),
        ("blocks.?.attn", "blocks.3.attn", True),
        ("blocks.?.attn", "blocks.12.attn", False),
        ("seq", "seq.layers.0", False),
    ],
)
def test_glob(pattern, path, hit):
    assert (glob_to_regex(pattern).match(path) is not None) == hit


def test_layer_names_where_types_and_predicates():
    model = Deep(key=jax.random.key(0))
    x = jnp.ones(3)

    def keys(**kw):
        return set(px.ForwardHook(model, log_fn=px.MeanLog(), **kw)(x)[1])

    assert keys(layer_names=["out", "layers.1"]) == {"out", "layers.1"}
    assert keys(where="seq.layers.*") == {"seq.layers.0", "seq.layers.1", "seq.layers.2"}
    assert keys(where=eqx.nn.Lambda) == {"seq.layers.1"}
    assert keys(where=lambda path, m: path.startswith("layers")) == {"layers.0", "layers.1"}
    assert keys(where=["out", eqx.nn.Sequential]) == {"out", "seq"}
    assert keys(layer_names=["out", "seq"], where=eqx.nn.Linear) == {"out"}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(layer_names=["linear3"]), "closest available paths: linear2, linear1"),
        (dict(where="linaer1"), "'linaer1' matches no layer of MLP"),
        (dict(where=eqx.nn.Conv2d), "Conv2d matches no layer of MLP"),
        (dict(where=["linear1", 3]), "where= takes glob patterns .*; got 3"),
    ],
)
def test_names_matching_nothing_raise_with_closest_paths(kwargs, message):
    model = MLP(2, 3, 1, key=jax.random.key(0))
    with pytest.raises(px.HookError, match=message):
        px.ForwardHook(model, **kwargs)
    with pytest.raises(px.HookError, match=message):
        px.BackwardHook(model, **kwargs)


def test_a_criterion_of_no_kind_is_refused_at_construction_whatever_the_model():
    # Also for models whose layers are only known during the call (nothing to check them against).
    def dense(params, x):
        return x @ params["w"]

    model = px.from_function(dense, {"w": jnp.ones((2, 2))}, layers=[dense])
    with pytest.raises(px.HookError, match=r"where= takes .*; got 3\.5"):
        px.ForwardHook(model, where=["dense", 3.5])


def test_every_builtin_pool_and_activation_has_its_kind():
    class Net(eqx.Module):
        pool: eqx.nn.MaxPool2d
        adaptive: eqx.nn.AdaptiveAvgPool2d
        act: eqx.nn.PReLU

        def __call__(self, x):
            return self.act(self.adaptive(self.pool(x)))

    model, x = Net(eqx.nn.MaxPool2d(2, 2), eqx.nn.AdaptiveAvgPool2d((2, 2)), eqx.nn.PReLU()), jnp.ones((1, 8, 8))
    log = px.ForwardHook(model, log_fn=px.IdentityLog(), where=px.kind("pool"))(x)[1]
    assert set(log) == {"pool", "adaptive"}
    assert jnp.array_equal(log["adaptive"], model.adaptive(model.pool(x)))
    assert set(px.ForwardHook(model, log_fn=px.IdentityLog(), where=px.kind("activation"))(x)[1]) == {"act"}
