"""Ports of LLMs made of their own layer classes (issue 46): tunix 0.1.7's Gemma3 and
Gemma (vendored, `third_party/tunix`), Hugging Face's Flax Gemma. Every layer holding
parameters is aligned, ported or refused by name; a user's declarations port across
implementations (docs/migrating.md runs the Hugging Face -> tunix -> Flax example ->
Hugging Face round trip and Qwen3 across remat configurations)."""

from unittest import mock

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import peex_interop as px
import tunix_models as tm
from peex_interop._migration import _transfer


@pytest.fixture(scope="module")
def gemma3_pair():
    return px.from_nnx(tm.gemma3(seed=0)), px.from_nnx(tm.gemma3(seed=1)), tm.inputs(tm.tokens())


def test_two_instances_of_one_class_align_completely_and_port_exactly(gemma3_pair):
    source, destination, args = gemma3_pair
    alignment = px.align(source, destination, *args)
    assert not (alignment.unmatched or alignment.ambiguous or alignment.unknown)
    # tunix's own layers are matched: its Einsums, RMSNorms, the embedder's methods.
    for path in ("layers.0.attn.q_einsum", "layers.1.attn.attn_vec_einsum", "layers.0.pre_attention_norm",
                 "final_norm", "embedder.encode", "embedder.decode"):
        assert alignment.mapping[path] == path
    assert "of unknown layout" in str(alignment)
    ported, comparison = px.port(source, destination, *args)
    assert jnp.array_equal(ported(*args)[0], source(*args)[0])
    assert not jnp.array_equal(destination(*args)[0], source(*args)[0])
    into_abstract, _ = px.port(source, px.from_nnx(tm.gemma3(seed=2, abstract=True)), *args)
    assert jnp.array_equal(into_abstract(*args)[0], source(*args)[0])


def test_an_edited_projection_is_the_first_divergence(gemma3_pair):
    source, destination, args = gemma3_pair
    ported, _ = px.port(source, destination, *args)
    module = px.to_nnx(ported)
    module.layers[1].attn.q_einsum.w[...] = module.layers[1].attn.q_einsum.w[...] * 1.5
    comparison = px.compare(source, px.from_nnx(module), *args)
    assert comparison.first_divergence.path_a == "layers.1.attn.q_einsum"


def test_a_layer_left_out_is_refused_by_name_never_a_ported_one(gemma3_pair):
    source, destination, args = gemma3_pair
    mapping = dict(px.align(source, destination, *args).layer_mapping)
    del mapping["layers.1.attn.attn_vec_einsum"]
    # The attention block is mapped (through its `block` method): its parts must be.
    with pytest.raises(px.HookError, match=r"mapping does not cover \['layers\.1\.attn\.attn_vec_einsum'\]"):
        px.port(source, destination, *args, mapping=mapping)
    # Without the blocks, the port's own check names the array no layer wrote.
    mapping = {a: b for a, b in mapping.items() if not any(other.startswith(a + ".") for other in mapping)}
    with pytest.raises(px.HookError, match=r"px.port: the mapping leaves 1 of the destination's arrays .*"
                                           r"layers\.1\.attn\.attn_vec_einsum\.w"):
        px.port(source, destination, *args, mapping=mapping)


def test_a_destination_is_untouched_by_an_interrupted_port(gemma3_pair):
    source, destination, args = gemma3_pair
    before = jax.tree.map(np.asarray, destination.state)
    calls = []
    real_fit = _transfer.fit

    def interrupted(*fit_args):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real_fit(*fit_args)

    with mock.patch.object(_transfer, "fit", interrupted), pytest.raises(KeyboardInterrupt):
        px.port(source, destination, *args, progress=True)
    assert len(calls) == 5
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, destination.state), before)


class _Tokens(eqx.Module):
    model: object
    hugging_face: bool = eqx.field(static=True)

    def __call__(self, ids):
        if self.hugging_face:
            return self.model(ids, jnp.ones_like(ids), tm.positions(ids)).logits
        return self.model(*tm.inputs(ids))[0]


def test_grouped_queries_split_into_q_and_a_fused_kv_and_back():
    from transformers.models.gemma import modeling_flax_gemma as hf_gemma

    from third_party.tunix.models.gemma import model as tunix_gemma

    heads = ("heads", "head_dim")
    einsums = {
        "BTD,NDH->BTNH": px.declare("attention_in", kernel=px.at("w", "heads", "in", "head_dim")),
        "BSD,CKDH->CBSKH": px.declare("attention_in", kernel=px.at("w", "kv", "heads", "in", "head_dim"),
                                      members={"kv": ("k", "v")}),
        "BTNH,NHD->BTD": px.declare("attention_out", kernel=px.at("w", "heads", "head_dim", "out")),
    }
    layouts = {
        hf_gemma.FlaxGemmaRMSNorm: px.declare("norm", scale=px.at("weight", "features", offset=1.0)),
        "**.self_attn.o_proj": px.declare("attention_out", kernel=px.at("kernel", heads, "out")),
        "**.self_attn.*_proj": px.declare("attention_in", kernel=px.at("kernel", "in", heads)),
        tunix_gemma.RMSNorm: px.declare("norm", scale=px.at("scale", "features", offset=1.0)),
        tunix_gemma.Embedder: px.declare("embedding", embedding=px.at("input_embedding", "vocab", "features")),
        tunix_gemma.Einsum: lambda layer: einsums[layer.einsum_str],
    }
    mapping = {"model.model.embed_tokens": "model.embedder", "model.model.norm": "model.final_norm"}
    for i in range(tm.LAYERS):
        a, b = f"model.model.layers.{i}", f"model.layers.{i}"
        mapping |= {
            f"{a}.input_layernorm": f"{b}.pre_attention_norm", f"{a}.post_attention_layernorm": f"{b}.pre_ffw_norm",
            f"{a}.self_attn.q_proj": f"{b}.attn.q_einsum",
            (f"{a}.self_attn.k_proj", f"{a}.self_attn.v_proj"): f"{b}.attn.kv_einsum",
            f"{a}.self_attn.o_proj": f"{b}.attn.attn_vec_einsum",
            **{f"{a}.mlp.{p}": f"{b}.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")},
        }
    ids = tm.tokens()
    module, params = tm.hf_gemma(seed=0, num_key_value_heads=2)
    hugging_face = _Tokens(px.from_linen(module, {"params": params}), True)
    tunix = _Tokens(px.from_nnx(tm.gemma_gqa(seed=1)), False)
    # Without declarations, tunix's own layers are reported, none silently left out.
    alignment = px.align(hugging_face, tunix, ids)
    unknown = {path for side, path, _ in alignment.unknown if side == "b"}
    assert {"model.layers.0.attn.q_einsum", "model.layers.0.attn.kv_einsum", "model.final_norm"} <= unknown
    with pytest.raises(px.HookError, match="of unknown layout"):
        px.port(hugging_face, tunix, ids)
    ported, comparison = px.port(hugging_face, tunix, ids, mapping=mapping, layouts=layouts,
                                 unchecked=["model.model.embed_tokens"])
    assert "model.model.layers.0.self_attn.k_proj + model.model.layers.0.self_attn.v_proj" in {
        row.path_a for row in comparison.rows
    }
    assert jnp.max(jnp.abs(ported(ids) - hugging_face(ids))) < 1e-5
    # The kv einsum split back into k and v, exactly.
    back = {value: key for key, value in mapping.items()}
    fresh = _Tokens(px.from_linen(module, {"params": tm.hf_gemma(seed=5, num_key_value_heads=2)[1]}), True)
    returned, _ = px.port(ported, fresh, ids, mapping=back, layouts=layouts, unchecked=["model.embedder"])
    assert jnp.array_equal(returned(ids), hugging_face(ids))
    # A declaration naming axes its kind lacks is refused before anything is read.
    with pytest.raises(px.HookError, match=r"'model.layers.0.attn.q_einsum'.*axes \['heads', 'in'\]"):
        wrong = {**layouts, tunix_gemma.Einsum: px.declare("attention_in", kernel=px.at("w", "heads", "in"))}
        px.transfer_params(hugging_face, tunix, mapping, layouts=wrong)


def test_same_names_and_shapes_only_as_stored():
    class Scale(nnx.Module):
        def __init__(self, n, rngs):
            self.gain = nnx.Param(jax.random.normal(rngs.params(), (n,)))

        def __call__(self, x):
            return x * self.gain[...]

    class Net(nnx.Module):
        def __init__(self, n, seed):
            self.scale = Scale(n, nnx.Rngs(seed))

        def __call__(self, x):
            return self.scale(x)

    x = jnp.ones((2, 3))
    with pytest.raises(px.HookError, match=r"'scale'.*no known parameter layout, holding gain \(3,\).*gain \(4,\)"):
        px.transfer_params(px.from_nnx(Net(3, 0)), px.from_nnx(Net(4, 1)), {"scale": "scale"})
    ported = px.transfer_params(px.from_nnx(Net(3, 0)), px.from_nnx(Net(3, 1)), {"scale": "scale"}, inputs=x)
    assert jnp.array_equal(ported(x), px.from_nnx(Net(3, 0))(x))


class _Gain(eqx.Module):
    gain: jax.Array
    shift: jax.Array

    def __call__(self, x):
        return jnp.tanh(x * self.gain + self.shift)


class _ScannedGains(eqx.Module):
    """A scanned stack of a layer class of its own, built by `eqx.filter_vmap`."""

    blocks: _Gain

    def __init__(self, seed, steps=3, width=4):
        keys = jax.random.split(jax.random.key(seed), steps)
        self.blocks = eqx.filter_vmap(
            lambda k: _Gain(jax.random.normal(k, (width,)), jax.random.normal(jax.random.fold_in(k, 1), (width,)))
        )(keys)

    def __call__(self, x):
        dynamic, static = eqx.partition(self.blocks, eqx.is_array)
        return jax.lax.scan(lambda h, d: (eqx.combine(d, static)(h), None), x, dynamic)[0]


def test_a_scanned_stack_of_a_layer_class_of_its_own_ports_exactly():
    x = jax.random.normal(jax.random.key(9), (4,))
    source = _ScannedGains(0)
    alignment = px.align(source, _ScannedGains(1), x)
    assert alignment.mapping == {"blocks": "blocks"}
    ported, comparison = px.port(source, _ScannedGains(1), x)
    assert jnp.array_equal(ported(x), source(x))
    with pytest.raises(px.HookError, match=r"'blocks'.*no known parameter layout.*gain \(3, 4\).*gain \(4, 4\)"):
        px.port(source, _ScannedGains(1, steps=4), x, mapping={"blocks": "blocks"})
