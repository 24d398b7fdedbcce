"""Issue 24: calls of a named function inside a layer as call sites (`px.function_sites`):
a `gelu` inside an MLP block logs and edits exactly, and its backward log is the
gradient, in all five model styles — compared with the block computed by hand from its
parameters, under `eqx.filter_jit` and `jax.checking_leaks()`."""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.nn import gelu  # a module-global binding, reached like `jax.nn.gelu`

import peex_interop as px
from models import close, jitted
from peex_interop._engine import _patching

B, D, W = 3, 4, 8


@dataclasses.dataclass
class Case:
    """A model whose block `mlp` computes `down(gelu(up(x)))`, with `dense(name)` its
    (kernel (in, out), bias) of `up` and `down`."""

    model: Any
    dense: Callable[[str], tuple[Any, Any]]


class EqxMlp(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __call__(self, x):
        return self.down(gelu(self.up(x)))


class EqxNet(eqx.Module):
    mlp: EqxMlp

    def __call__(self, x):
        return jax.vmap(self.mlp)(x)


def equinox_case():
    k1, k2 = jax.random.split(jax.random.key(0))
    net = EqxNet(EqxMlp(eqx.nn.Linear(D, W, key=k1), eqx.nn.Linear(W, D, key=k2)))

    def dense(name):
        layer = getattr(net.mlp, name)
        return layer.weight.T, layer.bias

    return Case(net, dense)


class HkMlp(hk.Module):
    def __call__(self, x):
        return hk.Linear(D, name="down")(jax.nn.gelu(hk.Linear(W, name="up")(x)))


def haiku_case(x):
    transformed = hk.without_apply_rng(hk.transform(lambda x: HkMlp(name="mlp")(x)))
    params = transformed.init(jax.random.key(0), x)
    return Case(px.from_haiku(transformed, params), lambda n: (params[f"mlp/{n}"]["w"], params[f"mlp/{n}"]["b"]))


class NnxMlp(nnx.Module):
    def __init__(self, rngs):
        self.up, self.down = nnx.Linear(D, W, rngs=rngs), nnx.Linear(W, D, rngs=rngs)

    def __call__(self, x):
        return self.down(nnx.gelu(self.up(x)))


class NnxNet(nnx.Module):
    def __init__(self, rngs):
        self.mlp = NnxMlp(rngs)

    def __call__(self, x):
        return self.mlp(x)


def nnx_case():
    net = NnxNet(nnx.Rngs(0))

    def dense(name):
        layer = getattr(net.mlp, name)
        return layer.kernel.get_value(), layer.bias.get_value()

    return Case(px.from_nnx(net), dense)


class LinenMlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(D, name="down")(nn.gelu(nn.Dense(W, name="up")(x)))


class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        return LinenMlp(name="mlp")(x)


def linen_case(x):
    variables = LinenNet().init(jax.random.key(0), x)
    params = variables["params"]["mlp"]
    return Case(px.from_linen(LinenNet(), variables), lambda n: (params[n]["kernel"], params[n]["bias"]))


def linear(p, x):
    return x @ p["w"] + p["b"]


def mlp(p, x):
    return linear(p["down"], jax.nn.gelu(linear(p["up"], x)))


def net(params, x):
    return mlp(params["mlp"], x)


def function_case():
    rng = np.random.default_rng(0)
    params = {"mlp": {n: {"w": jnp.asarray(rng.standard_normal(s) / 2, jnp.float32), "b": jnp.zeros(s[1])}
                      for n, s in (("up", (D, W)), ("down", (W, D)))}}
    model = px.from_function(net, params, layers=[mlp, linear])
    return Case(model, lambda n: (params["mlp"][n]["w"], params["mlp"][n]["b"]))


@pytest.fixture(scope="module")
def x():
    return jax.random.normal(jax.random.key(1), (B, D))


@pytest.fixture(scope="module", params=["equinox", "haiku", "nnx", "linen", "function"])
def case(request, x):
    build = dict(equinox=equinox_case, nnx=nnx_case, function=function_case)
    if request.param in build:
        return build[request.param]()
    return haiku_case(x) if request.param == "haiku" else linen_case(x)


def by_hand(case, x, edit=lambda g: g):
    (wu, bu), (wd, bd) = case.dense("up"), case.dense("down")
    g = jax.nn.gelu(x @ wu + bu)
    return edit(g) @ wd + bd, g


def test_gelu_logs_and_edits_exactly(case, x):
    model = px.function_sites(case.model, jax.nn.gelu)
    out, log = jitted(px.ForwardHook(model, log_fn=px.IdentityLog(), where="**.gelu"), x)
    expected, g = by_hand(case, x)
    assert set(log) == {"mlp.gelu"}
    close(log["mlp.gelu"], g)
    close(out, expected)  # hooked == unhooked
    edited, _ = jitted(px.ForwardHook(model, hook_fn=lambda v: 2 * v - 1, where="mlp.gelu"), x)
    close(edited, by_hand(case, x, lambda g: 2 * g - 1)[0])
    # Only selections naming it select it: every layer, but no function site.
    assert "mlp.gelu" not in px.ForwardHook(model, log_fn=px.IdentityLog())(x)[1]


def test_gelu_backward_log_is_the_gradient(case, x):
    r = jax.random.normal(jax.random.key(2), (B, D))
    model = px.function_sites(case.model, jax.nn.gelu)
    hooked = px.BackwardHook(model, log_fn=px.IdentityLog(), where=px.kind("function")).init(x)
    with jax.checking_leaks():
        grads = eqx.filter_jit(eqx.filter_grad(lambda h: jnp.sum(h(x) * r)))(hooked)
    _, g = by_hand(case, x)
    wd, bd = case.dense("down")
    close(grads.log["mlp.gelu"], jax.grad(lambda g: jnp.sum((g @ wd + bd) * r))(g))


class Steering(px.AbstractHook):
    """A learnable intervention: a vector added to the activation."""

    vector: jax.Array

    def __call__(self, activation):
        return activation + self.vector


def test_a_trained_steering_vector_has_the_gradients_of_the_hand_edited_model(case, x):
    r, vector = jax.random.normal(jax.random.key(3), (B, D)), jnp.linspace(-1.0, 1.0, W)
    hooked = px.ForwardHook(px.function_sites(case.model, jax.nn.gelu), hook_fn=Steering(vector), where="mlp.gelu")
    with jax.checking_leaks():
        grads = eqx.filter_jit(eqx.filter_grad(lambda hooked: jnp.sum(hooked(x)[0] * r)))(hooked)
    expected = jax.grad(lambda v: jnp.sum(by_hand(case, x, lambda g: g + v)[0] * r))(vector)
    close(grads.hook_fn.vector, expected)


def test_sites_lists_function_sites_when_asked(x):
    model = px.function_sites(equinox_case().model, jax.nn.gelu)
    assert [row.key for row in px.sites(model, x)] == ["mlp.up", "mlp.down", "mlp"]
    rows = {row.key: row for row in px.sites(model, x, inner=True)}
    assert list(rows) == ["mlp.up", "mlp.gelu", "mlp.down", "mlp"]
    assert rows["mlp.gelu"].kind == "function" and rows["mlp.gelu"].output_shapes == ((W,),)

    class Twice(eqx.Module):
        def __call__(self, x):
            return jax.nn.gelu(jax.nn.gelu(x))

    twice = px.function_sites(EqxNet(Twice()), jax.nn.gelu)  # type: ignore[arg-type]
    assert [row.key for row in px.sites(twice, x, inner=True)] == ["mlp.gelu", "mlp.gelu@1", "mlp"]


def test_every_reference_to_a_function_is_a_site(x):
    """A field, a default argument, a static field, a partial in a field or in a
    module-level table (Hugging Face's `ACT2FN`), a closure: each call is the site,
    logged and edited exactly, and every function is restored after the call."""
    mlp = eqx.nn.MLP(D, D, W, depth=1, activation=jax.nn.gelu, key=jax.random.key(0))
    _, log = px.ForwardHook(px.function_sites(mlp, jax.nn.gelu), log_fn=px.IdentityLog(), where="**.gelu")(x[0])
    close(log["gelu"], jax.nn.gelu(mlp.layers[0](x[0])))
    assert mlp.activation is jax.nn.gelu  # the user's model is not modified

    table = {"gelu_new": functools.partial(jax.nn.gelu, approximate=True), "silu": jax.nn.silu}
    tanh_gelu = functools.partial(jax.nn.gelu, approximate=True)

    def closed_over(x):
        return tanh_gelu(x)

    class Default(eqx.Module):
        def __call__(self, x, act=jax.nn.gelu):
            return act(x)

    class Static(eqx.Module):
        act: Callable = eqx.field(static=True)

        def __call__(self, x):
            return self.act(x)

    class Held(eqx.Module):
        act: Any

        def __call__(self, x):
            return self.act(x)

    class Table(eqx.Module):
        def __call__(self, x):
            return table["gelu_new"](x)

    class Closure(eqx.Module):
        def __call__(self, x):
            return closed_over(x)

    written = jax.nn.gelu.__code__
    for layer, expected in [
        (Default(), jax.nn.gelu(x)),
        (Static(tanh_gelu), tanh_gelu(x)),
        (Held(tanh_gelu), tanh_gelu(x)),
        (Table(), tanh_gelu(x)),
        (Closure(), tanh_gelu(x)),
    ]:
        model = px.function_sites(EqxNet(layer), jax.nn.gelu)  # type: ignore[arg-type]
        out, log = jitted(px.ForwardHook(model, log_fn=px.IdentityLog(), where="**.gelu"), x)
        close(log["mlp.gelu"], expected)
        close(out, expected)
        zeroed, _ = jitted(px.ForwardHook(model, hook_fn=jnp.zeros_like, where="**.gelu"), x)
        assert not np.any(np.asarray(zeroed)), type(layer).__name__
        assert jax.nn.gelu.__code__ is written  # swapped back on the way out


def test_jitted_and_custom_derivative_functions_are_reached_through_partials(x):
    """`jax.nn.silu` is a `jax.jit` (a partial is reached inside the jit: plain logs
    work, site-aware hooks are refused there), `jax.nn.relu` a `jax.custom_jvp`
    (reached through its class: everything works)."""

    class Held(eqx.Module):
        act: Any

        def __call__(self, x):
            return self.act(x)

    for function in (jax.nn.silu, jax.nn.relu):
        model = px.function_sites(EqxNet(Held(functools.partial(function))), function)  # type: ignore[arg-type]
        name = f"mlp.{function.__name__}"
        _, log = jitted(px.ForwardHook(model, log_fn=px.IdentityLog(), where=f"**.{name[4:]}"), x)
        close(log[name], function(x))
        grads = jax.grad(lambda x: jnp.sum(model(x) ** 2))(x)
        hooked = px.BackwardHook(model, log_fn=px.IdentityLog(), where=f"**.{name[4:]}").init(x)
        slots = eqx.filter_grad(lambda h, x: jnp.sum(h(x) ** 2))(hooked, x)
        close(slots.log[name], 2 * function(x))
        assert grads.shape == x.shape
    site_aware = px.ForwardHook(
        px.function_sites(EqxNet(Held(functools.partial(jax.nn.silu))), jax.nn.silu),  # type: ignore[arg-type]
        hook_fn=lambda value, site: value, where="**.silu",
    )
    with pytest.raises(px.TransformError, match=r"site-aware hooks of layer 'mlp.silu'"):
        site_aware(x)
    plain = px.function_sites(EqxNet(Held(jax.nn.silu)), jax.nn.silu)  # type: ignore[arg-type]
    _, log = px.ForwardHook(plain, hook_fn=lambda value, site: value, log_fn=px.IdentityLog(), where="**.silu")(x)
    close(log["mlp.silu"], jax.nn.silu(x))  # a field holding it: outside the jit


def test_a_function_the_engine_routes_is_a_site_too(x):
    """`jax.nn.dot_product_attention` (whose weights the engine makes a site) named in
    `px.function_sites` is a site of its own; Flax's `dot_product_attention_weights`
    named there, called by an attention layer, is that layer's `.weights` site (one
    call, one site)."""

    class Attend(eqx.Module):
        def __call__(self, x):
            q = x.reshape(1, -1, 1, 1)
            return jax.nn.dot_product_attention(q, q, q).reshape(x.shape)

    model = px.function_sites(EqxNet(Attend()), jax.nn.dot_product_attention)  # type: ignore[arg-type]
    out, log = px.ForwardHook(model, log_fn=px.IdentityLog(), where=px.kind("function"))(x)
    close(log["mlp.dot_product_attention"].reshape(x.shape), out)
    assert not _patching.is_patched(jax.nn, "dot_product_attention")  # undone on the way out

    class SelfAttention(nn.Module):
        @nn.compact
        def __call__(self, x):
            q = nn.DenseGeneral((2, 1), name="q")(x)
            weights = nn.attention.dot_product_attention_weights(q, q)
            return jnp.einsum("...hqk,...khd->...qhd", weights, q).reshape(x.shape)

    tokens = x.reshape(B, 2, 2)
    variables = SelfAttention().init(jax.random.key(0), tokens)
    linen_model = px.from_linen(SelfAttention(), variables)
    named = px.function_sites(linen_model, nn.attention.dot_product_attention_weights)
    for model in (linen_model, named):
        _, log = px.ForwardHook(model, log_fn=px.IdentityLog(), where="**.weights")(tokens)
        q = nn.DenseGeneral((2, 1)).apply({"params": variables["params"]["q"]}, tokens)
        close(log["weights"], nn.attention.dot_product_attention_weights(q, q))


def test_attention_weights_formed_twice_raise_and_are_two_function_sites(x):
    class TwoSoftmaxAttention(eqx.Module):
        def __call__(self, x):
            logits = jnp.outer(x, x)
            return (jax.nn.softmax(logits) + jax.nn.softmax(2 * logits)) @ x

    model = EqxNet(TwoSoftmaxAttention())  # type: ignore[arg-type]
    with pytest.raises(px.HookError, match=r"layer 'mlp' \(TwoSoftmaxAttention\) forms attention weights twice"):
        px.ForwardHook(model, log_fn=px.IdentityLog(), where="**.weights")(x)
    # The remedy the error names: each softmax is a function site, the weights unselected.
    named = px.function_sites(model, jax.nn.softmax)
    _, log = px.ForwardHook(named, log_fn=px.IdentityLog(), where="**.softmax")(x)
    logits = jax.vmap(lambda v: jnp.outer(v, v))(x)
    close(log["mlp.softmax"], jax.nn.softmax(logits))
    close(log["mlp.softmax@1"], jax.nn.softmax(2 * logits))
