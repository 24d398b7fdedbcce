"""The models in each library (Equinox, Haiku, Flax NNX, Flax linen): an MLP, a pre-LN
transformer and a tiny model, at this run's sizes (`S`), with NumPy-drawn parameters;
each library's raw jitted calls and native log of every layer (`BUILDERS`), and the
converted model that peex_interop hooks."""

import dataclasses
import sys
from functools import partial
from pathlib import Path
from typing import Any

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import peex
from flax import nnx

import peex_interop as px

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from harness import Variant, hooked_output
from models import random_like


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The models' sizes: the MLP's width and batch; the transformer's width, heads,
    sequence length, batch and number of blocks (at most 6)."""

    width: int
    mlp_batch: int
    dim: int
    heads: int
    seq: int
    batch: int
    blocks: int


# The models; `--quick` shrinks them so that a smoke run takes seconds.
FULL_SIZES = Sizes(width=512, mlp_batch=64, dim=128, heads=4, seq=64, batch=8, blocks=6)
QUICK_SIZES = Sizes(width=64, mlp_batch=8, dim=32, heads=4, seq=16, batch=2, blocks=2)
S = FULL_SIZES  # this run's (`use_sizes`)
DEPTH = 12  # the MLP's Linear layers
LIBRARIES = ("Equinox", "Haiku", "NNX", "linen")


def use_sizes(sizes):
    """Build the models at `sizes` from now on (`S`): `main` sets the run's (`--quick`:
    `QUICK_SIZES`), the narrow MLP's rows a narrower width while they build it. The
    other modules read `libraries.S` when they run, never a copy imported before."""
    global S
    S = sizes


def inputs(shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32))


class BareModule(eqx.Module):
    """The cheapest `eqx.Module` around a raw call's arguments: one field, and Python's
    own attribute lookup (as converted models have it). Under `jax.jit` it costs what
    flattening one Equinox pytree node costs, a Python function where a dict flattens
    in C++: the floor of any converted model's dispatch."""

    args: Any
    __getattribute__ = object.__getattribute__


def jitted_raw(name, apply, args, x):
    """A library's raw variants: "raw", `jax.jit(apply)(args, x)`; "raw (A/A)", the same
    call as a second variant (the group's noise floor); "raw eqx.filter_jit", `apply`
    itself under `eqx.filter_jit` (what that jit costs with no conversion); on the tiny
    model "bare module", `apply` under `jax.jit` reading `args` from a `BareModule`."""
    raw = Variant(partial(jax.jit(apply), args, x))
    calls = {"raw": raw, "raw (A/A)": raw}
    calls["raw eqx.filter_jit"] = Variant(partial(eqx.filter_jit(apply), args, x))
    if name == "tiny":
        bare = jax.jit(lambda module, x: apply(module.args, x))
        calls["bare module"] = Variant(partial(bare, BareModule(args), x))
    return calls


# ---------------------------------------------------------------- Equinox models


class EqxMLP(eqx.Module):
    """Twelve Linear layers as depth-1 attributes (`l0` ... `l11`): peex 0.0.3 hooks only
    the model's own attributes, so this layout lets it log every layer."""

    l0: eqx.nn.Linear
    l1: eqx.nn.Linear
    l2: eqx.nn.Linear
    l3: eqx.nn.Linear
    l4: eqx.nn.Linear
    l5: eqx.nn.Linear
    l6: eqx.nn.Linear
    l7: eqx.nn.Linear
    l8: eqx.nn.Linear
    l9: eqx.nn.Linear
    l10: eqx.nn.Linear
    l11: eqx.nn.Linear

    def __init__(self, *, key):
        for i, k in enumerate(jax.random.split(key, DEPTH)):
            setattr(self, f"l{i}", eqx.nn.Linear(S.width, S.width, key=k))

    def __call__(self, x):
        for i in range(DEPTH):
            x = jax.nn.relu(getattr(self, f"l{i}")(x))
        return x


class EqxBlock(eqx.Module):
    """Pre-LN block on one (seq, dim) sequence: `eqx.nn.MultiheadAttention`, then a
    4x gelu MLP, each with a residual."""

    norm1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear

    def __init__(self, *, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.norm1, self.norm2 = eqx.nn.LayerNorm(S.dim), eqx.nn.LayerNorm(S.dim)
        self.attn = eqx.nn.MultiheadAttention(S.heads, S.dim, key=k1)
        self.fc1 = eqx.nn.Linear(S.dim, 4 * S.dim, key=k2)
        self.fc2 = eqx.nn.Linear(4 * S.dim, S.dim, key=k3)

    def __call__(self, x):
        h = jax.vmap(self.norm1)(x)
        x = x + self.attn(h, h, h)
        h = jax.vmap(self.norm2)(x)
        return x + jax.vmap(self.fc2)(jax.nn.gelu(jax.vmap(self.fc1)(h)))


class EqxTransformer(eqx.Module):
    """`S.blocks` `EqxBlock`s as depth-1 attributes (what peex 0.0.3 can hook), run in
    turn; the attributes past `S.blocks` are `None`."""

    b0: EqxBlock | None
    b1: EqxBlock | None
    b2: EqxBlock | None
    b3: EqxBlock | None
    b4: EqxBlock | None
    b5: EqxBlock | None

    def __init__(self, *, key):
        for i, k in enumerate(jax.random.split(key, 6)):
            setattr(self, f"b{i}", EqxBlock(key=k) if i < S.blocks else None)

    def __call__(self, x):
        for i in range(S.blocks):
            x = getattr(self, f"b{i}")(x)
        return x


class EqxTiny(eqx.Module):
    lin: eqx.nn.Linear

    def __init__(self, *, key):
        self.lin = eqx.nn.Linear(4, 4, key=key)

    def __call__(self, x):
        return self.lin(x)


EQX_MODELS = {"MLP": EqxMLP, "transformer": EqxTransformer, "tiny": EqxTiny}


def input_shape(name, batch=None, seq=None):
    """The model's input shape, batch first (every library's); `batch` and `seq`
    override the transformer's."""
    return {
        "MLP": (S.mlp_batch, S.width),
        "transformer": (batch or S.batch, seq or S.seq, S.dim),
        "tiny": (1, 4),
    }[name]


def forward(batched, axis_name=None):
    """`m(x)`, under `jax.vmap` over the batch for per-example (Equinox) models."""
    if batched:
        return lambda m, x: jax.vmap(m, axis_name=axis_name)(x)
    return lambda m, x: m(x)


def equinox_variants(name, x):
    """`(model, batched, variants)`: the Equinox model (per-example, run under
    `jax.vmap`), its raw call and peex 0.0.3's log of every layer."""
    model = random_like(eqx.filter_eval_shape(lambda: EQX_MODELS[name](key=jax.random.key(0))))
    fwd = eqx.filter_jit(forward(True))
    return model, True, {
        "raw": Variant(partial(fwd, model, x)),
        "native log": Variant(
            partial(fwd, peex.ForwardHook(model, log_fn=peex.IdentityLog()), x), hooked_output
        ),
    }


# ---------------------------------------------------------------- Haiku models


def haiku_mlp(x):
    return hk.nets.MLP([S.width] * DEPTH, activate_final=True, name="mlp")(x)


def haiku_block(x):
    ln = partial(hk.LayerNorm, -1, create_scale=True, create_offset=True)
    attention = hk.MultiHeadAttention(
        num_heads=S.heads, key_size=S.dim // S.heads, w_init=hk.initializers.VarianceScaling(),
        name="attn",
    )
    h = ln(name="ln_attn")(x)
    x = x + attention(h, h, h)
    h = ln(name="ln_mlp")(x)
    return x + hk.nets.MLP([4 * S.dim, S.dim], activation=jax.nn.gelu, name="mlp")(h)


def haiku_transformer(x):
    # A Python loop of named blocks: the native baseline's interceptor records into a
    # Python dict, which cannot take values out of a layer_stack's scan.
    for i in range(S.blocks):
        x = hk.to_module(haiku_block)(name=f"block_{i}")(x)
    return x


HAIKU_MODELS = {"MLP": haiku_mlp, "transformer": haiku_transformer, "tiny": lambda x: hk.Linear(4)(x)}


def native_haiku_log(transformed):
    """Haiku's own way to log every layer: `apply` under `hk.intercept_methods`,
    recording each module's `__call__` output by its Haiku name."""

    def apply(params, x):
        log = {}

        def record(next_f, args, kwargs, context):
            out = next_f(*args, **kwargs)
            if context.method_name == "__call__":
                log[context.module.module_name] = out
            return out

        with hk.intercept_methods(record):
            out = transformed.apply(params, x)
        return out, log

    return jax.jit(apply)


def haiku_variants(name, x):
    """`(px.from_haiku(...), batched, variants)`: raw = `jax.jit(transformed.apply)`."""
    transformed = hk.without_apply_rng(hk.transform(HAIKU_MODELS[name]))
    params = random_like(jax.eval_shape(transformed.init, jax.random.key(0), x))
    return px.from_haiku(transformed, params), False, jitted_raw(name, transformed.apply, params, x) | {
        "native log": Variant(partial(native_haiku_log(transformed), params, x), hooked_output),
    }


# ---------------------------------------------------------------- Flax NNX models


class NnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([nnx.Linear(S.width, S.width, rngs=rngs) for _ in range(DEPTH)])

    def __call__(self, x):
        for layer in self.layers:
            x = jax.nn.relu(layer(x))
        return x


class NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.ln_attn = nnx.LayerNorm(S.dim, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(S.heads, S.dim, decode=False, rngs=rngs)
        self.ln_mlp = nnx.LayerNorm(S.dim, rngs=rngs)
        self.fc1 = nnx.Linear(S.dim, 4 * S.dim, rngs=rngs)
        self.fc2 = nnx.Linear(4 * S.dim, S.dim, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.ln_attn(x))
        return x + self.fc2(jax.nn.gelu(self.fc1(self.ln_mlp(x))))


class NnxTransformer(nnx.Module):
    def __init__(self, rngs):
        self.blocks = nnx.List([NnxBlock(rngs) for _ in range(S.blocks)])

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class NnxTiny(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        return self.lin(x)


NNX_MODELS = {"MLP": NnxMLP, "transformer": NnxTransformer, "tiny": NnxTiny}


def nnx_variants(name, x):
    """`(px.from_nnx(...), batched, variants)`: raw = `jax.jit` of a split/merge call."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: NNX_MODELS[name](nnx.Rngs(0))))
    state = random_like(state)
    module = nnx.merge(graphdef, state)

    def capture(state, x):
        module = nnx.merge(graphdef, state)
        return nnx.capture(module, nnx.Intermediate, method_outputs=nnx.Intermediate)(x)

    raw = jitted_raw(name, lambda s, x: nnx.merge(graphdef, s)(x), state, x)
    return px.from_nnx(module), False, raw | {
        "native log": Variant(partial(jax.jit(capture), state, x), hooked_output),
    }


# ---------------------------------------------------------------- Flax linen models


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(DEPTH):
            x = jax.nn.relu(nn.Dense(S.width)(x))
        return x


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm(name="ln_attn")(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=S.heads, qkv_features=S.dim, name="attn")(h)
        h = nn.LayerNorm(name="ln_mlp")(x)
        return x + nn.Dense(S.dim, name="fc2")(jax.nn.gelu(nn.Dense(4 * S.dim, name="fc1")(h)))


class LinenTransformer(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(S.blocks):
            x = LinenBlock(name=f"block_{i}")(x)
        return x


class LinenTiny(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4, name="lin")(x)


LINEN_MODELS = {"MLP": LinenMLP, "transformer": LinenTransformer, "tiny": LinenTiny}


def linen_variants(name, x):
    """`(px.from_linen(...), batched, variants)`: raw = `jax.jit(module.apply)`."""
    module = LINEN_MODELS[name]()
    variables = random_like(jax.eval_shape(module.init, jax.random.key(0), x))
    capture = partial(module.apply, capture_intermediates=True, mutable=["intermediates"])
    return px.from_linen(module, variables), False, jitted_raw(name, module.apply, variables, x) | {
        "native log": Variant(partial(jax.jit(capture), variables, x), hooked_output),
    }


BUILDERS = {
    "Equinox": equinox_variants,
    "Haiku": haiku_variants,
    "NNX": nnx_variants,
    "linen": linen_variants,
}
