"""Cotangent logs and edits, checked against `jax.vjp` of the sub-computations."""

from functools import partial

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import peex_interop as px
from models import MLP, BatchedNormalised, Deep, close, normalised, tokens, transformer


def loss_of(output):
    return jnp.sum(jnp.sin(output) ** 2)


@eqx.filter_grad
def grads_of(hooked, *args):
    return loss_of(hooked(*args))


def test_cotangent_logs_equal_vjp_at_every_depth():
    model = Deep(key=jax.random.key(0))
    x = jnp.linspace(-1.0, 1.0, 3)
    grads = grads_of(px.BackwardHook(model, log_fn=px.IdentityLog()).init(x), x)

    h0 = model.layers[0](x)
    h1 = model.layers[1](jax.nn.relu(h0))
    ha = model.by_name["a"](jax.nn.relu(h1))
    s0 = model.seq.layers[0](ha)

    def rest_after_s0(s0):
        return loss_of(model.out(model.seq.layers[2](jnp.tanh(s0))))

    def rest_after_h0(h0):
        h1 = model.layers[1](jax.nn.relu(h0))
        return loss_of(model.out(model.seq(model.by_name["a"](jax.nn.relu(h1)))))

    close(grads.log["seq.layers.0"], jax.grad(rest_after_s0)(s0))
    close(grads.log["layers.0"], jax.grad(rest_after_h0)(h0))
    close(grads.log["out"], jax.grad(loss_of)(model(x)))
    # The model's own gradients are untouched by identity hooks.
    expected = eqx.filter_grad(lambda m: loss_of(m(x)))(model)
    jax.tree.map(close, eqx.filter(grads.model, eqx.is_array), eqx.filter(expected, eqx.is_array))


def test_cotangent_edit_equals_hand_modified_backward():
    model = MLP(3, 4, 2, key=jax.random.key(1))
    x = jnp.linspace(-1.0, 1.0, 3)
    hooked = px.BackwardHook(model, hook_fn=lambda ct: 0.5 * ct, where="linear1").init(x)
    grads = grads_of(hooked, x)
    plain = eqx.filter_grad(lambda m: loss_of(m(x)))(model)
    close(grads.model.linear2.weight, plain.linear2.weight)  # the edit acts below linear2
    close(grads.model.linear1.weight, 0.5 * plain.linear1.weight)
    close(grads.model.linear1.bias, 0.5 * plain.linear1.bias)


def test_pre_hook_logs_input_cotangents():
    model = MLP(3, 4, 2, key=jax.random.key(1))
    x = jnp.linspace(-1.0, 1.0, 3)
    grads = grads_of(px.BackwardHook(model, log_fn=px.IdentityLog(), pre_hook=True).init(x), x)
    h = jax.nn.relu(model.linear1(x))
    (ct,) = grads.log["linear2"]
    close(ct, jax.grad(lambda h: loss_of(model.linear2(h)))(h))


def test_forward_and_backward_on_one_model():
    model = MLP(3, 4, 2, key=jax.random.key(1))
    x = jnp.linspace(-1.0, 1.0, 3)
    both = px.BackwardHook(px.ForwardHook(model, log_fn=px.IdentityLog()), log_fn=px.IdentityLog()).init(x)

    @eqx.filter_grad(has_aux=True)
    def step(hooked, x):
        output, forward_log = hooked(x)
        return loss_of(output), forward_log

    grads, forward_log = step(both, x)
    assert set(forward_log) == set(grads.log) == {"linear1", "linear2"}
    close(forward_log["linear1"], model.linear1(x))
    close(grads.log["linear2"], jax.grad(loss_of)(model(x)))


class PerExample(eqx.Module):
    lin: eqx.nn.Linear
    head: eqx.nn.Linear

    def __call__(self, xs):
        return jnp.sum(jax.vmap(self.head)(jnp.tanh(jax.vmap(self.lin)(xs))))


def test_backward_inside_vmap_is_per_example_not_summed():
    keys = jax.random.split(jax.random.key(0), 2)
    model = PerExample(eqx.nn.Linear(3, 4, key=keys[0]), eqx.nn.Linear(4, 1, key=keys[1]))
    xs = jax.random.normal(jax.random.key(3), (6, 3))
    grads = grads_of(px.BackwardHook(model, log_fn=px.IdentityLog()).init(xs), xs)
    assert grads.log["lin"].shape == (6, 4)
    hs = jax.vmap(model.lin)(xs)
    _, vjp = jax.vjp(lambda hs: loss_of(jnp.sum(jax.vmap(model.head)(jnp.tanh(hs)))), hs)
    close(grads.log["lin"], vjp(1.0)[0])


def test_init_of_a_model_with_a_collective_over_the_batch_runs_inside_its_vmap():
    model, state = normalised(0)
    xs = jax.random.normal(jax.random.key(2), (5, 3))
    hooked = px.BackwardHook(model, log_fn=px.IdentityLog(), where=["lin", "head"])
    # Outside the vmap, the axis name is unbound: the error says where to call init.
    with pytest.raises(px.HookError, match=r"outside the vmap.*batch.*filter_vmap"):
        hooked.init(xs[0], state)
    hooked = eqx.filter_vmap(lambda x: hooked.init(x, state), axis_name="batch", out_axes=None)(xs)

    def loss(h, state, delta=None):
        def one(x):
            if delta is None:
                return h(x, state)
            y, new_state = h.bn(h.lin(x) + delta, state)
            return h.head(jax.nn.relu(y)), new_state

        out, _ = jax.vmap(one, axis_name="batch", out_axes=(0, None))(xs)
        return jnp.sum(out**2)

    # (The state an argument, as in a training step: Equinox refuses a concrete state
    # used twice.)
    grads = eqx.filter_jit(eqx.filter_grad(loss))(hooked, state)
    # Closed over by the vmap, a slot is shared by the examples: its gradient is that of
    # one shift of the layer's output for all of them.
    close(grads.log["lin"], jax.jit(jax.grad(lambda d, state: loss(model, state, d)))(jnp.zeros(4), state))
    jax.tree.map(close, eqx.filter(grads.model, eqx.is_inexact_array),
                 eqx.filter(eqx.filter_jit(eqx.filter_grad(loss))(model, state), eqx.is_inexact_array))


@pytest.mark.parametrize("pre_hook", [False, True])
def test_a_layer_returning_its_state_from_the_equinox_batchnorm_idiom(pre_hook):
    # Every layer hooked, BatchNorm too: the state it takes and returns is no activation
    # (None in the log), and is returned from the vmap unbatched as the model does.
    inner, state = normalised(3)
    model, xs = BatchedNormalised(inner), jax.random.normal(jax.random.key(4), (5, 3))

    def loss(m, state):
        out, new_state = m(xs, state)
        # The returned state is differentiated too: its cotangent must pass through.
        return jnp.sum(out**2) + jnp.sum(jax.tree.leaves(new_state)[1] ** 2)

    hooked = px.BackwardHook(model, log_fn=px.IdentityLog(), pre_hook=pre_hook).init(xs, state)
    grads = eqx.filter_jit(eqx.filter_grad(loss))(hooked, state)
    jax.tree.map(close, eqx.filter(grads.model, eqx.is_inexact_array),
                 eqx.filter(eqx.filter_jit(eqx.filter_grad(loss))(model, state), eqx.is_inexact_array))
    assert grads.log["model.bn"][1] is None

    # Independently: the gradient with respect to each example's input of the layer
    # (pre_hook) or its output, the rest of the model run by hand under the same vmap.
    def rest(values, at):
        def one(v):
            h = inner.lin(v) if at == "input of lin" else v
            y, new_state = inner.bn(h, state)
            return inner.head(jax.nn.relu(y)), new_state

        out, new_state = jax.vmap(one, axis_name="batch", out_axes=(0, None))(values)
        return jnp.sum(out**2) + jnp.sum(jax.tree.leaves(new_state)[1] ** 2)

    if pre_hook:
        close(grads.log["model.lin"][0], jax.grad(rest)(xs, "input of lin"))
    else:
        close(grads.log["model.lin"], jax.grad(rest)(jax.vmap(inner.lin)(xs), "output of lin"))


def test_backward_inside_scan_is_per_step():
    model = transformer(num_blocks=3)
    t = tokens()
    grads = grads_of(px.BackwardHook(model, log_fn=px.IdentityLog(), where=["blocks", "head"]).init(t), t)
    arrays, static = eqx.partition(model.blocks, eqx.is_array)

    @jax.jit
    def loss_with(deltas):
        # The model's scan unrolled by hand, `deltas` added to each selected layer's output:
        # the gradient at zero is every cotangent at once.
        x = jax.vmap(model.embed)(t)
        for i in range(3):
            x = eqx.combine(jax.tree.map(lambda a: a[i], arrays), static)(x) + deltas["blocks"][i]
        return loss_of(jax.vmap(model.head)(x) + deltas["head"])

    expected = jax.grad(loss_with)({"blocks": jnp.zeros((3, *t.shape, 8)), "head": jnp.zeros((*t.shape, 11))})
    assert set(grads.log) == set(expected)
    jax.tree.map(partial(close, tol=1e-4), grads.log, expected)


def test_derivatives_around_the_backward_pass_see_the_slots_as_perturbations():
    # jax.hessian, or the gradient of a function of the cotangents: a cotangent log's slot
    # is differentiated like a perturbation of the layer's output, at every order.
    model = MLP(3, 4, 2, key=jax.random.key(1))
    x = jnp.linspace(-1.0, 1.0, 3)
    hooked = px.BackwardHook(model, log_fn=px.IdentityLog(), where="linear1").init(x)

    def perturbed(model, delta):
        return loss_of(model.linear2(jax.nn.relu(model.linear1(x) + delta)))

    zero = jnp.zeros(4)
    hessian = jax.hessian(lambda log: loss_of(eqx.tree_at(lambda h: h.log, hooked, log)(x)))(hooked.log)
    close(hessian["linear1"]["linear1"], jax.hessian(partial(perturbed, model))(zero))

    def outer(hooked):
        return jnp.sum(grads_of(hooked, x).log["linear1"] ** 2)

    def outer_expected(model, delta):
        return jnp.sum(jax.grad(partial(perturbed, model))(delta) ** 2)

    grads = eqx.filter_grad(outer)(hooked)
    close(grads.log["linear1"], jax.grad(partial(outer_expected, model))(zero))
    expected = eqx.filter_grad(outer_expected)(model, zero)
    jax.tree.map(close, eqx.filter(grads.model, eqx.is_array), eqx.filter(expected, eqx.is_array))


def test_derivatives_around_the_backward_pass_of_a_scanned_stack():
    model = transformer(num_blocks=3)
    t = tokens()
    hooked = px.BackwardHook(model, log_fn=px.IdentityLog(), where=["blocks.1", "head"]).init(t)
    arrays, static = eqx.partition(model.blocks, eqx.is_array)

    def loss_with(deltas):
        x = jax.vmap(model.embed)(t)
        for i in range(3):
            x = eqx.combine(jax.tree.map(lambda a: a[i], arrays), static)(x)
            x = x + deltas["blocks.1"] if i == 1 else x
        return loss_of(jax.vmap(model.head)(x) + deltas["head"])

    def of_cotangents(log):
        return sum(jnp.sum(jnp.cos(c)) for c in jax.tree.leaves(log))

    zeros = {"blocks.1": jnp.zeros((*t.shape, 8)), "head": jnp.zeros((*t.shape, 11))}
    expected = jax.jit(jax.grad(lambda d: of_cotangents(jax.grad(loss_with)(d))))(zeros)
    got = eqx.filter_jit(eqx.filter_grad(lambda h: of_cotangents(grads_of(h, t).log)))(hooked).log
    assert set(got) == set(expected)
    jax.tree.map(partial(close, tol=1e-4), got, expected)


def test_statistic_logs_of_cotangents():
    model = MLP(3, 4, 2, key=jax.random.key(1))
    x = jnp.linspace(-1.0, 1.0, 3)
    ident = grads_of(px.BackwardHook(model, log_fn=px.IdentityLog()).init(x), x)
    stats = grads_of(px.BackwardHook(model, log_fn=px.MeanStdLog()).init(x), x)
    close(stats.log["linear1"][0], jnp.mean(ident.log["linear1"]))
    close(stats.log["linear1"][1], jnp.std(ident.log["linear1"]))


# -- a layer fed inputs that do not vary over a vmap inside the model (issue 22, item 2) --
COEFFICIENTS = jnp.arange(1.0, 4.0)


class ClosedOver(eqx.Module):
    """The layer's input is closed over by the vmap body: it is the same for every example."""

    lin: eqx.nn.Linear

    def __call__(self, x):
        return jax.vmap(lambda c: self.lin(x) * c)(COEFFICIENTS)


class UnbatchedArgument(eqx.Module):
    """The layer's input is passed to the vmap unbatched (`in_axes=(None, 0)`)."""

    lin: eqx.nn.Linear

    def __call__(self, x):
        return jax.vmap(lambda x, c: self.lin(x) * c, in_axes=(None, 0))(x, COEFFICIENTS)


class AxisSize(eqx.Module):
    """No input of the vmap is batched at all (`in_axes=None, axis_size=3`)."""

    lin: eqx.nn.Linear

    def __call__(self, x):
        return jax.vmap(self.lin, in_axes=None, axis_size=3)(x) * COEFFICIENTS[:, None]


def _squared_loss_grads(hooked, x):
    return eqx.filter_grad(lambda h: jnp.sum(h(x) ** 2))(hooked)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "filter_jit"])
@pytest.mark.parametrize("model_type", [ClosedOver, UnbatchedArgument, AxisSize])
def test_backward_of_a_layer_fed_unbatched_inputs_inside_vmap_is_per_example(model_type, jit):
    lin = eqx.nn.Linear(3, 3, key=jax.random.key(1))
    x = jnp.linspace(-1.0, 1.0, 3)
    model = model_type(lin)
    grad_fn = eqx.filter_jit(_squared_loss_grads) if jit else _squared_loss_grads
    got = grad_fn(px.BackwardHook(model, log_fn=px.IdentityLog()).init(x), x)
    c = COEFFICIENTS
    # The formula: example i's output is lin(x) * c_i, so its cotangent is
    # 2 * c_i**2 * lin(x) (one row per example, not the batch sum).
    close(got.log["lin"], 2 * c[:, None] ** 2 * lin(x))
    # And `jax.vjp` of the sub-computation, with a separate copy of lin(x) per example.
    _, vjp = jax.vjp(lambda ys: jnp.sum((ys * c[:, None]) ** 2), jnp.broadcast_to(lin(x), (3, 3)))
    close(got.log["lin"], vjp(1.0)[0])
    # The model's own gradients are those of the plain model.
    plain = eqx.filter_grad(lambda m: jnp.sum(m(x) ** 2))(model)
    close(got.model.lin.weight, plain.lin.weight)
    with jax.checking_leaks():
        close(grad_fn(px.BackwardHook(model, log_fn=px.IdentityLog()).init(x), x).log["lin"], vjp(1.0)[0])

    # pre_hook=True: the cotangent of the layer's input, per example.
    got = grad_fn(px.BackwardHook(model, log_fn=px.IdentityLog(), pre_hook=True).init(x), x)
    _, vjp = jax.vjp(lambda xs: jnp.sum((jax.vmap(lin)(xs) * c[:, None]) ** 2), jnp.broadcast_to(x, (3, 3)))
    (ct,) = got.log["lin"]
    close(ct, vjp(1.0)[0])
    close(ct, 2 * c[:, None] ** 2 * (lin.weight.T @ lin(x))[None])


class Block(eqx.Module):
    lin: eqx.nn.Linear

    def __call__(self, x):
        return jnp.tanh(jnp.mean(jax.vmap(lambda c: self.lin(x) * c)(COEFFICIENTS), axis=0))


class UnbatchedInStack(eqx.Module):
    """A scanned stack of blocks, each calling its layer in a vmap on an unbatched input."""

    blocks: Block

    def __init__(self, key):
        keys = jax.random.split(key, 3)
        self.blocks = eqx.filter_vmap(lambda k: Block(eqx.nn.Linear(3, 3, key=k)))(keys)

    def __call__(self, x):
        arrays, static = eqx.partition(self.blocks, eqx.is_array)
        return jax.lax.scan(lambda x, a: (eqx.combine(a, static)(x), None), x, arrays)[0]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "filter_jit"])
def test_backward_of_unbatched_inputs_in_vmap_in_a_stack(jit):
    model = UnbatchedInStack(jax.random.key(0))
    x = jnp.linspace(-1.0, 1.0, 3)
    arrays, static = eqx.partition(model.blocks, eqx.is_array)

    def with_deltas(deltas):
        # The stack unrolled by hand, a separate delta added to each example's copy of
        # every step's lin(x): the gradient at zero is every per-example cotangent.
        h = x
        for i in range(3):
            block = eqx.combine(jax.tree.map(lambda a: a[i], arrays), static)
            h = jnp.tanh(jnp.mean((block.lin(h)[None] + deltas[i]) * COEFFICIENTS[:, None], axis=0))
        return loss_of(h)

    expected = jax.grad(with_deltas)(jnp.zeros((3, 3, 3)))
    grad_fn = eqx.filter_jit(grads_of) if jit else grads_of
    stack = grad_fn(px.BackwardHook(model, log_fn=px.IdentityLog(), where="blocks.lin").init(x), x)
    close(stack.log["blocks.lin"], expected)
    step = grad_fn(px.BackwardHook(model, log_fn=px.IdentityLog(), where="blocks.1.lin").init(x), x)
    close(step.log["blocks.1.lin"], expected[1])


def test_backward_of_unbatched_inputs_inside_scan_stays_per_step():
    lin = eqx.nn.Linear(3, 3, key=jax.random.key(1))
    x = jnp.linspace(-1.0, 1.0, 3)

    class Scanned(eqx.Module):
        lin: eqx.nn.Linear

        def __call__(self, x):
            return jax.lax.scan(lambda carry, c: (carry, self.lin(x) * c), 0.0, COEFFICIENTS)[1]

    for grad_fn in (_squared_loss_grads, eqx.filter_jit(_squared_loss_grads)):
        got = grad_fn(px.BackwardHook(Scanned(lin), log_fn=px.IdentityLog()).init(x), x)
        close(got.log["lin"], 2 * COEFFICIENTS[:, None] ** 2 * lin(x))


# -- integer leaves in backward logs (issue 22, item 10) --------------------------------
class WithIndex(eqx.Module):
    """Returns a float array and an integer one (as a VQ layer returns its codes)."""

    lin: eqx.nn.Linear

    def __call__(self, x):
        y = self.lin(x)
        return y, jnp.argmax(y)


class Quantised(eqx.Module):
    quantise: WithIndex
    head: eqx.nn.Linear

    def __call__(self, x):
        y, index = self.quantise(x)
        return self.head(y * (index + 1))


def test_integer_output_leaves_have_none_in_the_backward_log():
    keys = jax.random.split(jax.random.key(0), 2)
    model = Quantised(WithIndex(eqx.nn.Linear(3, 4, key=keys[0])), eqx.nn.Linear(4, 2, key=keys[1]))
    x = jnp.linspace(-1.0, 1.0, 3)
    y, index = model.quantise(x)
    _, vjp = jax.vjp(lambda y: loss_of(model.head(y * (index + 1))), y)
    hooked = px.BackwardHook(model, log_fn=px.IdentityLog()).init(x)
    for grad_fn in (grads_of, eqx.filter_jit(grads_of)):
        grads = grad_fn(hooked, x)
        ct, index_ct = grads.log["quantise"]
        assert index_ct is None
        close(ct, vjp(1.0)[0])
        close(grads.log["quantise.lin"], vjp(1.0)[0])
    # A hook edits the float leaves; a statistic log is None at the integer leaf too.
    halved = grads_of(px.BackwardHook(model, hook_fn=lambda ct: (0.5 * ct[0], ct[1]), where="quantise").init(x), x)
    plain = eqx.filter_grad(lambda m: loss_of(m(x)))(model)
    close(halved.model.quantise.lin.weight, 0.5 * plain.quantise.lin.weight)
    stats = grads_of(px.BackwardHook(model, log_fn=px.MeanLog(), where="quantise").init(x), x)
    assert stats.log["quantise"][1] is None
    close(stats.log["quantise"][0], jnp.mean(vjp(1.0)[0]))


def test_backward_log_fn_returning_integers_is_refused():
    model = Quantised(WithIndex(eqx.nn.Linear(3, 4, key=jax.random.key(0))), eqx.nn.Linear(4, 2, key=jax.random.key(1)))
    x = jnp.linspace(-1.0, 1.0, 3)
    with pytest.raises(px.HookError, match=r"log_fn at layer 'quantise' returns int32 values.*floating-point"):
        px.BackwardHook(model, log_fn=lambda ct: jnp.argmax(ct[0]), where="quantise").init(x)
    with pytest.raises(px.HookError, match=r"log_fn at layer 'head' returns bool values"):
        px.BackwardHook(model, log_fn=lambda ct: ct > 0, where="head").init(x)


class Embedded(eqx.Module):
    embed: eqx.nn.Embedding
    lin: eqx.nn.Linear

    def __call__(self, tokens):
        return jax.vmap(lambda t: self.lin(self.embed(t)))(tokens)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "filter_jit"])
def test_pre_hook_on_an_embedding_fed_token_ids(jit):
    keys = jax.random.split(jax.random.key(2), 2)
    model = Embedded(eqx.nn.Embedding(10, 4, key=keys[0]), eqx.nn.Linear(4, 2, key=keys[1]))
    tokens = jnp.array([1, 5, 3, 5])
    grad_fn = eqx.filter_jit(grads_of) if jit else grads_of
    grads = grad_fn(px.BackwardHook(model, log_fn=px.IdentityLog(), pre_hook=True).init(tokens), tokens)
    assert grads.log["embed"] == (None,)  # token ids have no cotangent
    embedded = jax.vmap(model.embed)(tokens)
    _, vjp = jax.vjp(lambda e: loss_of(jax.vmap(model.lin)(e)), embedded)
    (ct,) = grads.log["lin"]
    close(ct, vjp(1.0)[0])
    plain = eqx.filter_grad(lambda m: loss_of(m(tokens)))(model)
    close(grads.model.embed.weight, plain.embed.weight)
