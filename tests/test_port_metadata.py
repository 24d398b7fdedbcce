"""Ports through partitioning metadata and into abstract destinations (issue 23, items 1
and 2): linen's `nn.with_logical_partitioning` / `nn.with_partitioning` boxes and NNX
variables with sharding metadata are read through on the source and kept on the
destination; destinations built with `nnx.eval_shape` / `jax.eval_shape(init)` are
filled with concrete arrays, placed with the destination's shardings (checked on 8
simulated CPU devices in a subprocess)."""

import textwrap

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
from models import random_like, run_on_8_cpu_devices

VOCAB, D, MLP, HEADS = 13, 8, 16, 2
# Logical axis -> mesh axis, as a training setup declares them (the Flax lm1b port's
# `embed='model', mlp='data'`).
RULES = (("vocab", None), ("embed", "model"), ("mlp", "data"), ("heads", None), ("kv", None))
MESH_AXES = ("data", "model")


def _logical(init, *names):
    return nn.with_logical_partitioning(init, names)


class LinenLM(nn.Module):
    """A decoder-ish block with linen's default names and partitioned parameters."""

    @nn.compact
    def __call__(self, ids):
        x = nn.Embed(VOCAB, D, embedding_init=_logical(nn.initializers.normal(1.0), "vocab", "embed"))(ids)
        x = x + nn.MultiHeadDotProductAttention(
            num_heads=HEADS,
            qkv_features=D,
            # linen initialises a DenseGeneral's kernel flat, (in, heads * head_dim), and
            # reshapes it in its box: two names, as the Flax lm1b model gives them.
            kernel_init=_logical(nn.initializers.lecun_normal(), "embed", "kv"),
            out_kernel_init=_logical(nn.initializers.lecun_normal(), "kv", "embed"),
        )(x)
        h = nn.Dense(
            MLP,
            kernel_init=_logical(nn.initializers.lecun_normal(), "embed", "mlp"),
            bias_init=_logical(nn.initializers.zeros_init(), "mlp"),
        )(x)
        x = x + nn.Dense(D, kernel_init=_logical(nn.initializers.lecun_normal(), "mlp", "embed"))(nn.relu(h))
        # A plain `nn.Partitioned` box, named by mesh axes directly.
        return nn.LayerNorm(scale_init=nn.with_partitioning(nn.initializers.ones_init(), ("model",)))(x)


def _named(init, *names):
    return nnx.with_partitioning(init, names)


class NnxLM(nnx.Module):
    """The NNX twin, with its own names and sharding metadata on its variables."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, D, embedding_init=_named(nnx.initializers.normal(1.0), "vocab", "embed"),
                               rngs=rngs)
        self.attention = nnx.MultiHeadAttention(
            num_heads=HEADS,
            in_features=D,
            qkv_features=D,
            kernel_init=_named(nnx.initializers.lecun_normal(), "embed", "kv"),
            out_kernel_init=_named(nnx.initializers.lecun_normal(), "kv", "embed"),
            decode=False,
            rngs=rngs,
        )
        self.hidden = nnx.Linear(D, MLP, kernel_init=_named(nnx.initializers.lecun_normal(), "embed", "mlp"),
                                 bias_init=_named(nnx.initializers.zeros_init(), "mlp"), rngs=rngs)
        self.out = nnx.Linear(MLP, D, kernel_init=_named(nnx.initializers.lecun_normal(), "mlp", "embed"), rngs=rngs)
        self.norm = nnx.LayerNorm(D, scale_init=_named(nnx.initializers.ones_init(), "embed"), rngs=rngs)

    def __call__(self, ids):
        x = self.embed(ids)
        x = x + self.attention(x)
        x = x + self.out(nnx.relu(self.hidden(x)))
        return self.norm(x)


class LinenNoBias(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(MLP, use_bias=False, kernel_init=_logical(nn.initializers.lecun_normal(), "embed", "mlp"))(x)


class NnxHidden(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(D, MLP, kernel_init=_named(nnx.initializers.lecun_normal(), "embed", "mlp"),
                                 bias_init=_named(nnx.initializers.zeros_init(), "mlp"), rngs=rngs)

    def __call__(self, x):
        return self.hidden(x)


IDS = jnp.array([[1, 5, 2, 7], [3, 3, 12, 0]])
MAPPING = {
    "Embed_0": "embed",
    "MultiHeadDotProductAttention_0.query": "attention.query",
    "MultiHeadDotProductAttention_0.key": "attention.key",
    "MultiHeadDotProductAttention_0.value": "attention.value",
    "MultiHeadDotProductAttention_0.out": "attention.out",
    "MultiHeadDotProductAttention_0": "attention",
    "Dense_0": "hidden",
    "Dense_1": "out",
    "LayerNorm_0": "norm",
}
REVERSE = {b: a for a, b in MAPPING.items()}


def mesh(shape=(1, 1)):
    return jax.make_mesh(shape, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 2)


def is_box(x):
    return isinstance(x, nn.meta.AxisMetadata)


def box_metadata(variables):
    """Every linen variable's box type and metadata (`None` for an unboxed one)."""
    def describe(x):
        return (type(x).__name__, x.names, x.mesh, getattr(x, "rules", None)) if is_box(x) else None

    return jax.tree.map(describe, variables, is_leaf=is_box)


def nnx_metadata(module):
    """NNX path -> (variable type, metadata) of every variable."""
    return {
        path: (type(v).__name__, v.get_metadata())
        for path, v in nnx.graph.iter_graph(module)
        if isinstance(v, nnx.Variable)
    }


def leaves_are_concrete(tree):
    return all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(tree))


def linen_source(seed=0):
    """linen variables with boxes, drawn from the abstract init (no initialiser runs)."""
    return px.from_linen(LinenLM(), random_like(jax.eval_shape(LinenLM().init, jax.random.key(0), IDS), seed))


def nnx_source(seed=0):
    graphdef, state = nnx.split(nnx.eval_shape(lambda: NnxLM(nnx.Rngs(0))))
    return px.from_nnx(nnx.merge(graphdef, random_like(state, seed)))


@pytest.fixture
def in_mesh():
    with jax.set_mesh(mesh()), nn.logical_axis_rules(RULES):
        yield


def test_alignment_names_the_layers(in_mesh):
    alignment = px.align(linen_source(), nnx_source(), IDS)
    assert alignment.mapping == MAPPING


def test_linen_boxes_to_nnx_with_sharding_metadata(in_mesh):
    src = linen_source()
    assert isinstance(src.variables["params"]["Dense_0"]["kernel"], nn.LogicallyPartitioned)
    assert isinstance(src.variables["params"]["LayerNorm_0"]["scale"], nn.Partitioned)
    live = NnxLM(nnx.Rngs(1))  # eagerly sharded on the mesh, as NNX creates it there
    before = nnx_metadata(live)
    port = px.transfer_params(src, px.from_nnx(live), MAPPING, inputs=IDS)
    np.testing.assert_allclose(port(IDS), src(IDS), atol=1e-5)
    assert nnx_metadata(px.to_nnx(port)) == before
    assert nnx_metadata(live) == before  # the destination itself is not modified


def test_nnx_with_sharding_metadata_to_linen_boxes(in_mesh):
    src = nnx_source()
    dst = px.from_linen(LinenLM(), LinenLM().init(jax.random.key(1), IDS))
    port = px.transfer_params(src, dst, REVERSE, inputs=IDS)
    np.testing.assert_allclose(port(IDS), src(IDS), atol=1e-5)
    assert box_metadata(port.variables) == box_metadata(dst.variables)


def test_abstract_nnx_destination(in_mesh):
    abstract = nnx.eval_shape(lambda: NnxLM(nnx.Rngs(0)))
    assert not leaves_are_concrete(nnx.state(abstract))
    before = nnx_metadata(abstract)
    src = linen_source()
    assert px.align(src, px.from_nnx(abstract), IDS).mapping == MAPPING  # aligned abstractly too
    port = px.transfer_params(src, px.from_nnx(abstract), MAPPING, inputs=IDS)
    assert leaves_are_concrete(port.state)
    np.testing.assert_allclose(port(IDS), src(IDS), atol=1e-5)
    assert nnx_metadata(px.to_nnx(port)) == before


def test_abstract_linen_destination(in_mesh):
    abstract = jax.eval_shape(LinenLM().init, jax.random.key(0), IDS)
    src = nnx_source()
    assert px.align(src, px.from_linen(LinenLM(), abstract), IDS).mapping == REVERSE
    port = px.transfer_params(src, px.from_linen(LinenLM(), abstract), REVERSE, inputs=IDS)
    assert leaves_are_concrete(port.variables)
    np.testing.assert_allclose(port(IDS), src(IDS), atol=1e-5)
    assert box_metadata(port.variables) == box_metadata(abstract)


def test_abstract_destination_left_partly_abstract_is_refused(in_mesh):
    partial = {k: v for k, v in MAPPING.items() if k != "LayerNorm_0"}
    with pytest.raises(px.HookError, match=r"leaves 2 of its arrays without a value: state\.norm\.bias\.value"):
        px.transfer_params(linen_source(), px.from_nnx(nnx.eval_shape(lambda: NnxLM(nnx.Rngs(0)))), partial)


def test_abstract_source_is_refused(in_mesh):
    abstract = px.from_linen(LinenLM(), jax.eval_shape(LinenLM().init, jax.random.key(0), IDS))
    with pytest.raises(px.HookError, match=r"'Embed_0'.*the source is abstract"):
        px.transfer_params(abstract, nnx_source(), {"Embed_0": "embed"})


def test_abstract_destination_sharded_over_a_mesh_out_of_context_is_refused():
    with jax.set_mesh(mesh()), nn.logical_axis_rules(RULES):
        abstract = px.from_nnx(nnx.eval_shape(lambda: NnxLM(nnx.Rngs(0))))
        src = linen_source()
    with pytest.raises(px.HookError, match=r"'embed'.*abstract mesh.*jax\.set_mesh"):
        px.transfer_params(src, abstract, MAPPING)


class EquinoxLinear(eqx.Module):
    lin: eqx.nn.Linear

    def __init__(self, key):
        self.lin = eqx.nn.Linear(D, MLP, key=key)

    def __call__(self, x):
        return jax.vmap(self.lin)(x)


class NnxLinear(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(D, MLP, rngs=rngs)

    def __call__(self, x):
        return self.lin(x)


def test_abstract_equinox_destination():
    src = px.from_nnx(NnxLinear(nnx.Rngs(0)))
    abstract = eqx.filter_eval_shape(EquinoxLinear, jax.random.key(0))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, D)), jnp.float32)
    port = px.transfer_params(src, abstract, {"lin": "lin"}, inputs=x)
    assert leaves_are_concrete(port)
    np.testing.assert_allclose(port(x), src(x), atol=1e-5)


def haiku_net(ids):
    x = hk.Embed(VOCAB, D, name="embed")(ids)
    x = jax.nn.relu(hk.Linear(MLP, name="hidden")(x))
    return hk.LayerNorm(-1, True, True, name="norm")(hk.Linear(D, name="out")(x))


class NnxNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, D, embedding_init=_named(nnx.initializers.normal(1.0), "vocab", "embed"),
                               rngs=rngs)
        self.hidden = nnx.Linear(D, MLP, kernel_init=_named(nnx.initializers.lecun_normal(), "embed", "mlp"),
                                 rngs=rngs)
        self.out = nnx.Linear(MLP, D, rngs=rngs)
        self.norm = nnx.LayerNorm(D, epsilon=1e-5, rngs=rngs)  # Haiku's epsilon

    def __call__(self, ids):
        return self.norm(self.out(nnx.relu(self.hidden(self.embed(ids)))))


HAIKU_MAPPING = {"embed": "embed", "hidden": "hidden", "out": "out", "norm": "norm"}


def test_haiku_to_abstract_nnx_and_back_to_abstract_haiku(in_mesh):
    transformed = hk.without_apply_rng(hk.transform(haiku_net))
    shapes = jax.eval_shape(transformed.init, jax.random.key(0), IDS)
    src = px.from_haiku(transformed, random_like(shapes, 3))
    abstract = nnx.eval_shape(lambda: NnxNet(nnx.Rngs(0)))
    before = nnx_metadata(abstract)
    port = px.transfer_params(src, px.from_nnx(abstract), HAIKU_MAPPING, inputs=IDS)
    np.testing.assert_allclose(port(IDS), src(IDS), atol=1e-5)
    assert nnx_metadata(px.to_nnx(port)) == before
    back = px.transfer_params(port, px.from_haiku(transformed, shapes), HAIKU_MAPPING, inputs=IDS)
    assert leaves_are_concrete(back.params)
    np.testing.assert_allclose(back(IDS), src(IDS), atol=1e-5)


def batch_norm_net(x, training=False):
    return hk.BatchNorm(True, True, 0.9, eps=1e-5, name="bn")(hk.Linear(D, name="lin")(x), is_training=training)


class NnxBatchNorm(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.lin = nnx.Linear(MLP, D, rngs=rngs)
        self.bn = nnx.BatchNorm(D, epsilon=1e-5, use_running_average=True, rngs=rngs)

    def __call__(self, x):
        return self.bn(self.lin(x))


def test_abstract_haiku_destination_with_batch_norm_state():
    transformed = hk.without_apply_rng(hk.transform_with_state(batch_norm_net))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, MLP)), jnp.float32)
    params, state = jax.eval_shape(lambda key, x: transformed.init(key, x, True), jax.random.key(0), x)
    live = NnxBatchNorm(nnx.Rngs(0))
    live.bn.mean.set_value(jnp.linspace(-1.0, 1.0, D))
    live.bn.var.set_value(jnp.linspace(0.5, 2.0, D))
    src = px.from_nnx(live)
    port = px.transfer_params(src, px.from_haiku(transformed, params, state), {"lin": "lin", "bn": "bn"}, inputs=x)
    assert leaves_are_concrete((port.params, port.state))
    assert int(port.state["bn/~/mean_ema"]["counter"]) == 0  # a fresh moving average's count
    np.testing.assert_allclose(port(x)[0], src(x), atol=1e-5)


# Shardings need several devices: 8 simulated CPU devices, set before JAX starts, so in
# a subprocess. Every ported array must carry the sharding the destination declares:
# the linen logical names mapped by the rules onto the mesh, as the Flax team's lm1b
# port test asserts, and NNX's `out_sharding` likewise.
SHARDED = textwrap.dedent('''
    import haiku as hk
    import jax
    import flax.linen as nn
    import numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P
    import peex_interop as px
    from test_port_metadata import (
        D, IDS, MAPPING, REVERSE, RULES, HAIKU_MAPPING, LinenLM, LinenNoBias, NnxHidden, NnxLM, NnxNet,
        haiku_net, is_box, mesh, nnx_metadata, linen_source, nnx_source,
    )

    assert jax.device_count() == 8
    MESH = mesh((2, 4))

    def linen_shardings(variables):
        specs = nn.get_partition_spec(variables)
        return nn.logical_to_mesh_sharding(specs, MESH, RULES)

    def check(array, sharding, what):
        assert isinstance(array, jax.Array), what
        assert array.sharding.is_equivalent_to(sharding, array.ndim), (what, array.sharding, sharding)

    with jax.set_mesh(MESH), nn.logical_axis_rules(RULES):
        # linen -> NNX built abstractly under the mesh.
        src = linen_source()
        abstract = nnx.eval_shape(lambda: NnxLM(nnx.Rngs(0)))
        before = nnx_metadata(abstract)
        port = px.transfer_params(src, px.from_nnx(abstract), MAPPING, inputs=IDS)
        np.testing.assert_allclose(port(IDS), src(IDS), atol=1e-5)
        live = px.to_nnx(port)
        assert nnx_metadata(live) == before
        for path, v in nnx.graph.iter_graph(live):
            if isinstance(v, nnx.Param):
                want = NamedSharding(MESH, nnx.get_partition_spec(v).get_value())
                check(v.get_value(), want, path)
        kernel = live.hidden.kernel.get_value()
        assert kernel.sharding.spec == P("model", "data"), kernel.sharding
        # linen's own logical names map to the same shardings.
        linen_kernel = linen_shardings(src.variables)["params"]["Dense_0"]["kernel"]
        assert kernel.sharding.is_equivalent_to(linen_kernel, 2)
        print("linen -> abstract nnx")

        # NNX -> linen, abstract: every boxed array sharded as its box declares.
        src = nnx_source()
        abstract = jax.eval_shape(LinenLM().init, jax.random.key(0), IDS)
        port = px.transfer_params(src, px.from_linen(LinenLM(), abstract), REVERSE, inputs=IDS)
        np.testing.assert_allclose(port(IDS), src(IDS), atol=1e-5)
        for box in jax.tree.leaves(port.variables, is_leaf=is_box):
            if isinstance(box, nn.LogicallyPartitioned):
                check(box.value, nn.logical_to_mesh_sharding(P(*box.names), MESH, RULES), box.names)
            elif is_box(box):  # nn.Partitioned: mesh axes by name
                check(box.value, NamedSharding(MESH, P(*box.names)), box.names)
        scale = port.variables["params"]["LayerNorm_0"]["scale"]
        assert isinstance(scale, nn.Partitioned) and scale.value.sharding.spec == P("model")
        print("nnx -> abstract linen")

        # NNX -> linen initialised eagerly: its boxes declare shardings its arrays lack.
        port = px.transfer_params(src, px.from_linen(LinenLM(), LinenLM().init(jax.random.key(1), IDS)), REVERSE)
        kernel = port.variables["params"]["Dense_0"]["kernel"]
        check(kernel.value, NamedSharding(MESH, P("model", "data")), kernel.names)
        print("nnx -> linen")

        # A missing bias is a zero bias, sharded as the abstract destination's.
        x = np.ones((2, D), np.float32)
        src = px.from_linen(LinenNoBias(), LinenNoBias().init(jax.random.key(0), x))
        port = px.transfer_params(
            src, px.from_nnx(nnx.eval_shape(lambda: NnxHidden(nnx.Rngs(0)))), {"Dense_0": "hidden"}, inputs=x
        )
        check(px.to_nnx(port).hidden.bias.get_value(), NamedSharding(MESH, P("data")), "hidden.bias")
        print("zero bias")

        # Haiku keeps no metadata: its arrays go where the abstract destination's
        # ShapeDtypeStructs say.
        transformed = hk.without_apply_rng(hk.transform(haiku_net))
        shapes = jax.eval_shape(transformed.init, jax.random.key(0), IDS)
        placed = NamedSharding(MESH, P(None, "model"))
        shapes["hidden"]["w"] = jax.ShapeDtypeStruct(shapes["hidden"]["w"].shape, np.float32, sharding=placed)
        nnx_net = px.from_nnx(NnxNet(nnx.Rngs(2)))
        port = px.transfer_params(nnx_net, px.from_haiku(transformed, shapes), HAIKU_MAPPING, inputs=IDS)
        np.testing.assert_allclose(port(IDS), nnx_net(IDS), atol=1e-5)
        check(port.params["hidden"]["w"], placed, "hidden/w")
        print("nnx -> abstract haiku")
''')


def test_ports_carry_the_destination_shardings_on_8_cpu_devices():
    lines = run_on_8_cpu_devices(SHARDED)
    assert lines == [
        "linen -> abstract nnx", "nnx -> abstract linen", "nnx -> linen", "zero bias", "nnx -> abstract haiku",
    ]
