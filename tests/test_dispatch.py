"""Jitted steps of converted models: a model updated by a step (new parameters, the NNX
state a call returns) keys jit's cache like the model it came from, so each step runs
the compiled trace (no retrace) and computes what the library's own step computes.
(Dispatch speed itself is measured in the benchmarks, not here.)"""

import pytest

pytest.importorskip("haiku")  # skipped where the [haiku] extra is not installed
pytest.importorskip("flax")  # skipped where the [flax] extra is not installed

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
from flax import nnx

import peex_interop as px
from models import close

X = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)


def counted_step():
    """A jitted `model(x)` and the list its traces append to."""
    traces = []

    @jax.jit
    def step(model, x):
        traces.append(None)
        return model(x)

    return step, traces


def shifted(tree):
    return jax.tree.map(lambda a: a + 0.5, tree)


def test_haiku_step_after_update_reuses_trace():
    transformed = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP([5, 2])(x)))
    params = transformed.init(jax.random.key(0), X)
    step, traces = counted_step()
    converted = px.from_haiku(transformed, params)
    close(step(converted, X), transformed.apply(params, X))
    updated = eqx.tree_at(lambda m: m.params, converted, shifted(params))
    close(step(updated, X), transformed.apply(shifted(params), X))
    assert len(traces) == 1


def test_linen_step_after_update_reuses_trace():
    module = nn.Sequential([nn.Dense(5), nn.relu, nn.Dense(2)])
    variables = module.init(jax.random.key(0), X)
    step, traces = counted_step()
    converted = px.from_linen(module, variables)
    close(step(converted, X), module.apply(variables, X))
    updated = converted.with_variables(shifted(variables))
    close(step(updated, X), module.apply(shifted(variables), X))
    assert len(traces) == 1


def test_function_step_after_update_reuses_trace():
    def dense(p, x):
        return x @ p["w"] + p["b"]

    def model(params, x):
        return dense(params[1], jax.nn.relu(dense(params[0], x)))

    params = [{"w": jnp.full((3, 5), 0.1), "b": jnp.zeros(5)}, {"w": jnp.full((5, 2), 0.2), "b": jnp.ones(2)}]
    step, traces = counted_step()
    converted = px.from_function(model, params, layers=[dense])
    close(step(converted, X), model(params, X))
    updated = eqx.tree_at(lambda m: m.params, converted, shifted(params))
    close(step(updated, X), model(shifted(params), X))
    assert len(traces) == 1


class Normed(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(3, 2, rngs=rngs)
        self.norm = nnx.BatchNorm(2, rngs=rngs)

    def __call__(self, x):
        return self.norm(self.linear(x))


def test_nnx_state_returned_by_steps_keeps_graph_definition():
    # BatchNorm in training mode: each step updates the running statistics.
    reference = Normed(nnx.Rngs(0))
    converted = px.from_nnx(reference, return_state=True)
    step, traces = counted_step()
    model = converted
    for _ in range(3):
        output, model = step(model, X)
        close(output, reference(X))
        # jit compares the graph definitions of consecutive steps by identity.
        assert model.graphdef is converted.graphdef
    restored = px.to_nnx(model)
    assert isinstance(restored, Normed)
    close(restored.norm.mean.get_value(), reference.norm.mean.get_value())
    assert len(traces) == 1
