"""Statistics of outputs held in a user's own pytree classes (e3nn-jax's `IrrepsArray`),
checked against numpy on the arrays inside: numbers in plain containers, never the user's
container rebuilt around them. Identity logs keep the container."""

import collections
from typing import Any

import e3nn_jax as e3nn
import equinox as eqx
import flax.linen as nn
import flax.struct
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import peex_interop as px

IRREPS = "8x0e+4x1o"  # 8 scalars and 4 vectors: 20 values per node


class Scale(eqx.Module):
    """A user's own layer: an `IrrepsArray` in and out, scaled by a learned factor."""

    factor: jax.Array

    def __call__(self, x: e3nn.IrrepsArray) -> e3nn.IrrepsArray:
        return self.factor * x


class Split(eqx.Module):
    """A layer returning `IrrepsArray`s inside plain containers."""

    def __call__(self, x: e3nn.IrrepsArray) -> tuple[e3nn.IrrepsArray, dict[str, Any]]:
        return x.filter("0e"), {"vectors": x.filter("1o"), "norms": e3nn.norm(x).array}


class Equivariant(eqx.Module):
    linear: e3nn.equinox.Linear
    scale: Scale
    split: Split

    def __init__(self, key):
        self.linear = e3nn.equinox.Linear(irreps_out=IRREPS, irreps_in=IRREPS, key=key)
        self.scale = Scale(jnp.asarray(1.5))
        self.split = Split()

    def __call__(self, x):  # x: (nodes, 20)
        return self.split(self.scale(self.linear(x)))


def nodes():
    return e3nn.normal(IRREPS, jax.random.key(1), (6,))


# Each statistics log, and numpy's statistic of the values.
STATISTICS = [
    (px.MeanLog(), np.mean),
    (px.StdLog(), np.std),
    (px.AbsMaxLog(), lambda x: np.max(np.abs(x))),
    (px.L2NormLog(), lambda x: np.sqrt(np.sum(np.asarray(x, np.float64) ** 2))),
    (px.NearZeroLog(), lambda x: np.mean(x <= 0.05)),
]


def number(value: Any, expected: float) -> None:
    """`value` is a plain scalar array (not the user's container) equal to `expected`."""
    assert isinstance(value, jax.Array) and not isinstance(value, e3nn.IrrepsArray), type(value)
    assert value.shape == ()
    np.testing.assert_allclose(float(value), expected, rtol=1e-5, atol=1e-6)


def by_hand(model: Equivariant, x: e3nn.IrrepsArray) -> dict[str, Any]:
    """Each layer's output as numpy arrays, in the structure its statistics keep."""
    h = model.linear(x)
    s = model.scale(h)
    scalars, rest = model.split(s)
    split = (scalars.array, {"vectors": rest["vectors"].array, "norms": rest["norms"]})
    return jax.tree.map(np.asarray, {"linear": h.array, "scale": s.array, "split": split})


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("log_fn, reference", STATISTICS)
def test_statistics_of_irreps_arrays_are_numbers(log_fn, reference, jit):
    model, x = Equivariant(jax.random.key(0)), nodes()
    hooked = px.ForwardHook(model, log_fn=log_fn)
    _, log = (eqx.filter_jit(hooked) if jit else hooked)(x)
    expected = by_hand(model, x)
    assert set(log) == set(expected)
    number(log["linear"], reference(expected["linear"]))
    number(log["scale"], reference(expected["scale"]))
    # The plain containers around the IrrepsArrays keep their structure.
    scalars, rest = log["split"]
    assert isinstance(log["split"], tuple) and set(rest) == {"vectors", "norms"}
    number(scalars, reference(expected["split"][0]))
    number(rest["vectors"], reference(expected["split"][1]["vectors"]))
    number(rest["norms"], reference(expected["split"][1]["norms"]))


@pytest.mark.parametrize("jit", [False, True])
def test_mean_std_and_activation_stats_of_irreps_arrays(jit):
    model, x = Equivariant(jax.random.key(0)), nodes()
    expected = by_hand(model, x)
    run = (lambda hooked: eqx.filter_jit(hooked)(x)[1]) if jit else (lambda hooked: hooked(x)[1])

    mean, std = run(px.ForwardHook(model, log_fn=px.MeanStdLog()))["scale"]
    number(mean, np.mean(expected["scale"]))
    number(std, np.std(expected["scale"]))
    (scalars, rest), _ = run(px.ForwardHook(model, log_fn=px.MeanStdLog()))["split"]
    number(scalars, np.mean(expected["split"][0]))
    number(rest["vectors"], np.mean(expected["split"][1]["vectors"]))

    stats = run(px.ForwardHook(model, log_fn=px.activation_stats()))
    values = expected["linear"]
    number(stats["linear"]["mean"], np.mean(values))
    number(stats["linear"]["std"], np.std(values))
    number(stats["linear"]["near_zero"], np.mean(values <= 0.05))
    histogram = stats["linear"]["hist"]
    assert isinstance(histogram, px.Histogram)
    np.testing.assert_array_equal(histogram.counts, np.histogram(values, np.asarray(histogram.edges))[0])
    scalars, rest = stats["split"]["std"]
    number(scalars, np.std(expected["split"][0]))
    number(rest["norms"], np.std(expected["split"][1]["norms"]))

    alone = run(px.ForwardHook(model, log_fn=px.HistogramLog(bins=7)))["scale"]
    np.testing.assert_array_equal(alone.counts, np.histogram(expected["scale"], 7)[0])


def test_identity_logs_and_hooks_keep_the_irreps_array():
    model, x = Equivariant(jax.random.key(0)), nodes()
    expected = by_hand(model, x)
    hooked = px.ForwardHook(model, hook_fn=lambda y: 2 * y, where="scale", log_fn=px.IdentityLog())
    out, log = hooked(x)
    assert isinstance(log["scale"], e3nn.IrrepsArray) and log["scale"].irreps == e3nn.Irreps(IRREPS)
    np.testing.assert_allclose(log["scale"].array, 2 * expected["scale"], rtol=1e-6)
    assert isinstance(out[0], e3nn.IrrepsArray)
    np.testing.assert_allclose(out[0].array, 2 * expected["split"][0], rtol=1e-6)


def test_backward_statistics_of_irreps_arrays_are_numbers():
    model, x = Equivariant(jax.random.key(0)), nodes()

    def loss(out):
        scalars, rest = out
        return jnp.sum(jnp.sin(scalars.array) ** 2) + jnp.sum(rest["vectors"].array ** 3) + jnp.sum(rest["norms"])

    cotangent = jax.grad(lambda s: loss(model.split(s)))(model.scale(model.linear(x)))
    for log_fn, reference in [(px.MeanStdLog(), None), (px.StdLog(), np.std)]:
        hooked = px.BackwardHook(model, log_fn=log_fn, where="scale").init(x)
        grads = eqx.filter_grad(lambda hooked: loss(hooked(x)))(hooked)
        if reference is None:
            mean, std = grads.log["scale"]
            number(mean, np.mean(cotangent.array))
            number(std, np.std(cotangent.array))
        else:
            number(grads.log["scale"], reference(cotangent.array))


class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        return e3nn.flax.Linear("3x0e+2x1o", name="linear")(x)


def e3nn_layer(library: str, x: e3nn.IrrepsArray) -> tuple[Any, np.ndarray]:
    """`(converted model, its layer's output by the library's own apply)`: e3nn's own
    equivariant Linear, as e3nn writes it, logged as `"linear"`."""
    if library == "haiku":
        transformed = hk.transform(lambda x: e3nn.haiku.Linear("3x0e+2x1o")(x))
        params = transformed.init(jax.random.key(2), x)
        return px.from_haiku(transformed, params), np.asarray(transformed.apply(params, None, x).array)
    net = LinenNet()
    params = net.init(jax.random.key(2), x)
    return px.from_linen(net, params), np.asarray(net.apply(params, x).array)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("library", ["haiku", "linen"])
def test_statistics_of_an_e3nn_layer(library, jit):
    x = nodes()
    model, values = e3nn_layer(library, x)
    run = (lambda hooked: eqx.filter_jit(hooked)(x)[1]) if jit else (lambda hooked: hooked(x)[1])

    for log_fn, reference in STATISTICS:
        number(run(px.ForwardHook(model, log_fn=log_fn))["linear"], reference(values))
    mean, std = run(px.ForwardHook(model, log_fn=px.MeanStdLog()))["linear"]
    number(mean, np.mean(values))
    number(std, np.std(values))
    number(run(px.ForwardHook(model, log_fn=px.activation_stats()))["linear"]["std"], np.std(values))
    raw = run(px.ForwardHook(model, log_fn=px.IdentityLog()))["linear"]
    assert isinstance(raw, e3nn.IrrepsArray) and raw.irreps == e3nn.Irreps("3x0e+2x1o")
    np.testing.assert_allclose(raw.array, values, rtol=1e-6)


# -- what a statistic keeps of other pytree nodes ------------------------------------------
@flax.struct.dataclass
class Outputs:
    y: jax.Array
    aux: jax.Array


class Unkeyed:
    """A pytree class registered without keys, checking its arrays as IrrepsArray does."""

    def __init__(self, a, b, dim):
        if np.shape(a)[-1] != dim:
            raise ValueError(f"expected {dim} values, got {np.shape(a)}")
        self.a, self.b, self.dim = a, b, dim


jax.tree_util.register_pytree_node(Unkeyed, lambda u: ((u.a, u.b), u.dim), lambda dim, ab: Unkeyed(*ab, dim))

Pair = collections.namedtuple("Pair", "first second")


def test_named_children_become_a_dict_and_unnamed_ones_a_tuple():
    a, b = jnp.arange(6.0).reshape(2, 3), jnp.linspace(-1.0, 2.0, 4)
    mean_a, mean_b = np.mean(np.asarray(a)), np.mean(np.asarray(b))

    # A flax struct dataclass, an eqx.Module: by field name.
    named = px.MeanLog()(Outputs(a, b))
    assert isinstance(named, dict) and set(named) == {"y", "aux"}
    number(named["y"], mean_a)
    number(named["aux"], mean_b)
    stats = px.StatsLog({"max": px.AbsMaxLog()})(Outputs(a, b))["max"]
    assert set(stats) == {"y", "aux"}
    number(stats["aux"], 2.0)
    linear = eqx.nn.Linear(3, 2, key=jax.random.key(0))
    assert set(px.MeanLog()(linear)) == {"weight", "bias"}
    number(px.MeanLog()(linear)["bias"], np.mean(np.asarray(linear.bias)))

    # A node without names: its children in order; the container's check is never run.
    mean, std = px.MeanStdLog()(Unkeyed(a, b, dim=3))
    assert isinstance(mean, tuple) and len(mean) == 2
    number(mean[0], mean_a)
    number(std[1], np.std(np.asarray(b)))
    number(px.StdLog()(Unkeyed(a, b, dim=3))[1], np.std(np.asarray(b)))

    # One child: its statistic.
    number(px.MeanLog()(Scale(a)), mean_a)
    number(px.L2NormLog()(Scale(a)), np.sqrt(np.sum(np.asarray(a) ** 2)))

    # Plain containers keep their type and keys, custom nodes inside them become plain.
    kept = px.MeanLog()([Pair(a, {"b": b, "none": None}), collections.OrderedDict(z=Scale(b))])
    assert isinstance(kept, list) and type(kept[0]) is Pair and type(kept[1]) is collections.OrderedDict
    assert kept[0].second["none"] is None and set(kept[0].second) == {"b", "none"}
    number(kept[0].first, mean_a)
    number(kept[1]["z"], mean_b)
