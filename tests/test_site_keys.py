"""Issue 48: every key `px.sites(inner=True)` lists selects exactly its site, by `where=`
and by `layer_names=` (a second call `lin@1` that call only, a site inside a layer, a
value the root model sows, a function site of the root), on models of every library
and on real ones (HF Flax GPT-2, tunix's Qwen3); a typo's closest paths come from that
list."""

import warnings

import equinox as eqx
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import peex_interop as px
import tunix_models

with warnings.catch_warnings():
    warnings.simplefilter("ignore", FutureWarning)
    from transformers import FlaxGPT2LMHeadModel, GPT2Config

EVERYTHING = ["**", px.kind("attention_weights", "attention_scores", "function")]


class Twice(eqx.Module):
    lin: eqx.nn.Linear
    attn: eqx.nn.MultiheadAttention

    def __call__(self, x):
        h = jax.nn.gelu(self.lin(self.lin(x)))
        return self.attn(h[None], h[None], h[None])[0]


class NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        y = self.lin(self.lin(x))
        self.sow(nnx.Intermediate, "y", y)
        return jnp.tanh(y)


def equinox_model():
    k1, k2 = jax.random.split(jax.random.key(0))
    model = Twice(eqx.nn.Linear(4, 4, key=k1), eqx.nn.MultiheadAttention(2, 4, key=k2))
    return px.function_sites(model, jax.nn.gelu), (jnp.arange(4.0),), {}


def haiku_model():
    def forward(x):
        lin = hk.Linear(4, name="lin")
        return hk.Linear(2, name="out")(jax.nn.relu(lin(lin(x))))

    transformed = hk.without_apply_rng(hk.transform(forward))
    x = jnp.arange(4.0)
    return px.from_haiku(transformed, transformed.init(jax.random.key(0), x)), (x,), {}


def nnx_model():
    return px.from_nnx(NnxBlock(nnx.Rngs(0))), (jnp.arange(4.0),), {}


def gpt2_model():
    hf = FlaxGPT2LMHeadModel(GPT2Config(vocab_size=20, n_positions=8, n_embd=8, n_layer=1, n_head=2), seed=0)
    ids = jnp.array([[1, 7, 3]])
    return px.from_linen(hf.module, {"params": hf.params}), (ids, jnp.ones_like(ids), jnp.arange(3)[None]), {}


def qwen3_model():
    ids = tunix_models.tokens(1, 3)
    return px.from_nnx(tunix_models.qwen3(num_layers=1)), tunix_models.inputs(ids), {"output_hidden_states": True}


def _calls_of(key, keys):
    """What selecting `key` logs: that call; a layer's bare path names all its calls."""
    return {k for k in keys if k == key or ("@" not in key and k.startswith(key + "@"))}


@pytest.mark.parametrize(
    "build, values",
    [(equinox_model, False), (haiku_model, True), (nnx_model, True), (gpt2_model, False), (qwen3_model, False)],
    ids=["equinox", "haiku", "nnx", "gpt2", "qwen3"],
)
def test_every_key_px_sites_lists_selects_its_site(build, values):
    model, args, kwargs = build()
    keys = [row.key for row in px.sites(model, *args, inner=True, **kwargs)]
    assert len(keys) == len(set(keys))

    def logged(**selection):
        def run(args):
            return px.ForwardHook(model, log_fn=px.IdentityLog(), **selection)(*args, **kwargs)[1]

        # Eager where the values are compared; shapes only for the models whose eager
        # calls take long (values of each kind of site are compared to independent
        # computations in their own tests).
        return run(args) if values else eqx.filter_eval_shape(run, args)

    everything = logged(where=EVERYTHING)
    assert set(everything) == set(keys)
    for key in keys:
        for selection in (dict(where=key), dict(layer_names=[key])):
            log = logged(**selection)
            assert set(log) == _calls_of(key, keys), (selection, sorted(log))
            for k in log:
                if values:
                    jax.tree.map(np.testing.assert_array_equal, log[k], everything[k])
                else:
                    assert [jnp.shape(a) for a in jax.tree.leaves(log[k])] == [
                        jnp.shape(a) for a in jax.tree.leaves(everything[k])
                    ]


def test_a_typo_of_a_root_site_lists_the_closest_keys_of_the_call():
    model, args, kwargs = qwen3_model()
    with pytest.raises(px.HookError, match=r"'all_hiden_states' selected no call.*all_hidden_states"):
        eqx.filter_eval_shape(
            lambda a: px.ForwardHook(model, log_fn=px.IdentityLog(), layer_names=["all_hiden_states"])(*a, **kwargs),
            args,
        )
    model, args, _ = equinox_model()
    with pytest.raises(px.HookError, match=r"'lin@2' selected no call.*lin@1"):
        px.ForwardHook(model, log_fn=px.IdentityLog(), where="lin@2")(*args)
    with pytest.raises(px.HookError, match=r"'lni' matches no layer.*closest available paths: lin"):
        px.ForwardHook(model, log_fn=px.IdentityLog(), layer_names=["lni"])
