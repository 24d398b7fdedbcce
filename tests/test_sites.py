"""`px.sites` against the logs hooks actually produce (keys, shapes and dtypes of inputs
and outputs, stacked axes) on the test suite's models of every library, `px.summary`'s
stacks and totals, and the refusal of models the library cannot hook."""


import pytest

pytest.importorskip("haiku")  # skipped where the [haiku] extra is not installed
pytest.importorskip("flax")  # skipped where the [flax] extra is not installed

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from flax import nnx

import peex_interop as px
import test_haiku
import test_linen
import test_nnx
from models import MLP, Deep, tokens, transformer
from test_depth import Twice
from test_diagnostics import EqxNet, haiku_net
from test_matrix_equinox import CASES, LAYER, XS, Host, Outer
from test_transforms import Inside


def dense(params, x):
    return x @ params["w"] + params["b"]


def scanned_net(params, x):
    """A hand-written function model: a layer, a scanned stack of 3, a head."""
    h, _ = jax.lax.scan(lambda h, p: (jnp.tanh(dense(p, h)), None), dense(params["inp"], x), params["blocks"])
    return dense(params["head"], h)


def function_model():
    rng = np.random.default_rng(0)
    layer = lambda *shape: {"w": jnp.asarray(rng.normal(size=shape), jnp.float32), "b": jnp.zeros(shape[-1])}
    blocks = {"w": jnp.asarray(rng.normal(size=(3, 4, 4)), jnp.float32), "b": jnp.zeros((3, 4))}
    params = {"inp": layer(3, 4), "blocks": blocks, "head": layer(4, 2)}
    return px.from_function(scanned_net, params, layers={dense: "linear"}), (jnp.ones((2, 3)),), {}


def haiku_model(name):
    _, _, model, x = test_haiku.convert(name)
    return model, (x,), {}


def nnx_model(name):
    model, x = test_nnx.make(name)
    return px.from_nnx(model), (x,), {}


_linen_built = test_linen._Built()


def linen_model(name):
    module, variables, x, kwargs = _linen_built[name]
    return test_linen.convert(module, variables, kwargs), (x,), kwargs


def equinox_model(name):
    key = jax.random.key(0)
    return {
        "mlp": lambda: (MLP(3, 4, 2, key=key), (jnp.ones(3),), {}),
        "deep": lambda: (Deep(key=key), (jnp.ones(3),), {}),
        "transformer": lambda: (transformer(), (tokens(),), {}),
        "attention": lambda: (eqx.nn.MultiheadAttention(2, 4, key=key), (jnp.ones((5, 4)),) * 3, {}),
        "conv_norm": lambda: (EqxNet(key), (jnp.ones((1, 8, 8)),), {}),
        "repeated": lambda: (Twice(eqx.nn.Linear(3, 3, key=key)), (jnp.ones(3),), {}),
        "transforms_inside": lambda: (Inside(key), (jnp.ones(3),), {}),
    }[name]()


def matrix_model(name):
    return Outer(Host(LAYER, name), nested=True), (XS,), {}


# Refused by hooks (see test_matrix_equinox): not a case of agreement.
THREADED = sorted(name for name, case in CASES.items() if case.reference is not None and not case.refused_under_jit)
MODELS = {
    **{f"equinox-{n}": (equinox_model, n) for n in (
        "mlp", "deep", "transformer", "attention", "conv_norm", "repeated", "transforms_inside")},
    **{f"equinox-in-{n}": (matrix_model, n) for n in THREADED},
    **{f"haiku-{n}": (haiku_model, n) for n in sorted(test_haiku.MODELS)},
    # Every Haiku and NNX model of their tests (but one of two modes of a CNN), and the
    # linen models with layers the others lack (lifted transforms, cells, attention).
    **{f"nnx-{n}": (nnx_model, n) for n in sorted(test_nnx.MODELS) if n != "cnn_eval"},
    **{f"linen-{n}": (linen_model, n) for n in ("cnn_train", "lifted", "recurrent", "transformer")},
    "function-scanned": (lambda _: function_model(), None),
}


def make(name):
    build, arg = MODELS[name]
    return build(arg)


def identity_logs(model, args, kwargs):
    """The logs of an IdentityLog on every layer, outputs and (`key:in`) inputs, as
    shapes: what `eqx.filter_eval_shape` of the hooked call returns."""
    hooked = px.ForwardHook(model, log_fn=px.IdentityLog(), pre_log_fn=px.IdentityLog())
    return eqx.filter_eval_shape(lambda h, a, k: h(*a, **k)[1], hooked, args, kwargs)


def assert_logged_like(site_values, lengths, logged):
    """`logged` is `site_values` (one call's) with the enclosing mapped axes in front."""
    arrays = lambda tree: jtu.tree_flatten(tree, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    (site_leaves, site_tree), (log_leaves, log_tree) = arrays(site_values), arrays(logged)
    assert site_tree == log_tree
    for site, log in zip(site_leaves, log_leaves):
        if isinstance(site, jax.ShapeDtypeStruct):
            assert (log.shape, log.dtype) == (lengths + site.shape, site.dtype)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_sites_agree_with_the_keys_and_shapes_identity_logs_produce(name):
    model, args, kwargs = make(name)
    rows = px.sites(model, *args, **kwargs)
    logs = identity_logs(model, args, kwargs)
    assert {row.key for row in rows} | {f"{row.key}:in" for row in rows} == set(logs)
    assert all(row.hookable for row in rows)
    for row in rows:
        assert_logged_like(row.output, row.lengths, logs[row.key])
        assert_logged_like((row.args, row.kwargs), row.lengths, logs[f"{row.key}:in"])
        assert row.key == (row.path if row.call == 0 else f"{row.path}@{row.call}")
        assert row.calls == sum(r.path == row.path for r in rows) > row.call
        assert all(0 <= level < len(row.lengths) for level in row.stacks)
    # A backward log has one slot per site too, shaped like the forward log.
    slots = px.BackwardHook(model, log_fn=px.IdentityLog()).init(*args, **kwargs).log
    assert set(slots) == {row.key for row in rows}
    for row in rows:
        assert_logged_like(row.output, row.lengths, slots[row.key])


def test_sites_of_the_scanned_transformer_against_an_eager_log():
    model, x = transformer(), tokens()
    with jax.checking_leaks():
        rows = {row.key: row for row in px.sites(model, x)}
        _, log = eqx.filter_jit(lambda m, x: px.ForwardHook(m, log_fn=px.IdentityLog())(x))(model, x)
    assert set(rows) == set(log)
    # blocks.*: 3 stacked layers (the scan), each run per position (5) by the block's vmap.
    norm = rows["blocks.norm1"]
    assert (norm.lengths, norm.stacks, norm.stack_length) == ((3, 5), (0,), 3)
    assert norm.args == (jax.ShapeDtypeStruct((8,), jnp.float32),) and norm.output_shapes == ((8,),)
    assert log["blocks.norm1"].shape == (3, 5, 8)
    assert (rows["blocks"].lengths, rows["blocks"].stacks) == ((3,), (0,))
    assert (norm.step_path, rows["head"].step_path) == ("blocks.{i}.norm1", "head")
    assert rows["blocks.attn"].input_shapes == ((5, 8),) * 3
    assert (rows["embed"].lengths, rows["embed"].stacks, rows["embed"].args[0].dtype) == ((5,), (), jnp.int32)
    # One layer's parameters (an 8 -> 16 -> 8 MLP), of one of the 3 in the stack.
    assert rows["blocks.mlp"].trainable == 8 * 16 + 16 + 16 * 8 + 8
    assert [rows[k].stack_length for k in ("embed", "head")] == [1, 1]


def test_repeated_calls_are_counted():
    model, args, _ = equinox_model("repeated")
    rows = px.sites(model, *args)
    assert [(r.key, r.call, r.calls) for r in rows] == [("lin", 0, 2), ("lin@1", 1, 2)]


def top_level(rows):
    """First calls of the layers that are inside no other listed layer."""
    paths = {row.path for row in rows}
    inside = lambda path: any(path.startswith(f"{other}.") for other in paths)
    return [row for row in rows if row.call == 0 and not inside(row.path)]


@pytest.mark.parametrize(
    "name, stacked",
    [
        ("equinox-transformer", {"blocks": 3}),
        ("haiku-layer_stack", {"lin": 3}),
        ("nnx-stack", {"blocks": 3, "heads": 2}),  # the scanned stack, the vmapped ensemble
        ("linen-lifted", {"blocks": 3, "ens": 2}),
        ("function-scanned", {"blocks": 3}),
    ],
)
def test_summary_marks_stacks_and_its_top_level_rows_add_up_to_the_total(name, stacked):
    model, args, kwargs = make(name)
    table = px.summary(model, *args, **kwargs)
    top = top_level(table.rows)
    assert {row.path: row.stack_length for row in top if row.stacks} == stacked
    assert sum(row.trainable * row.stack_length for row in top) == table.total[0] == px.total_params(model)[0]
    text = str(table)
    for path, n in stacked.items():
        line = next(line for line in text.splitlines() if line.startswith(f"{path} "))
        row = next(row for row in top if row.path == path)
        assert f"x{n}" in line and f"{row.trainable * n:,}" in line


def test_summary_of_the_scanned_transformer_adds_up_and_shows_input_shapes():
    model = transformer()
    text = str(px.summary(model, tokens()))
    printed = {line.split()[0]: line for line in text.splitlines()[2:-1]}
    params = lambda path: int(printed[path].split()[-2].replace(",", ""))
    size = lambda layer: sum(a.size for a in jax.tree.leaves(eqx.filter(layer, eqx.is_array)))
    # The blocks' row counts all 3 stacked blocks; the printed top-level rows add up.
    assert "x3" in printed["blocks"] and params("blocks") == size(model.blocks)
    total = params("embed") + params("blocks") + params("head")
    assert total == size(model) and f"{total:,} trainable" in text
    assert "(5, 8), (5, 8), (5, 8)" in printed["blocks.attn"]  # query, key and value


@pytest.mark.parametrize("name", sorted(name for name, case in CASES.items() if case.reference is None))
def test_calls_that_hooks_refuse_are_listed_as_not_hookable_or_refused_alike(name):
    model, x = Outer(Host(LAYER, name), nested=False), XS[0]
    hooked = px.ForwardHook(model, log_fn=px.IdentityLog(), where="host.layer")
    with pytest.raises(px.TransformError, match=r"host\.layer|Linear"):
        hooked(x)
    assert [(r.key, r.hookable) for r in px.sites(model, x)] == [("host.layer", False), ("host", True)]
    assert "not hookable" in str(px.summary(model, x))


class NnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(3, 2, rngs=rngs)

    def __call__(self, x):
        return self.lin(x)


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2)(x)


@pytest.mark.parametrize(
    "model, hint",
    [
        (NnxMLP(nnx.Rngs(0)), "px.from_nnx"),
        (hk.transform(haiku_net), "px.from_haiku"),
        (LinenMLP(), "px.from_linen"),
        (scanned_net, "px.from_function"),
    ],
    ids=["nnx", "haiku", "linen", "function"],
)
@pytest.mark.parametrize("listing", [px.sites, px.summary, px.module_paths])
def test_a_model_the_library_cannot_hook_is_refused_with_the_conversion_hint(listing, model, hint):
    arguments = () if listing is px.module_paths else (jnp.ones((1, 3)),)
    with pytest.raises(TypeError, match=rf"{listing.__name__}: .*{type(model).__qualname__}.*{hint}"):
        listing(model, *arguments)


def test_sites_take_shapes_and_keep_no_tracers():
    # Arguments may be shapes only; every array in a row is a shape, outside any trace.
    model = transformer()
    rows = px.sites(model, jax.ShapeDtypeStruct((5,), jnp.int32))
    assert rows == px.sites(model, tokens())
    leaves = jax.tree.leaves([(r.args, r.kwargs, r.output) for r in rows])
    assert leaves and all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves)
