"""peex 0.0.3 call conventions and numbers, checked against the seed and against peex."""

import os
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import peex
import pytest

import peex_interop as px
from models import MLP


def seed_model():
    # JAX's default lowering of random draws, which the suite changes (conftest.py).
    with jax.threefry_partitionable(True):
        mlp_key, x_key = jax.random.split(jax.random.key(0), 2)
        return MLP(1, 2, 1, key=mlp_key), jax.random.normal(x_key, shape=(1,))


def forward(hooked, x):
    return hooked(x)


@eqx.filter_value_and_grad
def grad_loss(hooked, x):
    return jnp.mean(hooked(x))


def test_seed_readme_numbers():
    # Printed by XLA compiled with its default optimisations, which the suite turns off
    # (conftest.py): checked in a process of its own, compiled as users compile.
    env = {name: value for name, value in os.environ.items() if name != "JAX_DISABLE_MOST_OPTIMIZATIONS"}
    code = "import test_peex_compat as t; t.check_seed_readme_numbers(False); t.check_seed_readme_numbers(True)"
    here = Path(__file__).parent
    run = subprocess.run([sys.executable, "-c", code], cwd=here, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def check_seed_readme_numbers(jit):
    assert "JAX_DISABLE_MOST_OPTIMIZATIONS" not in os.environ  # compiled as users compile
    mlp, x = seed_model()
    run = eqx.filter_jit(forward) if jit else forward
    grad = eqx.filter_jit(grad_loss) if jit else grad_loss

    def expect(actual, printed):
        # XLA's releases round the last digit differently (jaxlib 0.12.1 computes the
        # README's 0.23334768 as 0.23334733, unhooked): exact against the unhooked
        # model below, to the last digit against the README.
        np.testing.assert_allclose(actual, np.asarray(printed, np.float32), rtol=0, atol=1e-6)

    output, log = run(px.ForwardHook(mlp, hook_fn=px.IdentityHook(), log_fn=px.IdentityLog()), x)
    if not jit:
        np.testing.assert_array_equal(output, mlp(x))
        np.testing.assert_array_equal(log["linear1"], mlp.linear1(x))
    expect(output, [0.23334768])
    expect(log["linear1"], [1.2571917, 1.2331474])
    expect(log["linear2"], [0.23334768])

    hooked = px.BackwardHook(mlp, hook_fn=px.IdentityHook(), log_fn=px.IdentityLog()).init(x)
    _, grads = grad(hooked, x)
    if not jit:
        rest = jax.grad(lambda h: jnp.mean(mlp.linear2(jax.nn.relu(h))))(mlp.linear1(x))
        np.testing.assert_array_equal(grads.log["linear1"], rest)
    expect(grads.log["linear1"], [-0.68400913, 0.4777369])
    expect(grads.log["linear2"], [1.0])
    assert isinstance(grads.model, MLP)


class Double(px.AbstractHook):
    def __call__(self, args):
        return jax.tree.map(lambda a: 2 * a, args)


CONFIGS = [
    dict(log_fn="MeanLog"),
    dict(log_fn="MeanStdLog"),
    dict(log_fn="IdentityLog", hook_fn=Double()),
    dict(log_fn="IdentityLog", pre_hook=True),
    dict(log_fn="IdentityLog", pre_hook=True, hook_fn=Double(), layer_names=["linear2"]),
    dict(log_fn="NoneLog", hook_fn=Double()),
]


@pytest.mark.parametrize("config", CONFIGS)
def test_forward_matches_peex(config):
    mlp = MLP(3, 5, 2, key=jax.random.key(3))
    x = jax.random.normal(jax.random.key(4), (3,))
    ours_cfg = {**config, "log_fn": getattr(px, config["log_fn"])()}
    # peex exports no NoneLog; its default log_fn is one.
    theirs_cfg = {**config, "log_fn": getattr(peex, config["log_fn"], peex.IdentityLog)()}
    if config["log_fn"] == "NoneLog":
        del theirs_cfg["log_fn"]
    out, log = px.ForwardHook(mlp, **ours_cfg)(x)
    ref_out, ref_log = peex.ForwardHook(mlp, **theirs_cfg)(x)
    np.testing.assert_array_equal(out, ref_out)
    assert jax.tree.structure(log) == jax.tree.structure(ref_log)
    jax.tree.map(np.testing.assert_array_equal, log, ref_log)


@pytest.mark.parametrize("config", CONFIGS[:3] + CONFIGS[4:5])
def test_backward_matches_peex(config):
    mlp = MLP(3, 5, 2, key=jax.random.key(3))
    x = jax.random.normal(jax.random.key(4), (3,))
    ours_cfg = {**config, "log_fn": getattr(px, config["log_fn"])()}
    theirs_cfg = {**config, "log_fn": getattr(peex, config["log_fn"])()}

    @eqx.filter_grad
    def loss(hooked, x):
        return jnp.sum(jnp.sin(hooked(x)))

    ours = loss(px.BackwardHook(mlp, **ours_cfg).init(x), x)
    theirs = loss(peex.BackwardHook(mlp, **theirs_cfg).init(x), x)
    jax.tree.map(np.testing.assert_allclose, ours.log, theirs.log)
    jax.tree.map(
        np.testing.assert_allclose, eqx.filter(ours.model, eqx.is_array),
        eqx.filter(theirs.model, eqx.is_array),
    )


@pytest.mark.parametrize("layer_names", [None, ["linear1"], ["linear2", "linear1"]])
def test_peex_wrappers_keep_the_layer_names_given(layer_names):
    from peex_interop import peex as compat

    mlp = MLP(3, 5, 2, key=jax.random.key(3))
    x = jax.random.normal(jax.random.key(4), (3,))
    forward = compat.ForwardHook(mlp, log_fn=compat.IdentityLog(), layer_names=layer_names)
    backward = compat.BackwardHook(mlp, log_fn=compat.IdentityLog(), layer_names=layer_names)
    theirs = peex.BackwardHook(mlp, log_fn=peex.IdentityLog(), layer_names=layer_names)
    assert forward.layer_names == peex.ForwardHook(mlp, layer_names=layer_names).layer_names == layer_names
    assert backward.layer_names == theirs.layer_names == layer_names
    assert backward.init(x).layer_names == theirs.init(x).layer_names == layer_names
    # Still the selection: only the layers named are logged, also under jit.
    _, log = eqx.filter_jit(lambda hooked, x: hooked(x))(forward, x)
    assert set(log) == set(layer_names or ["linear1", "linear2"])
