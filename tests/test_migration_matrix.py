"""The migration matrix: every layer kind `px.transfer_params` maps, in all six
directions between Equinox, Haiku and Flax NNX. After `align` + `transfer_params` the
two models agree layer by layer (1e-5; 1e-4 for recurrent cells over 8 steps), checked
here independently of the transfer's own verification."""

import equinox as eqx
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import peex_interop as px
from peex_interop._engine import AbstractConverted

# A cycle through the libraries: each is read once and written once per kind. A
# transfer reads the source's layout (named axes and facts), converts it by names alone
# (`_layouts.convert`, the same code for every pair) and writes it: every pair is one
# of these reads and one of these writes (all six ordered pairs took twice the time).
DIRECTIONS = [
    ("equinox", "haiku"),
    ("haiku", "nnx"),
    ("nnx", "equinox"),
]


def perturbed(model, seed):
    """Every float array moved away from its initial value (norm scales of 1, zero
    offsets and statistics would make a skipped transfer look right); positive shifts
    keep variances positive."""
    arrays, rest = eqx.partition(model, eqx.is_inexact_array)
    leaves, tree = jax.tree.flatten(arrays)
    rng = np.random.default_rng(seed)  # NumPy: no compilation per array shape
    leaves = [
        jnp.asarray(np.asarray(x) * rng.uniform(0.7, 1.3, x.shape) + rng.uniform(0, 0.3, x.shape), x.dtype)
        for x in leaves
    ]
    return eqx.combine(jax.tree.unflatten(tree, leaves), rest)


def haiku(fn, x, *, stateful=False, **init_kwargs):
    transformed = hk.transform_with_state(fn) if stateful else hk.transform(fn)
    transformed = hk.without_apply_rng(transformed)
    if stateful:
        params, state = transformed.init(jax.random.key(7), x, **init_kwargs)
        return px.from_haiku(transformed, params, state)
    return px.from_haiku(transformed, transformed.init(jax.random.key(7), x))


def output(model, x):
    out = model(x)
    return out[0] if isinstance(model, px.HaikuModule) and model.stateful else out


# -- one small network per kind, written natively in each library ---------------------


class EqxBatched(eqx.Module):
    """Equinox layers see one example: vmap over the batch (and channels first)."""

    layer: eqx.Module
    channels_first: bool = eqx.field(static=True, default=False)

    def __call__(self, x):
        def one(x):
            if self.channels_first:
                return jnp.moveaxis(self.layer(jnp.moveaxis(x, -1, 0)), 0, -1)
            return self.layer(x)

        return jax.vmap(one)(x)


class NnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.first = nnx.Linear(4, 6, rngs=rngs)
        self.second = nnx.Linear(6, 3, rngs=rngs)

    def __call__(self, x):
        return self.second(jax.nn.relu(self.first(x)))


def mlp():
    x = jax.random.normal(jax.random.key(0), (3, 4))
    return x, {
        "equinox": EqxBatched(eqx.nn.MLP(4, 3, 6, depth=1, activation=jax.nn.relu, key=jax.random.key(1))),
        "haiku": haiku(lambda x: hk.nets.MLP([6, 3])(x), x),
        "nnx": px.from_nnx(NnxMLP(nnx.Rngs(2))),
    }


class NnxOne(nnx.Module):
    def __init__(self, layer):
        self.layer = layer

    def __call__(self, x):
        return self.layer(x)


def conv(dims):
    def build():
        shape = (2,) + (5,) * dims + (4,)
        x = jax.random.normal(jax.random.key(0), shape)
        window = (3,) * dims
        return x, {
            "equinox": EqxBatched(
                eqx.nn.Conv(dims, 4, 6, 3, padding=1, groups=2, key=jax.random.key(1)), channels_first=True
            ),
            "haiku": haiku(lambda x: hk.ConvND(dims, 6, 3, feature_group_count=2, name="conv")(x), x),
            "nnx": px.from_nnx(NnxOne(nnx.Conv(4, 6, window, feature_group_count=2, rngs=nnx.Rngs(2)))),
        }

    return build


def conv_transpose(dims, kernel, stride, padding, output_padding, transpose_kernel):
    """The same transposed convolution in each library: Equinox's `padding` is the
    forward conv's, Haiku's and NNX's pairs pad the dilated input, (k-1-p, k-1-p+a)."""

    def build():
        x = jax.random.normal(jax.random.key(0), (2,) + (5,) * dims + (4,))
        pairs = [(kernel - 1 - padding, kernel - 1 - padding + output_padding)] * dims
        layer = lambda x: hk.ConvNDTranspose(dims, 6, kernel, stride, padding=pairs, name="deconv")(x)
        return x, {
            "equinox": EqxBatched(
                eqx.nn.ConvTranspose(
                    dims, 4, 6, kernel, stride, padding=padding, output_padding=output_padding, key=jax.random.key(1)
                ),
                channels_first=True,
            ),
            "haiku": haiku(layer, x),
            "nnx": px.from_nnx(NnxOne(nnx.ConvTranspose(
                4, 6, (kernel,) * dims, strides=stride, padding=pairs, transpose_kernel=transpose_kernel,
                rngs=nnx.Rngs(2),
            ))),
        }

    return build


class EqxEmbedNorm(eqx.Module):
    embed: eqx.nn.Embedding
    norm: eqx.Module

    def __call__(self, tokens):
        return jax.vmap(jax.vmap(lambda t: self.norm(self.embed(t))))(tokens)


class NnxEmbedNorm(nnx.Module):
    def __init__(self, norm, rngs):
        self.embed = nnx.Embed(11, 6, rngs=rngs)
        self.norm = norm

    def __call__(self, tokens):
        return self.norm(self.embed(tokens))


def embed_norm(norm):
    def build():
        tokens = jax.random.randint(jax.random.key(0), (2, 5), 0, 11)
        if norm == "layer":
            hk_norm = lambda: hk.LayerNorm(-1, True, True, name="norm")
            eqx_norm, nnx_norm = eqx.nn.LayerNorm(6), nnx.LayerNorm(6, epsilon=1e-5, rngs=nnx.Rngs(3))
        else:
            hk_norm = lambda: hk.RMSNorm(-1, name="norm")
            eqx_norm, nnx_norm = eqx.nn.RMSNorm(6, use_bias=False), nnx.RMSNorm(6, epsilon=1e-5, rngs=nnx.Rngs(3))
        return tokens, {
            "equinox": EqxEmbedNorm(eqx.nn.Embedding(11, 6, key=jax.random.key(1)), eqx_norm),
            "haiku": haiku(lambda t: hk_norm()(hk.Embed(11, 6, name="embed")(t)), tokens),
            "nnx": px.from_nnx(NnxEmbedNorm(nnx_norm, nnx.Rngs(2))),
        }

    return build


class EqxBatchNorm(eqx.Module):
    """Equinox BatchNorm in inference mode, its State held in the model."""

    linear: eqx.nn.Linear
    bn: eqx.nn.BatchNorm
    state: eqx.nn.State

    def __call__(self, x):
        h = jax.vmap(self.linear)(x)
        return jax.vmap(lambda h: self.bn(h, self.state)[0])(h)


class NnxBatchNorm(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(4, 5, rngs=rngs)
        self.bn = nnx.BatchNorm(5, use_running_average=True, epsilon=1e-5, rngs=rngs)

    def __call__(self, x):
        return self.bn(self.linear(x))


def batch_norm():
    x = jax.random.normal(jax.random.key(0), (3, 4))

    def haiku_fn(x, is_training=False):
        return hk.BatchNorm(True, True, 0.9, name="bn")(hk.Linear(5, name="linear")(x), is_training=is_training)

    linear = eqx.nn.Linear(4, 5, key=jax.random.key(1))
    bn, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(5, "batch", mode="ema", inference=True)
    return x, {
        "equinox": EqxBatchNorm(linear, bn, state),
        "haiku": haiku(haiku_fn, x, stateful=True, is_training=True),
        "nnx": px.from_nnx(NnxBatchNorm(nnx.Rngs(2))),
    }


class EqxAttention(eqx.Module):
    attn: eqx.nn.MultiheadAttention

    def __call__(self, x):
        return jax.vmap(lambda x: self.attn(x, x, x))(x)


class NnxAttention(nnx.Module):
    def __init__(self, bias, rngs):
        self.attn = nnx.MultiHeadAttention(
            num_heads=2, in_features=8, qkv_features=8, use_bias=bias, decode=False, rngs=rngs
        )

    def __call__(self, x):
        return self.attn(x)


def attention(bias):
    def build():
        x = jax.random.normal(jax.random.key(0), (2, 5, 8))
        flags = dict(use_query_bias=bias, use_key_bias=bias, use_value_bias=bias, use_output_bias=bias)
        mha = lambda x: hk.MultiHeadAttention(
            2, 4, w_init=hk.initializers.VarianceScaling(), with_bias=bias, name="mha"
        )(x, x, x)
        return x, {
            "equinox": EqxAttention(eqx.nn.MultiheadAttention(2, 8, key=jax.random.key(1), **flags)),
            "haiku": haiku(mha, x),
            "nnx": px.from_nnx(NnxAttention(bias, nnx.Rngs(2))),
        }

    return build


class EqxScan(eqx.Module):
    """A stack built with `eqx.filter_vmap`, one block per `jax.lax.scan` step; each
    block takes the whole batch."""

    blocks: eqx.Module

    def __call__(self, x):
        arrays, static = eqx.partition(self.blocks, eqx.is_array)
        return jax.lax.scan(lambda x, arrays: (eqx.combine(arrays, static)(x), None), x, arrays)[0]


def eqx_scan(block, steps):
    return EqxScan(eqx.filter_vmap(block)(jax.random.split(jax.random.key(1), steps)))


class NnxScan(nnx.Module):
    """A stack built with `nnx.vmap`, one block per `nnx.scan` step."""

    def __init__(self, block, steps, rngs):
        self.blocks = nnx.vmap(lambda k: block(nnx.Rngs(k)))(jax.random.split(rngs.params(), steps))

    def __call__(self, x):
        return nnx.scan(lambda x, b: (b(x), None), in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))(x, self.blocks)[0]


def nnx_scan(block, steps):
    return px.from_nnx(NnxScan(block, steps, nnx.Rngs(2)))


class EqxStack(eqx.Module):
    layers: eqx.nn.Linear  # stacked: weight (3, 4, 4)

    def __call__(self, x):
        def step(x, layer):
            return jnp.tanh(jax.vmap(layer)(x)), None

        return jax.lax.scan(step, x, self.layers)[0]


class NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        return jnp.tanh(self.lin(x))


def stack():
    x = jax.random.normal(jax.random.key(0), (2, 4))

    def haiku_fn(x):
        return hk.experimental.layer_stack(3)(lambda x: jnp.tanh(hk.Linear(4, name="lin")(x)))(x)

    return x, {
        "equinox": EqxStack(
            eqx.filter_vmap(lambda k: eqx.nn.Linear(4, 4, key=k))(jax.random.split(jax.random.key(1), 3))
        ),
        "haiku": haiku(haiku_fn, x),
        "nnx": nnx_scan(NnxBlock, 3),
    }


class EqxAttentionStack(eqx.Module):
    blocks: eqx.nn.MultiheadAttention  # built with eqx.filter_vmap: 2 layers

    def __call__(self, x):
        arrays, static = eqx.partition(self.blocks, eqx.is_array)

        def step(x, arrays):
            attn = eqx.combine(arrays, static)
            return x + jax.vmap(lambda s: attn(s, s, s))(x), None

        return jax.lax.scan(step, x, arrays)[0]


class NnxAttentionBlock(nnx.Module):
    def __init__(self, rngs):
        self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=8, decode=False, rngs=rngs)

    def __call__(self, x):
        return x + self.attn(x)


def attention_stack():
    x = jax.random.normal(jax.random.key(0), (2, 5, 8))
    flags = dict(use_query_bias=True, use_key_bias=True, use_value_bias=True, use_output_bias=True)

    def haiku_fn(x):
        block = lambda x: (
            x + hk.MultiHeadAttention(2, 4, w_init=hk.initializers.VarianceScaling(), name="attn")(x, x, x)
        )
        return hk.experimental.layer_stack(2)(block)(x)

    return x, {
        "equinox": EqxAttentionStack(
            eqx.filter_vmap(lambda k: eqx.nn.MultiheadAttention(2, 8, key=k, **flags))(
                jax.random.split(jax.random.key(1), 2)
            )
        ),
        "haiku": haiku(haiku_fn, x),
        "nnx": nnx_scan(NnxAttentionBlock, 2),
    }


class EqxNormBlock(eqx.Module):
    norm: eqx.Module
    lin: eqx.nn.Linear

    def __init__(self, key, rms=False):
        self.norm = eqx.nn.RMSNorm(4, use_bias=False) if rms else eqx.nn.LayerNorm(4)
        self.lin = eqx.nn.Linear(4, 4, key=key)

    def __call__(self, x):
        return jnp.tanh(jax.vmap(lambda x: self.lin(self.norm(x)))(x))


class NnxNormBlock(nnx.Module):
    def __init__(self, rngs, rms=False):
        self.norm = (nnx.RMSNorm if rms else nnx.LayerNorm)(4, epsilon=1e-5, rngs=rngs)
        self.lin = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        return jnp.tanh(self.lin(self.norm(x)))


def norm_stack(rms=False):
    def build():
        x = jax.random.normal(jax.random.key(0), (2, 4))

        def block(x):
            norm = hk.RMSNorm(-1, name="norm") if rms else hk.LayerNorm(-1, True, True, name="norm")
            return jnp.tanh(hk.Linear(4, name="lin")(norm(x)))

        return x, {
            "equinox": eqx_scan(lambda k: EqxNormBlock(k, rms), 3),
            "haiku": haiku(lambda x: hk.experimental.layer_stack(3)(block)(x), x),
            "nnx": nnx_scan(lambda rngs: NnxNormBlock(rngs, rms), 3),
        }

    return build


class EqxConvBlock(eqx.Module):
    conv: eqx.Module

    def __init__(self, key, dims=1, transpose=False):
        if transpose:  # stride 1, so the block keeps its input's shape; no groups in Haiku
            self.conv = eqx.nn.ConvTranspose(dims, 4, 4, 3, padding=1, key=key)
        else:
            self.conv = eqx.nn.Conv(dims, 4, 4, 3, padding=1, groups=2, key=key)

    def __call__(self, x):  # (batch, *spatial, channels); Equinox convolves channels first
        return jnp.tanh(jax.vmap(lambda x: jnp.moveaxis(self.conv(jnp.moveaxis(x, -1, 0)), 0, -1))(x))


class NnxConvBlock(nnx.Module):
    def __init__(self, rngs, dims=1, transpose=False):
        window = (3,) * dims
        if transpose:
            self.conv = nnx.ConvTranspose(4, 4, window, padding=[(1, 1)] * dims, transpose_kernel=True, rngs=rngs)
        else:
            self.conv = nnx.Conv(4, 4, window, feature_group_count=2, rngs=rngs)

    def __call__(self, x):
        return jnp.tanh(self.conv(x))


def conv_stack(dims=1, transpose=False):
    def build():
        x = jax.random.normal(jax.random.key(0), (2,) + (4,) * dims + (4,))

        def block(x):
            if transpose:
                conv = hk.ConvNDTranspose(dims, 4, 3, padding=[(1, 1)] * dims, name="conv")
            else:
                conv = hk.ConvND(dims, 4, 3, feature_group_count=2, name="conv")
            return jnp.tanh(conv(x))

        return x, {
            "equinox": eqx_scan(lambda k: EqxConvBlock(k, dims, transpose), 3),
            "haiku": haiku(lambda x: hk.experimental.layer_stack(3)(block)(x), x),
            "nnx": nnx_scan(lambda rngs: NnxConvBlock(rngs, dims, transpose), 3),
        }

    return build


class EqxLSTMBlock(eqx.Module):
    cell: eqx.nn.LSTMCell

    def __init__(self, key):
        self.cell = eqx.nn.LSTMCell(5, 5, key=key)

    def __call__(self, xs):  # (time, batch, features) -> the hidden state at each time
        h = c = jnp.zeros(xs.shape[1:])
        hs = []
        for x in xs:
            h, c = jax.vmap(self.cell)(x, (h, c))
            hs.append(h)
        return jnp.stack(hs)


class NnxLSTMBlock(nnx.Module):
    def __init__(self, rngs):
        self.cell = nnx.LSTMCell(5, 5, rngs=rngs)

    def __call__(self, xs):
        h = jnp.zeros(xs.shape[1:])
        carry, hs = (h, h), []
        for x in xs:
            carry, h = self.cell(carry, x)
            hs.append(h)
        return jnp.stack(hs)


def lstm_stack():
    xs = jax.random.normal(jax.random.key(0), (2, 2, 5))

    def block(xs):
        core = hk.LSTM(5, name="lstm")
        state = core.initial_state(xs.shape[1])
        hs = []
        for x in xs:
            h, state = core(x, state)
            hs.append(h)
        return jnp.stack(hs)

    return xs, {
        "equinox": eqx_scan(EqxLSTMBlock, 2),
        "haiku": haiku(lambda xs: hk.experimental.layer_stack(2)(block)(xs), xs),
        "nnx": nnx_scan(NnxLSTMBlock, 2),
    }


class EqxBatchNormBlock(eqx.Module):
    lin: eqx.nn.Linear
    bn: eqx.nn.BatchNorm

    def __init__(self, key):
        self.lin = eqx.nn.Linear(4, 4, key=key)
        self.bn = eqx.nn.BatchNorm(4, "batch", mode="ema", inference=True)

    def __call__(self, x, state):
        return jnp.tanh(jax.vmap(lambda x: self.bn(self.lin(x), state)[0])(x))


class EqxBatchNormScan(eqx.Module):
    """Equinox's stacked BatchNorm: `make_with_state` under `filter_vmap` stacks the
    State too, and each scan step takes its slice of it."""

    blocks: EqxBatchNormBlock
    state: eqx.nn.State

    def __call__(self, x):
        arrays, static = eqx.partition(self.blocks, eqx.is_array)

        def step(x, step_arrays):
            arrays, state = step_arrays
            return eqx.combine(arrays, static)(x, state), None

        return jax.lax.scan(step, x, (arrays, self.state))[0]


class NnxBatchNormBlock(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(4, 4, rngs=rngs)
        self.bn = nnx.BatchNorm(4, use_running_average=True, epsilon=1e-5, rngs=rngs)

    def __call__(self, x):
        return jnp.tanh(self.bn(self.lin(x)))


def batch_norm_stack():
    x = jax.random.normal(jax.random.key(0), (2, 4))

    def block(x, is_training):
        h = hk.Linear(4, name="lin")(x)
        return jnp.tanh(hk.BatchNorm(True, True, 0.9, name="bn")(h, is_training=is_training))

    def haiku_fn(x, is_training=False):
        return hk.experimental.layer_stack(3)(lambda x: block(x, is_training))(x)

    make = eqx.nn.make_with_state(EqxBatchNormBlock)
    blocks, state = eqx.filter_vmap(make)(jax.random.split(jax.random.key(1), 3))
    return x, {
        "equinox": EqxBatchNormScan(blocks, state),
        "haiku": haiku(haiku_fn, x, stateful=True, is_training=True),
        "nnx": nnx_scan(NnxBatchNormBlock, 3),
    }


STEPS = 8


class EqxLSTM(eqx.Module):
    cell: eqx.nn.LSTMCell

    def __call__(self, xs):  # (time, batch, features)
        h = c = jnp.zeros((xs.shape[1], 5))
        for x in xs:
            h, c = jax.vmap(self.cell)(x, (h, c))
        return h


class NnxLSTM(nnx.Module):
    def __init__(self, rngs):
        self.cell = nnx.LSTMCell(3, 5, rngs=rngs)

    def __call__(self, xs):
        carry = (jnp.zeros((xs.shape[1], 5)),) * 2
        for x in xs:
            carry, h = self.cell(carry, x)
        return h


def lstm():
    xs = jax.random.normal(jax.random.key(0), (STEPS, 2, 3))

    def haiku_fn(xs):
        core = hk.LSTM(5, name="lstm")
        state = core.initial_state(xs.shape[1])
        for x in xs:
            h, state = core(x, state)
        return h

    return xs, {
        "equinox": EqxLSTM(eqx.nn.LSTMCell(3, 5, key=jax.random.key(1))),
        "haiku": haiku(haiku_fn, xs),
        "nnx": px.from_nnx(NnxLSTM(nnx.Rngs(2))),
    }


KINDS = {
    "linear": (mlp, 1e-5),
    "conv1d_groups": (conv(1), 1e-5),
    "conv2d_groups": (conv(2), 1e-5),
    "conv_transpose1d": (conv_transpose(1, 3, 2, 1, 1, False), 1e-5),
    "conv_transpose2d_flipped": (conv_transpose(2, 4, 2, 1, 0, True), 1e-5),
    "conv_transpose1d_stride_over_kernel": (conv_transpose(1, 2, 3, 0, 2, True), 1e-5),
    "embedding_layer_norm": (embed_norm("layer"), 1e-5),
    "embedding_rms_norm": (embed_norm("rms"), 1e-5),
    "batch_norm_statistics": (batch_norm, 1e-5),
    "attention": (attention(True), 1e-5),
    "attention_without_bias": (attention(False), 1e-5),
    "scanned_stack": (stack, 1e-5),
    "scanned_attention_stack": (attention_stack, 1e-5),
    "scanned_layer_norm_stack": (norm_stack(), 1e-5),
    "scanned_rms_norm_stack": (norm_stack(rms=True), 1e-5),
    "scanned_conv1d_stack": (conv_stack(), 1e-5),
    "scanned_conv2d_stack": (conv_stack(dims=2), 1e-5),
    "scanned_conv_transpose_stack": (conv_stack(transpose=True), 1e-5),
    "scanned_batch_norm_stack": (batch_norm_stack, 1e-5),
    # No scanned stack of embeddings: a step's output is the next step's input, and an
    # embedding takes integer tokens and returns float vectors.
    "scanned_lstm_stack": (lstm_stack, 1e-5),
    "lstm": (lstm, 1e-4),
}


@pytest.fixture(scope="module", params=list(KINDS))
def kind(request):
    build, tolerance = KINDS[request.param]
    x, models = build()
    return (
        request.param,
        x,
        {name: perturbed(model, seed) for seed, (name, model) in enumerate(models.items())},
        tolerance,
    )


@pytest.mark.parametrize("a, b", DIRECTIONS)
def test_transfer_is_exact_in_every_direction(kind, a, b):
    name, x, models, tolerance = kind
    source, destination = models[a], models[b]
    assert not np.allclose(output(source, x), output(destination, x), atol=1e-3), "the models must differ before"
    alignment = px.align(source, destination, x)
    assert alignment.mapping and not alignment.ambiguous
    # Checked here rather than by the transfer's own verification (tested below).
    port = px.transfer_params(source, destination, alignment.mapping, inputs=x, verify=False)
    np.testing.assert_allclose(output(port, x), output(source, x), rtol=tolerance, atol=tolerance)
    comparison = px.compare(source, port, x, tolerance=tolerance, alignment=alignment)
    assert comparison.first_divergence is None, str(comparison)
    assert len(comparison.rows) == len(alignment.mapping)


@pytest.mark.parametrize("a, b", [("nnx", "equinox"), ("equinox", "nnx"), ("haiku", "nnx"), ("nnx", "haiku")])
def test_a_transfer_with_inputs_leaks_no_tracers_of_its_abstract_run(a, b):
    # The abstract run learns each converted layer's module; an NNX module seen there
    # holds that run's tracers, and must not outlive it.
    x, models = mlp()
    source, destination = perturbed(models[a], 0), models[b]
    with jax.checking_leaks():
        mapping = px.align(source, destination, x).mapping
        port = px.transfer_params(source, destination, mapping, inputs=x)
    np.testing.assert_allclose(output(port, x), output(source, x), rtol=1e-5, atol=1e-5)
    assert not np.allclose(output(destination, x), output(source, x), atol=1e-3)


# -- px.compare pinpoints each class of porting bug at its layer ------------------------


def first_divergence(a, b, x, **kwargs):
    row = px.compare(a, b, x, **kwargs).first_divergence
    return row and (row.path_a, row.path_b)


def test_missing_activation_is_pinpointed_and_refused_by_verification():
    x, models = mlp()
    linear = eqx.nn.MLP(4, 3, 6, depth=1, activation=lambda h: h, key=jax.random.key(1))
    no_relu = EqxBatched(linear)
    mapping = px.align(models["haiku"], no_relu, x).mapping
    port = px.transfer_params(models["haiku"], no_relu, mapping)
    assert first_divergence(models["haiku"], port, x) == ("mlp.linear_1", "layer.layers.1")
    with pytest.raises(px.HookError, match=r"differ first at layer 'mlp.linear_1' -> 'layer.layers.1'"):
        px.transfer_params(models["haiku"], no_relu, mapping, inputs=x)


def test_swapped_gates_are_pinpointed():
    xs, models = lstm()
    mapping = px.align(models["haiku"], models["equinox"], xs).mapping
    port = px.transfer_params(models["haiku"], models["equinox"], mapping, inputs=xs, tolerance=1e-4)
    assert first_divergence(models["haiku"], port, xs, tolerance=1e-4) is None
    i, f, g, o = jnp.split(port.cell.weight_ih, 4)
    swapped = eqx.tree_at(lambda m: m.cell.weight_ih, port, jnp.concatenate([f, i, g, o]))
    assert first_divergence(models["haiku"], swapped, xs, tolerance=1e-4) == ("lstm", "cell")


def test_wrong_head_split_is_pinpointed():
    x, models = attention(True)()
    source = perturbed(models["nnx"], 0)
    port = px.transfer_params(source, models["equinox"], px.align(source, models["equinox"], x).mapping, inputs=x)
    # The old bug: NNX's (in, heads, head_dim) kernel flattened head-minor.
    kernel = px.to_nnx(source).attn.query.kernel.get_value()
    head_minor = jnp.transpose(kernel, (0, 2, 1)).reshape(8, 8).T
    wrong = eqx.tree_at(lambda m: m.attn.query_proj.weight, port, head_minor)
    assert first_divergence(source, wrong, x) == ("attn.query", "attn.query_proj")


def test_stale_batch_norm_statistics_are_pinpointed():
    x, models = batch_norm()
    source = perturbed(models["haiku"], 0)
    port = px.transfer_params(source, models["equinox"], px.align(source, models["equinox"], x).mapping, inputs=x)
    assert first_divergence(source, port, x) is None
    stale = eqx.tree_at(lambda m: m.state, port, models["equinox"].state)
    assert first_divergence(source, stale, x) == ("bn", "bn")



@pytest.mark.parametrize("make", [batch_norm, batch_norm_stack])
def test_equinox_batch_norm_twins_count_their_running_statistics_as_nnx_does(make):
    # The Equinox twins hold their eqx.nn.State as a field: its running statistics are
    # non-trainable (read through the BatchNorm's StateIndex), never trainable.
    x, models = make()
    counts = {
        lib: [(row.kind, row.trainable * row.stack_length, row.non_trainable * row.stack_length)
              for row in px.summary(models[lib], x).rows if row.kind != "other"]
        for lib in ("equinox", "nnx")
    }
    assert counts["equinox"] == counts["nnx"]
    layers = 1 if make is batch_norm else 3
    width = 5 if make is batch_norm else 4
    assert px.total_params(models["equinox"]) == px.total_params(models["nnx"]) == (
        layers * (4 * width + width + 2 * width), layers * 2 * width)


def test_stack_steps_in_the_wrong_order_are_pinpointed():
    # The old bug: a scanned stack into or out of Equinox transferred step for the wrong step.
    x, models = conv_stack()()
    source = perturbed(models["haiku"], 0)
    port = px.transfer_params(source, models["equinox"], px.align(source, models["equinox"], x).mapping, inputs=x)
    assert first_divergence(source, port, x) is None
    reversed_steps = eqx.tree_at(lambda m: m.blocks.conv.weight, port, port.blocks.conv.weight[::-1])
    assert first_divergence(source, reversed_steps, x) == ("conv", "blocks.conv")

# -- what cannot be mapped exactly is refused, naming the layer and the reason ------------


def test_a_different_head_split_is_refused():
    x, models = attention(True)()
    four_heads = EqxAttention(
        eqx.nn.MultiheadAttention(
            4,
            8,
            use_query_bias=True,
            use_key_bias=True,
            use_value_bias=True,
            use_output_bias=True,
            key=jax.random.key(1),
        )
    )
    mapping = px.align(models["nnx"], four_heads, x).mapping
    with pytest.raises(
        px.HookError, match=r"layer 'attn.query_proj'.*axis 'heads' has size 2 in the source, 4 in the destination"
    ):
        px.transfer_params(models["nnx"], four_heads, mapping)


def test_a_bias_the_destination_lacks_is_refused_and_a_missing_one_is_zero():
    x, with_bias = attention(True)()
    _, without = attention(False)()
    mapping = px.align(with_bias["nnx"], without["equinox"], x).mapping
    with pytest.raises(px.HookError, match=r"layer 'attn.query_proj'.*source has a bias and the destination has none"):
        px.transfer_params(with_bias["nnx"], without["equinox"], mapping)
    port = px.transfer_params(
        without["equinox"], with_bias["nnx"], px.align(without["equinox"], with_bias["nnx"], x).mapping, inputs=x
    )
    assert not np.any(px.to_nnx(port).attn.query.bias.get_value())


def test_containers_need_their_parts_in_the_mapping():
    x, models = attention(True)()
    with pytest.raises(px.HookError, match=r"layer 'attn'.*does not cover \['mha.query'"):
        px.transfer_params(models["haiku"], models["equinox"], {"mha": "attn"})
    with pytest.raises(px.HookError, match=r"layer 'attn.key_proj'.*two sources"):
        px.transfer_params(
            models["nnx"], models["equinox"], {"attn.query": "attn.key_proj", "attn.key": "attn.key_proj"}
        )


def test_a_conv_transpose_padded_differently_is_refused():
    # Equinox's padding=0 and lax's "VALID" agree for stride <= kernel only: with stride
    # 3 over a kernel of 2, lax pads the dilated input by (1, 2), Equinox by (1, 1).
    equinox = EqxBatched(eqx.nn.ConvTranspose1d(4, 6, 2, 3, key=jax.random.key(1)), channels_first=True)
    valid = px.from_nnx(NnxOne(nnx.ConvTranspose(4, 6, (2,), strides=3, padding="VALID", rngs=nnx.Rngs(2))))
    with pytest.raises(px.HookError, match=r"layer 'layer'.*padding is \(\(1, 1\),\) in the source, \(\(1, 2\),\)"):
        px.transfer_params(equinox, valid, {"layer": "layer"})
    conv = EqxBatched(eqx.nn.Conv1d(4, 6, 2, key=jax.random.key(1)), channels_first=True)
    with pytest.raises(px.HookError, match=r"layer 'layer'.*'layer' is a conv_transpose layer, the destination a conv"):
        px.transfer_params(equinox, conv, {"layer": "layer"})


def test_layers_without_an_exact_mapping_are_refused():
    x = jnp.ones((2, 5, 4))
    gru = haiku(lambda x: hk.GRU(4, name="gru")(x[:, 0], jnp.zeros((2, 4)))[0], x)
    with pytest.raises(px.HookError, match=r"cannot map layer 'gru'.*reset gate"):
        px.transfer_params(gru, gru, {"gru": "gru"})
    bn = eqx.nn.BatchNorm(4, "batch", mode="ema")
    with pytest.raises(px.HookError, match=r"cannot map layer 'layer'.*eqx.nn.State"):
        px.transfer_params(EqxBatched(bn), EqxBatched(bn), {"layer": "layer"})


def test_haiku_lstm_needs_inputs_to_be_known():
    xs, models = lstm()
    with pytest.raises(px.HookError, match=r"layer 'cell'.*container.*pass inputs="):
        px.transfer_params(models["haiku"], models["equinox"], {"lstm": "cell"})


def unknown_kind(path):
    return rf"layer '{path}'.*pass inputs= \(example inputs\) so the layer kind is known"


def test_a_haiku_conv_transpose_with_a_custom_name_needs_inputs():
    # Its parameters are a conv's (`w`, `b`, same shapes): only a call tells them apart.
    x = jax.random.normal(jax.random.key(0), (2, 5, 5, 4))
    haiku_up = haiku(lambda x: hk.Conv2DTranspose(6, 4, 2, padding=[(2, 2)] * 2, name="up")(x), x)
    # Equinox's padding is the forward conv's: 1 pads the dilated input by 4 - 1 - 1 = 2.
    equinox_up = EqxBatched(eqx.nn.ConvTranspose2d(4, 6, 4, 2, padding=1, key=jax.random.key(1)), channels_first=True)
    assert not np.allclose(haiku_up(x), equinox_up(x), atol=1e-3)
    directions = [(haiku_up, equinox_up, {"up": "layer"}), (equinox_up, haiku_up, {"layer": "up"})]
    for source, destination, mapping in directions:
        with pytest.raises(px.HookError, match=unknown_kind("up")):
            px.transfer_params(source, destination, mapping)
        port = px.transfer_params(source, destination, mapping, inputs=x, verify=False)
        np.testing.assert_allclose(port(x), source(x), rtol=1e-5, atol=1e-5)


def test_a_haiku_conv_is_known_without_inputs_only_by_a_default_name():
    x = jax.random.normal(jax.random.key(0), (2, 5, 5, 4))
    custom = haiku(lambda x: hk.Conv2D(6, 3, name="features")(x), x)

    def two_convs(x):
        first = hk.Conv2D(6, 3)  # conv2_d, then conv2_d_1
        return hk.Conv2D(6, 3)(first(x))

    defaults = haiku(two_convs, x)
    convs = [eqx.nn.Conv2d(c, 6, 3, padding=1, key=jax.random.key(c)) for c in (4, 6)]
    equinox = EqxBatched(eqx.nn.Sequential(convs), channels_first=True)
    with pytest.raises(px.HookError, match=unknown_kind("features")):
        px.transfer_params(custom, equinox, {"features": "layer.layers.0"})
    transpose = haiku(lambda x: hk.Conv2DTranspose(6, 3)(x), x)  # its default name is not a conv's
    with pytest.raises(px.HookError, match=unknown_kind("conv2_d_transpose")):
        px.transfer_params(transpose, equinox, {"conv2_d_transpose": "layer.layers.0"})
    assert not np.allclose(defaults(x), equinox(x), atol=1e-3)
    port = px.transfer_params(defaults, equinox, {"conv2_d": "layer.layers.0", "conv2_d_1": "layer.layers.1"})
    np.testing.assert_allclose(port(x), defaults(x), rtol=1e-5, atol=1e-5)


def test_adapters_are_complete_or_cannot_be_built():
    class Incomplete(AbstractConverted):
        def layers(self):
            return {}

    with pytest.raises(TypeError, match="abstract"):
        Incomplete()
    function = px.haiku_function(lambda x: hk.Linear(2)(x))
    with pytest.raises(TypeError, match=r"enclosing hk\.transform"):
        function.read_layer(("linear",))


class EqxGRU(eqx.Module):
    cell: eqx.nn.GRUCell

    def __call__(self, xs):
        h = jnp.zeros((xs.shape[1], 5))
        for x in xs:
            h = jax.vmap(self.cell)(x, h)
        return h


class NnxGRU(nnx.Module):
    def __init__(self, rngs):
        self.cell = nnx.GRUCell(3, 5, rngs=rngs)

    def __call__(self, xs):
        h = jnp.zeros((xs.shape[1], 5))
        for x in xs:
            h, _ = self.cell(h, x)
        return h


def test_gru_cells_transfer_exactly_where_the_libraries_agree():
    xs = jax.random.normal(jax.random.key(0), (STEPS, 2, 3))
    equinox = perturbed(EqxGRU(eqx.nn.GRUCell(3, 5, key=jax.random.key(1))), 1)
    nnx_gru = perturbed(px.from_nnx(NnxGRU(nnx.Rngs(2))), 2)
    # NNX's GRU has no recurrent bias inside the reset gate (Equinox's bias_n): from NNX
    # it becomes 0; from Equinox it is refused.
    port = px.transfer_params(nnx_gru, equinox, px.align(nnx_gru, equinox, xs).mapping, inputs=xs, tolerance=1e-4)
    np.testing.assert_allclose(port(xs), nnx_gru(xs), rtol=1e-4, atol=1e-4)
    assert not np.any(port.cell.bias_n)
    with pytest.raises(px.HookError, match=r"layer 'cell'.*source has a recurrent_bias and the destination has none"):
        px.transfer_params(equinox, nnx_gru, {"cell": "cell"})
    gru = haiku(lambda xs: hk.GRU(5, name="gru")(xs[0], jnp.zeros((2, 5)))[0], xs)
    for other in (equinox, nnx_gru):
        with pytest.raises(px.HookError, match=r"cannot map layer 'gru'.*reset gate"):
            px.transfer_params(gru, other, {"gru": "cell"}, inputs=xs)


def test_statistics_into_a_state_kept_apart_are_returned_with_the_model():
    x, models = batch_norm()
    source = perturbed(models["haiku"], 0)
    apart = eqx.nn.Sequential([eqx.nn.Linear(4, 5, key=jax.random.key(1)), models["equinox"].bn])
    port, state = px.transfer_params(
        source, apart, {"linear": "layers.0", "bn": "layers.1"}, dst_state=models["equinox"].state
    )
    mean, var = state.get(port.layers[1].ema_state_index)
    np.testing.assert_array_equal(mean, jnp.ravel(source.state["bn/~/mean_ema"]["average"]))
    np.testing.assert_array_equal(var, jnp.ravel(source.state["bn/~/var_ema"]["average"]))
    np.testing.assert_array_equal(port.layers[1].weight, jnp.ravel(source.params["bn"]["scale"]))
    # The caller's State is untouched (Equinox invalidates a State that is set).
    assert models["equinox"].state.get(port.layers[1].ema_state_index)[0] is not None


def test_a_haiku_attention_with_other_heads_is_refused_once_its_class_is_known():
    x, models = attention(True)()
    four_heads = haiku(
        lambda x: hk.MultiHeadAttention(4, 2, w_init=hk.initializers.VarianceScaling(), name="mha")(x, x, x), x
    )
    mapping = px.align(four_heads, models["equinox"], x).mapping
    with pytest.raises(
        px.HookError, match=r"layer 'attn.query_proj'.*axis 'heads' has size 4 in the source, 2 in the destination"
    ):
        px.transfer_params(four_heads, models["equinox"], mapping, inputs=x)


class WithHead(eqx.Module):
    inner: eqx.Module
    head: eqx.nn.Linear

    def __call__(self, xs):
        return jax.vmap(self.head)(self.inner(xs))


def test_a_converted_model_inside_an_equinox_model():
    xs, models = lstm()
    source = WithHead(perturbed(models["haiku"], 3), eqx.nn.Linear(5, 2, key=jax.random.key(0)))
    destination = WithHead(models["equinox"], eqx.nn.Linear(5, 2, key=jax.random.key(1)))
    mapping = px.align(source, destination, xs).mapping
    assert mapping["inner.lstm@7"] == "inner.cell@7" and mapping["head"] == "head"
    port = px.transfer_params(source, destination, mapping, inputs=xs, tolerance=1e-4)
    np.testing.assert_allclose(port(xs), source(xs), rtol=1e-4, atol=1e-4)


def test_statistics_of_an_equinox_batch_norm_in_batch_mode():
    x, models = batch_norm()
    source = perturbed(models["haiku"], 0)
    bn, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(5, "batch", mode="batch", inference=True)
    batch_mode = EqxBatchNorm(eqx.nn.Linear(4, 5, key=jax.random.key(1)), bn, state)
    port = px.transfer_params(source, batch_mode, {"linear": "linear", "bn": "bn"}, inputs=x)
    np.testing.assert_allclose(port(x), output(source, x), rtol=1e-5, atol=1e-5)
    back = px.transfer_params(port, models["nnx"], {"linear": "linear", "bn": "bn"}, inputs=x)
    np.testing.assert_allclose(back(x), output(source, x), rtol=1e-5, atol=1e-5)


def test_a_bug_in_a_later_layer_of_a_scanned_block_is_pinpointed_at_that_layer():
    # blocks.lin is wrong from step 0; blocks.norm (first in the block) diverges only
    # from step 1, fed by it: compare ranks a stack's layers by their first bad step.
    x, models = norm_stack()()
    source = perturbed(models["nnx"], 0)
    port = px.transfer_params(source, models["equinox"], px.align(source, models["equinox"], x).mapping, inputs=x)
    broken = eqx.tree_at(lambda m: m.blocks.lin.weight, port, port.blocks.lin.weight.transpose(0, 2, 1))
    comparison = px.compare(source, broken, x)
    assert [row.path_a for row in comparison.rows if row.diverged] == ["blocks.norm", "blocks.lin"]
    assert comparison.first_divergence.path_a == "blocks.lin"
    assert comparison.first_divergence.first_step == 0


def test_a_stacked_equinox_batch_norm_needs_its_stacked_state():
    x, models = batch_norm_stack()
    source = perturbed(models["haiku"], 0)
    blocks, mapping = models["equinox"].blocks, {"lin": "lin", "bn": "bn"}
    with pytest.raises(px.HookError, match=r"cannot map layer 'bn'.*eqx.nn.State"):
        px.transfer_params(source, blocks, mapping)
    port, state = px.transfer_params(source, blocks, mapping, dst_state=models["equinox"].state)
    mean, var = state.get(port.bn.ema_state_index)  # one row per step
    haiku_stats = [source.state[f"__layer_stack_no_per_layer/bn/~/{stat}_ema"]["average"] for stat in ("mean", "var")]
    np.testing.assert_array_equal(mean, haiku_stats[0][:, 0])  # Haiku keeps (steps, 1, features)
    np.testing.assert_array_equal(var, haiku_stats[1][:, 0])
    np.testing.assert_allclose(EqxBatchNormScan(port, state)(x), output(source, x), rtol=1e-5, atol=1e-5)
