"""The corners of issue 22 where an answer was silently wrong, each now right or a clear
error: tied weights, renames onto generated keys, layers used through other methods,
stacks run by indexing, non-array log leaves inside transforms, and the closed-world
rule (every explicit pattern reaches a call)."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from zephyr.building.tracing import trace
from zephyr.nets import linear

import peex_interop as px
from models import BatchedNormalised, close, normalised

KEYS = jax.random.split(jax.random.key(0), 6)
X = jnp.array([0.5, -0.2, 0.3])


class Tied(eqx.Module):
    shared: eqx.nn.Shared

    def __init__(self, use_bias: bool):
        a = eqx.nn.Linear(3, 3, use_bias=use_bias, key=KEYS[0])
        b = eqx.nn.Linear(3, 3, use_bias=use_bias, key=KEYS[1])
        self.shared = eqx.nn.Shared((a, b), lambda pair: pair[1].weight, lambda pair: pair[0].weight)

    def __call__(self, x):
        a, b = self.shared()
        return b(jnp.tanh(a(x)))


@pytest.mark.parametrize("use_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "filter_jit"])
def test_tied_weights_are_named_by_their_positions(use_bias, jit):
    model = Tied(use_bias)
    a, b = model.shared()
    call = eqx.filter_jit(lambda h, x: h(x)) if jit else (lambda h, x: h(x))
    _, log = call(px.ForwardHook(model, log_fn=px.IdentityLog()), X)
    assert set(log) == {"shared.pytree.0", "shared.pytree.1"}
    close(log["shared.pytree.0"], a(X))
    close(log["shared.pytree.1"], b(jnp.tanh(a(X))))
    # An edit of one lands on that one only.
    edited, _ = call(px.ForwardHook(model, hook_fn=lambda y: y + 1.0, where="shared.pytree.0"), X)
    close(edited, b(jnp.tanh(a(X) + 1.0)))
    edited, _ = call(px.ForwardHook(model, hook_fn=lambda y: y + 1.0, where="shared.pytree.1"), X)
    close(edited, b(jnp.tanh(a(X))) + 1.0)
    hooked = px.BackwardHook(model, log_fn=px.IdentityLog()).init(X)
    grads = eqx.filter_grad(lambda h, x: jnp.sum(call(h, x) ** 2))(hooked, X)
    out = b(jnp.tanh(a(X)))
    close(grads.log["shared.pytree.1"], 2 * out)
    _, vjp = jax.vjp(lambda y: b(jnp.tanh(y)), a(X))
    close(grads.log["shared.pytree.0"], vjp(2 * out)[0])


class Twice(eqx.Module):
    a: eqx.nn.Linear
    b: eqx.nn.Linear
    head: eqx.nn.Linear

    def __call__(self, x):
        return self.head(self.b(self.a(self.a(x))))


TWICE = Twice(*(eqx.nn.Linear(3, 3, key=k) for k in KEYS[:3]))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(rename={"b": "a@1"}, log_fn=px.IdentityLog()),
        dict(rename={"b": "head:in"}, log_fn=px.IdentityLog(), pre_log_fn=px.IdentityLog()),
    ],
    ids=["onto_a_repeat", "onto_a_pre_log"],
)
def test_a_rename_onto_a_generated_key_is_refused(kwargs):
    with pytest.raises(px.HookError, match="same key"):
        px.ForwardHook(TWICE, **kwargs)(X)


def test_a_backward_rename_onto_a_generated_key_is_refused():
    with pytest.raises(px.HookError, match="same key"):
        px.BackwardHook(TWICE, log_fn=px.IdentityLog(), rename={"b": "a@1"}).init(X)


class Encoder(eqx.Module):
    lin: eqx.nn.Linear

    def encode(self, x):
        return 2 * self.lin(x)


class UsesAMethod(eqx.Module):
    enc: Encoder

    def __call__(self, x):
        return self.enc.encode(x)


def test_a_layer_used_only_through_a_method_raises_and_its_method_and_sublayers_are_hooked():
    model = UsesAMethod(Encoder(eqx.nn.Linear(3, 3, key=KEYS[3])))
    with pytest.raises(px.HookError, match=r"'enc' selected no call.*method other than `__call__`.*enc\.encode"):
        px.ForwardHook(model, log_fn=px.IdentityLog(), where="enc")(X)
    _, log = px.ForwardHook(model, log_fn=px.IdentityLog(), where="enc.*")(X)
    close(log["enc.lin"], model.enc.lin(X))
    close(log["enc.encode"], model.enc.encode(X))


class Gated(eqx.Module):
    lin: eqx.nn.Linear
    mlp: eqx.nn.MLP

    def __call__(self, x, extra=False):
        x = self.lin(x)
        return self.mlp(x) if extra else x


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "filter_jit"])
def test_a_selection_of_layers_that_did_not_run_is_no_error(jit):
    # A layer the model has that did not run (a branch not taken) is absent from the
    # log, with the sites inside it (`mlp.gelu`); a typo, and a site of a layer that
    # ran without running it, still raise.
    model = px.function_sites(
        Gated(eqx.nn.Linear(3, 3, key=KEYS[0]), eqx.nn.MLP(3, 3, 4, 1, activation=jax.nn.gelu, key=KEYS[1])),
        jax.nn.gelu,
    )
    call = eqx.filter_jit(lambda h, x, extra: h(x, extra)) if jit else (lambda h, x, extra: h(x, extra))
    where = ["lin", "mlp", "mlp.layers.*", "mlp.gelu"]
    _, log = call(px.ForwardHook(model, log_fn=px.IdentityLog(), where=where), X, False)
    assert set(log) == {"lin"}
    close(log["lin"], model.model.lin(X))
    _, log = call(px.ForwardHook(model, log_fn=px.IdentityLog(), where=where), X, True)
    assert set(log) == {"lin", "mlp", "mlp.layers.0", "mlp.layers.1", "mlp.gelu"}
    with pytest.raises(px.HookError, match=r"'lin\.gelu' selected no call"):
        call(px.ForwardHook(model, log_fn=px.IdentityLog(), where=["lin", "lin.gelu"]), X, True)
    with pytest.raises(px.HookError, match=r"'mlp\.layers\.2' matches no layer"):
        px.ForwardHook(model, where=["lin", "mlp.layers.2"])


@pytest.mark.parametrize(
    "kwargs", [dict(log_fn={"hed": px.IdentityLog()}), dict(hook_fn={"head": jnp.tanh, "b.*": jnp.tanh})],
    ids=["log_map", "hook_map"],
)
def test_every_pattern_of_a_map_must_reach_a_call(kwargs):
    with pytest.raises(px.HookError, match=r"pattern '(hed|b\.\*)' selected no call"):
        px.ForwardHook(TWICE, **kwargs)(X)


class IndexedStack(eqx.Module):
    layers: eqx.nn.Linear
    loop: str = eqx.field(static=True)

    def __call__(self, x):
        dynamic, static = eqx.partition(self.layers, eqx.is_array)
        step = lambda i, x: eqx.combine(jax.tree.map(lambda a: a[i], dynamic), static)(x)
        if self.loop == "python":
            for i in range(3):
                x = step(i, x)
            return x
        return jax.lax.fori_loop(0, 3, step, x)


@pytest.mark.parametrize("loop", ["python", "fori_loop"])
@pytest.mark.parametrize("where", [None, "layers"])
def test_a_stack_run_by_indexing_is_refused_not_left_unhooked(loop, where):
    model = IndexedStack(eqx.filter_vmap(lambda k: eqx.nn.Linear(3, 3, key=k))(KEYS[:3]), loop)
    with pytest.raises(px.HookError, match=r"one step of the stack of layers 'layers'"):
        px.ForwardHook(model, log_fn=px.IdentityLog(), where=where)(X)
    # Excluding it runs, unhooked, as the plain model.
    out, log = px.ForwardHook(model, log_fn=px.IdentityLog(), where=px.not_("layers"))(X)
    close(out, model(X))
    assert log == {}


class Mapped(eqx.Module):
    lin: eqx.nn.Linear

    def __call__(self, xs):
        return jax.lax.scan(lambda c, x: (c, self.lin(x)), 0.0, xs)[1] + jax.vmap(self.lin)(xs)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "filter_jit"])
def test_non_array_log_leaves_cross_transforms_as_they_are(jit):
    model, xs = Mapped(eqx.nn.Linear(3, 3, key=KEYS[4])), jnp.stack([X, 2 * X])
    call = eqx.filter_jit(lambda h, x: h(x)) if jit else (lambda h, x: h(x))
    _, log = call(px.ForwardHook(model, log_fn=lambda y: {"name": "lin", "mean": jnp.mean(y)}), xs)
    assert set(log) == {"lin", "lin@1"}
    for key in log:
        assert log[key]["name"] == "lin"
        close(log[key]["mean"], jnp.mean(jax.vmap(model.lin)(xs), axis=-1))


def test_a_model_with_a_collective_over_its_batch_run_on_one_example_is_refused_with_the_remedy():
    # Every function that runs the whole model on the example arguments: JAX's own
    # error names no layer and advises shard_map.
    (a, state), (b, _) = normalised(0), normalised(1)
    x = jnp.ones(3)
    mapping = {"lin": "lin", "bn": "bn", "head": "head"}
    calls = [
        ("px.sites", lambda: px.sites(a, x, state)),
        ("px.summary", lambda: px.summary(a, x, state)),
        ("px.align", lambda: px.align(a, b, x, state)),
        # An Equinox pair is read without running; the model first runs in the verification.
        (r"transfer_params\(\.\.\., inputs=\)",
         lambda: px.transfer_params(a, b, mapping, inputs=(x, state), src_state=state, dst_state=state)),
        ("px.compare", lambda: px.compare(a, b, x, state, alignment=px.Alignment(mapping, (), (), True))),
        ("px.port", lambda: px.port(a, b, x, state)),
    ]
    for caller, call in calls:
        with pytest.raises(px.HookError, match=rf"^{caller} ran the model .* axis name 'batch'.*jax.vmap\(self.model"):
            call()


def test_the_remedy_for_a_collective_over_the_batch_maps_the_model_itself():
    (a, state), (b, _) = normalised(0), normalised(1)
    xs = jax.random.normal(jax.random.key(2), (5, 3))
    rows = {row.path: row for row in px.summary(BatchedNormalised(a), xs, state).rows}
    # Per example, as inside the vmap; the state the BatchNorm takes is read before the
    # call updates it (Equinox refuses a State once used).
    assert rows["model.lin"].output == jax.ShapeDtypeStruct((4,), jnp.float32)
    assert rows["model.bn"].args[0] == jax.ShapeDtypeStruct((4,), jnp.float32)
    comparison = px.compare(BatchedNormalised(a), BatchedNormalised(b), xs, state)
    assert comparison.first_divergence.path_a == "model.lin"
    # Against the output by hand: the two models' heads on their batch statistics.
    out_a, out_b = (jax.vmap(m, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(xs, state)[0]
                    for m in (a, b))
    head = next(row for row in comparison.rows if row.path_a == "model.head")
    close(head.max_abs, jnp.max(jnp.abs(out_a - out_b)))
    assert px.compare(BatchedNormalised(a), BatchedNormalised(a), xs, state).first_divergence is None
    # The transfer takes the states as arguments (px.port, only models holding theirs).
    mapping = px.align(BatchedNormalised(a), BatchedNormalised(b), xs, state).mapping
    ported, ported_state = px.transfer_params(
        BatchedNormalised(a), BatchedNormalised(b), mapping, inputs=(xs, state), src_state=state, dst_state=state)
    close(ported(xs, ported_state)[0], out_a)
    with pytest.raises(px.HookError, match=r"'model.bn'.*eqx.nn.State.*src_state="):
        px.port(BatchedNormalised(a), BatchedNormalised(b), xs, state)


class TwiceNormalised(eqx.Module):
    bn: eqx.nn.BatchNorm

    def __call__(self, xs, state):
        def one(x, state):
            h, state = self.bn(x, state)
            return self.bn(h, state)

        return jax.vmap(one, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(xs, state)


@pytest.mark.parametrize("logs", ["pre_log_fn", "log_fn"])
def test_a_logged_state_outlives_the_call_that_updates_it(logs):
    # Equinox invalidates an eqx.nn.State once a call has updated it: the state a layer
    # takes (pre) or returns (post, then taken by the layer's second call) stays readable
    # in the log, with the values it had.
    model, state = eqx.nn.make_with_state(TwiceNormalised)(eqx.nn.BatchNorm(3, axis_name="batch", mode="batch"))
    xs = jax.random.normal(jax.random.key(0), (4, 3))
    out, log = eqx.filter_jit(px.ForwardHook(model, **{logs: px.IdentityLog()}))(xs, state)

    def by_hand(xs, state):
        h, first = model.bn(xs, state)
        return h, jax.tree.map(lambda a: a, first), model.bn(h, first)  # a clone: the call invalidates it

    h, first, (y, second) = jax.vmap(by_hand, axis_name="batch", in_axes=(0, None), out_axes=(0, None, (0, None)))(
        xs, state)
    close(out[0], y)
    # Logged inside the vmap, a state is logged per example: every row the same.
    rows = lambda got, want: jax.tree.map(lambda g, w: close(g, jnp.broadcast_to(w, g.shape)), got, want)
    if logs == "pre_log_fn":
        rows(log["bn:in"][0], (xs, state))
        rows(log["bn@1:in"][0], (h, first))
    else:
        rows(log["bn"], (h, first))
        rows(log["bn@1"], (y, second))


class ClosedOverState(eqx.Module):
    """A SpectralNorm (which updates its power iteration in an eqx.nn.State) whose State
    a transform body closes over: the engine runs such bodies abstractly first."""

    lin: eqx.nn.Linear
    norm: eqx.nn.SpectralNorm
    transform: str = eqx.field(static=True)

    def __call__(self, xs, state):
        body = lambda x: self.norm(self.lin(x), state)[0]
        if self.transform == "cond":
            return jax.lax.cond(xs[0, 0] > 0, lambda xs: jax.vmap(body)(xs), lambda xs: jax.vmap(self.lin)(xs), xs)
        if self.transform == "scan":
            return jax.lax.scan(lambda c, x: (c, body(x)), 0.0, xs)[1]
        return jax.vmap(body)(xs)


@pytest.mark.parametrize("transform", ["cond", "vmap", "scan"])
def test_a_state_closed_over_by_a_transform_body_survives_the_engines_shape_passes(transform):
    keys = jax.random.split(jax.random.key(0), 3)
    model, state = eqx.nn.make_with_state(ClosedOverState)(
        eqx.nn.Linear(3, 4, key=keys[0]), eqx.nn.SpectralNorm(eqx.nn.Linear(4, 4, key=keys[1]), "weight", key=keys[2]),
        transform,
    )
    xs = jnp.abs(jax.random.normal(jax.random.key(1), (5, 3)))
    fresh = lambda: jax.tree.map(lambda a: a, state)  # a call spends the State it is given
    out, log = px.ForwardHook(model, log_fn=px.IdentityLog())(xs, fresh())
    close(out, model(xs, fresh()))
    close(log["lin"], jax.vmap(model.lin)(xs))

    hooked = px.BackwardHook(model, log_fn=px.IdentityLog(), where="lin")
    given = fresh()
    hooked = hooked.init(xs, given)
    model(xs, given)  # init left the State it was given unspent
    grads = eqx.filter_grad(lambda h: jnp.sum(jnp.sin(h(xs, fresh())) ** 2))(hooked)

    def rest(h):  # the computation after lin, as the model runs it
        return jnp.sum(jnp.sin(jax.vmap(lambda y: model.norm(y, fresh())[0])(h)) ** 2)

    close(grads.log["lin"], jax.grad(rest)(jax.vmap(model.lin)(xs)))
    plain = eqx.filter_grad(lambda m: jnp.sum(jnp.sin(m(xs, fresh())) ** 2))(model)
    jax.tree.map(close, eqx.filter(grads.model, eqx.is_inexact_array), eqx.filter(plain, eqx.is_inexact_array))


class GatedLinear(eqx.nn.Linear):
    """A Linear subclass with an array of its own: no other library's Linear holds it."""

    gate: jax.Array

    def __init__(self, key):
        super().__init__(3, 3, key=key)
        self.gate = jnp.full((3,), 2.0)

    def __call__(self, x):
        return self.gate * super().__call__(x)


class Holder(eqx.Module):
    lin: eqx.nn.Linear

    def __call__(self, x):
        return self.lin(x)


def test_a_transfer_never_drops_arrays_a_layer_layout_does_not_read():
    gated, plain = Holder(GatedLinear(KEYS[2])), Holder(eqx.nn.Linear(3, 3, key=KEYS[3]))
    # Copying weight and bias alone (as before) gave a model off by the gate, silently.
    assert not jnp.allclose(gated(X), gated.lin.weight @ X + gated.lin.bias)
    for src, dst in ((gated, plain), (plain, gated)):
        for inputs in ({}, {"inputs": X}):
            with pytest.raises(px.HookError, match=r"cannot map layer 'lin': its parameters \['gate'\]"):
                px.transfer_params(src, dst, {"lin": "lin"}, **inputs)


def test_a_layer_whose_weight_a_wrapper_reparametrises_is_not_transferred():
    # eqx.nn.WeightNorm calls its layer with g * v / |v|, eqx.nn.SpectralNorm with W / sigma:
    # the stored weight, copied alone (as before, mapping the inner layer), is not the one used.
    linear = eqx.nn.Linear(3, 3, key=KEYS[4])
    normed = eqx.nn.WeightNorm(linear)
    normed = Holder(eqx.tree_at(lambda w: w.g, normed, 3 * normed.g))
    spectral, state = eqx.nn.make_with_state(eqx.nn.SpectralNorm)(linear, "weight", key=KEYS[5])
    plain = Holder(eqx.nn.Linear(3, 3, key=KEYS[3]))
    assert not jnp.allclose(normed(X), linear(X))
    for wrapped, name in ((normed, "WeightNorm"), (Holder(spectral), "SpectralNorm")):
        for src, dst in ((wrapped, plain), (plain, wrapped)):
            mapping = {"lin.layer": "lin"} if src is wrapped else {"lin": "lin.layer"}
            with pytest.raises(px.HookError, match=f"reparametrised by the {name} holding it"):
                px.transfer_params(src, dst, mapping)


# -- inputs passed by keyword -------------------------------------------------------------
class ByKeyword(eqx.Module):
    lin: eqx.nn.Linear
    head: eqx.nn.Linear

    def __call__(self, x):
        return self.head(x=jnp.tanh(self.lin(x=x)))


def keyword_function(params, x):
    return linear(params["head"], x=jnp.tanh(linear(params["lin"], x=x, out_dim=4)), out_dim=2)


def by_keyword(library):
    """`(hooked model, head(h), hidden(x))` for a model of `library` whose every layer
    gets its input by keyword (`head(inputs=h)`): the head as a function of its input,
    and the head's input as a function of the model's."""
    if library == "equinox":
        model = ByKeyword(eqx.nn.Linear(3, 4, key=KEYS[0]), eqx.nn.Linear(4, 2, key=KEYS[1]))
        return model, model.head, lambda x: jnp.tanh(model.lin(x))
    if library == "haiku":
        import haiku as hk

        def layers():
            return hk.Linear(4, name="lin"), hk.Linear(2, name="head")

        def net(x):
            lin, head = layers()
            return head(inputs=jnp.tanh(lin(inputs=x)))

        params = hk.transform(net).init(KEYS[2], X)
        lin = hk.without_apply_rng(hk.transform(lambda x: hk.Linear(4, name="lin")(x))).apply
        head = hk.without_apply_rng(hk.transform(lambda h: hk.Linear(2, name="head")(h))).apply
        return (px.from_haiku(hk.transform(net), params), lambda h: head(params, h),
                lambda x: jnp.tanh(lin(params, x)))
    if library == "linen":
        import flax.linen as nn

        class Net(nn.Module):
            @nn.compact
            def __call__(self, x):
                return nn.Dense(2, name="head")(inputs=jnp.tanh(nn.Dense(4, name="lin")(inputs=x)))

        variables = Net().init(KEYS[2], X)
        dense = {name: nn.Dense(width) for name, width in (("lin", 4), ("head", 2))}
        layer = {name: (lambda v, name=name: dense[name].apply({"params": variables["params"][name]}, v))
                 for name in dense}
        return px.from_linen(Net(), variables), layer["head"], lambda x: jnp.tanh(layer["lin"](x))
    if library == "function":
        params = trace(keyword_function, KEYS[2], X)
        return (px.from_function(keyword_function, params, layers=[linear]),
                lambda h: linear(params["head"], h, 2), lambda x: jnp.tanh(linear(params["lin"], x, 4)))
    from flax import nnx

    class NnxNet(nnx.Module):
        def __init__(self, rngs):
            self.lin, self.head = nnx.Linear(3, 4, rngs=rngs), nnx.Linear(4, 2, rngs=rngs)

        def __call__(self, x):
            return self.head(inputs=jnp.tanh(self.lin(inputs=x)))

    live = NnxNet(nnx.Rngs(3))
    return px.from_nnx(live), live.head, lambda x: jnp.tanh(live.lin(x))


@pytest.mark.parametrize("library", ["equinox", "haiku", "linen", "nnx", "function"])
def test_pre_hooks_see_and_edit_inputs_passed_by_keyword(library):
    # Passed by keyword, the input was no positional input: the log was `()`, the edit
    # not applied, the cotangent not logged.
    model, head, hidden = by_keyword(library)
    h = hidden(X)
    # A function model's layer takes its params first.
    first = 1 if library == "function" else 0
    _, log = px.ForwardHook(model, log_fn=px.IdentityLog(), pre_hook=True)(X)
    close(log["head"][first], h)

    def zero_input(args):
        return (*args[:first], args[first] * 0, *args[first + 1:])

    edited, _ = px.ForwardHook(model, hook_fn=zero_input, pre_hook=True, where="head")(X)
    close(edited, head(jnp.zeros_like(h)))
    hooked = px.BackwardHook(model, log_fn=px.IdentityLog(), pre_hook=True, where="head").init(X)
    grads = eqx.filter_grad(lambda m: jnp.sum(m(X) ** 2))(hooked)
    out, pullback = jax.vjp(head, h)
    close(grads.log["head"][first], pullback(2 * out)[0])


class KeywordOnly(eqx.Module):
    lin: eqx.nn.Linear

    def __call__(self, x, *, scale):
        return self.lin(x) * scale


class UsesKeywordOnly(eqx.Module):
    layer: KeywordOnly

    def __call__(self, x):
        return self.layer(x, scale=jnp.array(2.0))


def test_a_pre_hook_refuses_a_call_passing_float_arrays_to_keyword_only_parameters():
    model = UsesKeywordOnly(KeywordOnly(eqx.nn.Linear(3, 3, key=KEYS[0])))
    refused = r"layer 'layer'.*by keyword \(scale\)"
    with pytest.raises(px.HookError, match=refused):
        px.ForwardHook(model, log_fn=px.IdentityLog(), pre_hook=True, where="layer")(X)
    with pytest.raises(px.HookError, match=refused):
        px.BackwardHook(model, log_fn=px.IdentityLog(), pre_hook=True, where="layer").init(X)
    # Hooks of its output and pre_hook_fn, which takes (args, kwargs), are not refused.
    _, log = px.ForwardHook(model, pre_log_fn=px.IdentityLog(), where="layer")(X)
    close(log["layer:in"][1]["scale"], 2.0)
    _, log = px.ForwardHook(model, log_fn=px.IdentityLog(), where="layer")(X)
    close(log["layer"], model(X))


def test_a_function_model_reaches_layer_functions_its_closure_holds():
    # Held in the closure of the model's function, not in a module global: no call was
    # replaced, and the log was silently empty.
    def closure_model():
        layer = linear

        def function(params, x):
            return layer(params["lin"], x, 2)

        return function

    function = closure_model()
    params = trace(function, KEYS[2], X)
    model = px.from_function(function, params, layers=[linear])
    _, log = px.ForwardHook(model, log_fn=px.IdentityLog())(X)
    close(log["lin"], linear(params["lin"], X, 2))
    edited, _ = eqx.filter_jit(lambda m: px.ForwardHook(m, hook_fn=lambda y: y * 0, where="lin")(X))(model)
    close(edited, jnp.zeros(2))
    assert function.__closure__[0].cell_contents is linear  # undone


def test_a_function_model_whose_layer_calls_no_hook_reaches_raises():
    # A partial made before the call holds the layer function where nothing replaces it.
    layer = functools.partial(linear, out_dim=2)

    def function(params, x):
        return layer(params["lin"], x)

    model = px.from_function(function, trace(function, KEYS[2], X), layers=[linear])
    with pytest.raises(px.HookError, match=r"no call of its layer functions \(linear\) was reached"):
        px.ForwardHook(model, log_fn=px.IdentityLog())(X)
