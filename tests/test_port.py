"""`px.port`: align, transfer and verify in one call (issue 23). Ports from linen, Haiku
and Equinox into NNX (an abstract destination too) and back into Equinox compute what
the source's own library computes; a broken port (a wrong activation, a permuted
layer, a wrong output, a different backward pass) is refused naming where it breaks;
nothing the user passed is modified."""

import pytest

pytest.importorskip("haiku")  # skipped where the [haiku] extra is not installed
pytest.importorskip("flax")  # skipped where the [flax] extra is not installed

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import peex_interop as px

X = jnp.asarray(np.random.default_rng(0).normal(size=(2, 4)), jnp.float32)


class NnxMLP(nnx.Module):
    """The port: Linear 4 -> 8, an activation, LayerNorm, Linear 8 -> 3, and what it
    does to its output; `reverse` feeds the first layer its inputs reversed (as if its
    kernel's rows were permuted)."""

    def __init__(self, rngs, epsilon=1e-5, activation=jax.nn.relu, final=None, reverse=False, detach=False):
        self.hidden = nnx.Linear(4, 8, rngs=rngs)
        self.norm = nnx.LayerNorm(8, epsilon=epsilon, rngs=rngs)
        self.out = nnx.Linear(8, 3, rngs=rngs)
        self.activation, self.final, self.reverse, self.detach = activation, final, reverse, detach

    def __call__(self, x):
        h = self.activation(self.hidden(x[..., ::-1] if self.reverse else x))
        # `detach`: the same values, and a backward pass that skips the norm.
        h = h + jax.lax.stop_gradient(self.norm(h) - h) if self.detach else self.norm(h)
        y = self.out(h)
        return y if self.final is None else self.final(y)


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = jax.nn.relu(nn.Dense(8)(x))  # built in call order: Dense_0 is this one
        return nn.Dense(3)(nn.LayerNorm()(h))


def haiku_mlp(x):
    return hk.Linear(3)(hk.LayerNorm(-1, True, True)(jax.nn.relu(hk.Linear(8)(x))))


class EqxMLP(eqx.Module):
    hidden: eqx.nn.Linear
    norm: eqx.nn.LayerNorm
    out: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.hidden, self.norm, self.out = eqx.nn.Linear(4, 8, key=k1), eqx.nn.LayerNorm(8), eqx.nn.Linear(8, 3, key=k2)

    def __call__(self, x):
        return jax.vmap(lambda x: self.out(self.norm(jax.nn.relu(self.hidden(x)))))(x)


def copied(tree):
    return jax.tree.map(np.array, tree)


def assert_same(a, b):
    jax.tree.map(np.testing.assert_array_equal, a, b)


def nnx_arrays(module):
    return copied(nnx.state(module))


@pytest.fixture(scope="module")
def eqx_source():
    return EqxMLP(jax.random.key(0))


def test_linen_to_abstract_nnx():
    variables = LinenMLP().init(jax.random.key(1), X)
    kept = copied(variables)
    abstract = nnx.eval_shape(lambda: NnxMLP(nnx.Rngs(0), epsilon=1e-6))
    ported, comparison = px.port(px.from_linen(LinenMLP(), variables), px.from_nnx(abstract), X)
    np.testing.assert_allclose(ported(X), LinenMLP().apply(variables, X), atol=1e-6)
    rows = [(row.path_a, row.path_b) for row in comparison.rows]
    assert rows == [("Dense_0", "hidden"), ("LayerNorm_0", "norm"), ("Dense_1", "out"), ("(output)", "(output)")]
    assert comparison.first_divergence is None
    assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(nnx.state(abstract)))
    assert_same(variables, kept)


def test_haiku_to_nnx():
    transformed = hk.without_apply_rng(hk.transform(haiku_mlp))
    params = transformed.init(jax.random.key(2), X)
    kept = copied(params)
    destination = NnxMLP(nnx.Rngs(3))
    before = nnx_arrays(destination)
    ported, _ = px.port(px.from_haiku(transformed, params), px.from_nnx(destination), X)
    np.testing.assert_allclose(ported(X), transformed.apply(params, X), atol=1e-6)
    assert_same(params, kept)
    assert_same(nnx_arrays(destination), before)


def test_equinox_to_nnx_and_back_with_cotangents(eqx_source):
    kept = copied(eqx.filter(eqx_source, eqx.is_array))
    to_nnx, comparison = px.port(eqx_source, px.from_nnx(NnxMLP(nnx.Rngs(4))), X, cotangents=True)
    assert all(row.cotangent_max_abs is not None for row in comparison.rows)
    # Back into an abstract Equinox model: filled, never initialised.
    back, _ = px.port(to_nnx, eqx.filter_eval_shape(EqxMLP, jax.random.key(5)), X)
    # Independently of the hooks: the same outputs, and the same gradients of a loss.
    loss = lambda model, x: jnp.sum(jnp.sin(model(x)))
    for model in (to_nnx, back):
        np.testing.assert_allclose(model(X), eqx_source(X), atol=1e-6)
        np.testing.assert_allclose(jax.grad(loss, argnums=1)(model, X), jax.grad(loss, argnums=1)(eqx_source, X),
                                   atol=1e-6)
    assert_same(eqx.filter(eqx_source, eqx.is_array), kept)


def _hidden_output(model, x):
    """The source's first layer's output, computed by hand."""
    return x @ model.hidden.weight.T + model.hidden.bias


@pytest.mark.parametrize(
    ("broken", "layer", "expected"),
    [
        # gelu where the source has relu: the norm after it is the first layer to differ.
        (dict(activation=jax.nn.gelu), "norm",
         lambda m, x: jax.vmap(m.norm)(jax.nn.relu(_hidden_output(m, x))) - jax.vmap(m.norm)(
             jax.nn.gelu(_hidden_output(m, x)))),
        (dict(reverse=True), "hidden", lambda m, x: _hidden_output(m, x) - _hidden_output(m, x[:, ::-1])),
        # After the last layer: only the comparison of the outputs sees it.
        (dict(final=jnp.tanh), "(output)", lambda m, x: m(x) - jnp.tanh(m(x))),
    ],
    ids=["activation", "permuted", "output"],
)
def test_a_broken_port_is_refused_naming_where(eqx_source, broken, layer, expected):
    destination = px.from_nnx(NnxMLP(nnx.Rngs(6), **broken))
    before = copied(destination)
    with pytest.raises(px.PortError, match=f"{layer!r}|in the models' outputs") as info:
        px.port(eqx_source, destination, X)
    first = info.value.comparison.first_divergence
    assert (first.path_b, first.cotangent_only) == (layer, False)
    difference = float(jnp.max(jnp.abs(expected(eqx_source, X))))
    np.testing.assert_allclose(first.max_abs, difference, rtol=1e-5)
    assert f"max abs difference {difference:.3g}" in str(info.value)
    assert_same(copied(destination), before)


def test_a_different_backward_pass_is_refused_with_cotangents(eqx_source):
    destination = px.from_nnx(NnxMLP(nnx.Rngs(7), detach=True))
    ported, _ = px.port(eqx_source, destination, X)  # the forward pass is the same
    np.testing.assert_allclose(ported(X), eqx_source(X), atol=1e-6)
    with pytest.raises(px.PortError, match="cotangent only") as info:
        px.port(eqx_source, destination, X, cotangents=True)
    # The norm runs under stop_gradient in the port: its output's cotangent there is 0,
    # in the source that of `0.5 * sum(y**2)` through the last layer, `y @ W`.
    first = info.value.comparison.first_divergence
    assert first.cotangent_only and first.path_b == "norm"
    source_cotangent = eqx_source(X) @ eqx_source.out.weight
    np.testing.assert_allclose(first.cotangent_max_abs, float(jnp.max(jnp.abs(source_cotangent))), rtol=1e-5)


def test_incomplete_alignments_and_raw_models_are_refused(eqx_source):
    class Wider(nnx.Module):
        def __init__(self, rngs):
            self.mlp, self.extra = NnxMLP(rngs), nnx.Linear(3, 3, rngs=rngs)

        def __call__(self, x):
            return self.extra(self.mlp(x))

    with pytest.raises(px.HookError, match=r"unmatched, ambiguous or of unknown layout: .*destination 'extra'"):
        px.port(eqx_source, px.from_nnx(Wider(nnx.Rngs(8))), X)
    with pytest.raises(px.HookError, match="no example inputs"):
        px.port(eqx_source, eqx_source)
    with pytest.raises(TypeError, match=r"px\.from_nnx\(module\)"):
        px.port(eqx_source, NnxMLP(nnx.Rngs(9)), X)


# -- a layer holding a decode position and no parameters: carried by path ------------
class LinenPositions(nn.Module):
    """A position embedding as Flax's lm1b keeps its decode index: a `cache_index` in the
    `cache` collection, moved on by calls that may update the cache."""

    @nn.compact
    def __call__(self, x):
        index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.uint32))
        i = index.value
        if not self.is_initializing() and self.is_mutable_collection("cache"):
            index.value = i + 1
        return x + jnp.sin(i.astype(jnp.float32) + jnp.arange(x.shape[-1]))


class LinenDecoder(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(LinenPositions(name="positions")(x))


class NnxPositions(nnx.Module):
    def __init__(self):
        self.cache_index = nnx.Cache(jnp.array(0, jnp.uint32))

    def __call__(self, x):
        i = self.cache_index[...]
        self.cache_index[...] = i + 1
        return x + jnp.sin(i.astype(jnp.float32) + jnp.arange(x.shape[-1]))


class NnxDecoder(nnx.Module):
    def __init__(self, rngs, positions="positions"):
        setattr(self, positions, NnxPositions())
        self.out = nnx.Linear(4, 3, rngs=rngs)
        self.positions_name = positions

    def __call__(self, x):
        return self.out(getattr(self, self.positions_name)(x))


def linen_at_position(steps):
    variables = LinenDecoder().init(jax.random.key(10), X)
    for _ in range(steps):
        _, cache = LinenDecoder().apply(variables, X, mutable=["cache"])
        variables = {**variables, **cache}
    return variables


@pytest.mark.parametrize("abstract", [True, False], ids=["abstract", "concrete"])
def test_a_decode_position_is_carried_by_path(abstract):
    variables = linen_at_position(2)
    kept = copied(variables)
    build = lambda: NnxDecoder(nnx.Rngs(11))
    destination = nnx.eval_shape(build) if abstract else build()  # a concrete one at position 0
    ported, comparison = px.port(px.from_linen(LinenDecoder(), variables), px.from_nnx(destination), X)
    live = px.to_nnx(ported)
    assert int(live.positions.cache_index.get_value()) == 2
    # At position 2, as linen computes it, and by hand.
    np.testing.assert_allclose(ported(X), LinenDecoder().apply(variables, X), atol=1e-6)
    dense = variables["params"]["Dense_0"]
    np.testing.assert_allclose(ported(X), (X + jnp.sin(2.0 + jnp.arange(4))) @ dense["kernel"] + dense["bias"],
                               atol=1e-6)
    assert [(row.path_a, row.path_b) for row in comparison.rows] == [("Dense_0", "out"), ("(output)", "(output)")]
    assert_same(variables, kept)


def test_a_decode_position_without_a_source_at_its_path_is_refused():
    destination = px.from_nnx(NnxDecoder(nnx.Rngs(12), positions="position"))
    with pytest.raises(px.HookError, match=r"destination's layers \['position'\] hold state and no parameters"):
        px.port(px.from_linen(LinenDecoder(), linen_at_position(2)), destination, X)
