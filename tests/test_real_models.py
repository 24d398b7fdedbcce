"""Issue 40: every door real models use is a site, on models written by others, used as
written: Hugging Face transformers' Flax GPT-2 and BERT (linen; tiny random configs, no
download) and an NNX model in the shape of the Flax team's Gemma (`gemma_like.py`).
A log of every layer has their logits projections (`lm_head`, `embedder.decode`); their
own attentions' `.weights` equal the models' own `output_attentions`, or the weights
recomputed from the logged projections; a head zeroed through `.weights` is the model
with that head's slice of the output projection zeroed; the backward logs of these
sites are the gradients with respect to an additive delta; `px.sites` and `px.summary`
list them."""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import gemma_like
import peex_interop as px
from models import close, jitted

with warnings.catch_warnings():
    warnings.simplefilter("ignore", FutureWarning)
    from transformers import BertConfig, FlaxBertForMaskedLM, FlaxGPT2LMHeadModel, GPT2Config

LAYERS, HEADS, WIDTH, T = 2, 2, 16, 5
HEAD_DIM = WIDTH // HEADS


@pytest.fixture(scope="module")
def gpt2():
    config = GPT2Config(vocab_size=50, n_positions=16, n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS)
    hf = FlaxGPT2LMHeadModel(config, seed=0)
    ids = jnp.array([[1, 7, 3, 9, 4]])
    args = (ids, jnp.ones_like(ids), jnp.arange(T)[None])
    return hf, px.from_linen(hf.module, {"params": hf.params}), args


@pytest.fixture(scope="module")
def bert():
    config = BertConfig(
        vocab_size=50, hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        intermediate_size=32, max_position_embeddings=16,
    )
    hf = FlaxBertForMaskedLM(config, seed=0)
    ids = jnp.array([[1, 7, 3, 9, 4]])
    args = (ids, jnp.ones_like(ids), jnp.zeros_like(ids), jnp.arange(T)[None], None)
    return hf, px.from_linen(hf.module, {"params": hf.params}), args


GPT2 = dict(fixture="gpt2", head="lm_head", attention="transformer.h.{}.attn")
BERT = dict(fixture="bert", head="cls.predictions.decoder", attention="bert.encoder.layer.{}.attention.self")


@pytest.fixture(params=[GPT2, BERT], ids=["gpt2", "bert"])
def hf_case(request):
    hf, model, args = request.getfixturevalue(request.param["fixture"])
    return request.param, hf, model, args


def test_a_log_of_every_layer_has_the_tied_head_applied_with_its_own_variables(hf_case):
    case, hf, model, args = hf_case
    reference = hf.module.apply({"params": hf.params}, *args)
    out, log = px.ForwardHook(model, log_fn=px.IdentityLog())(*args)
    np.testing.assert_array_equal(out.logits, reference.logits)
    np.testing.assert_array_equal(log[case["head"]], reference.logits)
    assert {row.key for row in px.sites(model, *args)} == set(log)
    _, jitted_log = jitted(px.ForwardHook(model, log_fn=px.IdentityLog()), *args)
    assert set(jitted_log) == set(log)
    close(jitted_log[case["head"]], reference.logits, tol=1e-6)


def test_weights_of_the_models_own_attention_equal_its_output_attentions(hf_case):
    case, hf, model, args = hf_case
    reference = hf.module.apply({"params": hf.params}, *args, output_attentions=True)
    hooked = px.ForwardHook(model, log_fn=px.IdentityLog(), where="**.weights")
    (_, log), (_, jitted_log) = hooked(*args), jitted(hooked, *args)
    assert set(log) == set(jitted_log) == {case["attention"].format(i) + ".weights" for i in range(LAYERS)}
    for i in range(LAYERS):
        np.testing.assert_array_equal(log[case["attention"].format(i) + ".weights"], reference.attentions[i])
        close(jitted_log[case["attention"].format(i) + ".weights"], reference.attentions[i], tol=1e-6)


def gpt2_scores(log, block):
    """GPT-2's scores from its logged `c_attn` output: the scaled query-key products
    plus the causal bias its attention adds (`finfo.min` where masked)."""
    query, key, _ = jnp.split(log[f"transformer.h.{block}.attn.c_attn"], 3, axis=-1)
    query, key = (a.reshape(*a.shape[:2], HEADS, HEAD_DIM) for a in (query, key))
    products = jnp.einsum("bqhd,bkhd->bhqk", query / np.sqrt(HEAD_DIM), key)
    return products + jnp.where(jnp.tril(jnp.ones((T, T), bool)), 0.0, jnp.finfo(products.dtype).min)


def test_gpt2_scores_and_weights_in_one_pass_and_an_edit_of_the_scores(gpt2):
    hf, model, args = gpt2
    reference = hf.module.apply({"params": hf.params}, *args, output_attentions=True)
    hooked = px.ForwardHook(model, log_fn=px.IdentityLog(), where=["**.weights", "**.scores", "**.c_attn"])
    out, log = jitted(hooked, *args)
    close(out.logits, reference.logits, tol=1e-6)
    for i in range(LAYERS):
        scores = log[f"transformer.h.{i}.attn.scores"]
        close(scores, gpt2_scores(log, i), tol=1e-5)
        close(log[f"transformer.h.{i}.attn.weights"], jax.nn.softmax(scores, axis=-1), tol=1e-6)
        close(log[f"transformer.h.{i}.attn.weights"], reference.attentions[i], tol=1e-6)

    def edit(s):  # the first token seen less by every query of head 1
        return s.at[:, 1, :, 0].add(-2.0)

    site = "transformer.h.0.attn"
    edited = px.ForwardHook(
        model, hook_fn=px.HookMap({f"{site}.scores": edit}), log_fn=px.IdentityLog(),
        where=[f"{site}.scores", f"{site}.weights"],
    )
    out, edited_log = jitted(edited, *args)
    close(edited_log[f"{site}.weights"], jax.nn.softmax(edit(log[f"{site}.scores"]), axis=-1), tol=1e-6)
    assert not np.allclose(out.logits, reference.logits, atol=1e-4)


def _without_head(case, params, block, head):
    """The params with `head`'s slice of `block`'s attention output projection zeroed."""
    params = jax.tree.map(lambda x: x, params)  # new dicts, shared arrays
    if case is GPT2:
        proj = params["transformer"]["h"][str(block)]["attn"]["c_proj"]
        proj["kernel"] = proj["kernel"].at[:, head * HEAD_DIM : (head + 1) * HEAD_DIM].set(0)  # (out, in)
    else:
        proj = params["bert"]["encoder"]["layer"][str(block)]["attention"]["output"]["dense"]
        proj["kernel"] = proj["kernel"].at[head * HEAD_DIM : (head + 1) * HEAD_DIM].set(0)  # (in, out)
    return params


def test_a_head_zeroed_through_its_weights_is_the_model_without_that_heads_slice(hf_case):
    case, hf, model, args = hf_case
    site = case["attention"].format(1) + ".weights"
    edited, _ = jitted(px.ForwardHook(model, hook_fn=lambda w: w.at[:, 1].set(0.0), where=site), *args)
    by_hand = hf.module.apply({"params": _without_head(case, hf.params, 1, 1)}, *args)
    close(edited.logits, by_hand.logits, tol=1e-5)
    assert not np.allclose(edited.logits, hf.module.apply({"params": hf.params}, *args).logits)


def test_backward_logs_of_the_new_sites_are_the_gradients_of_an_added_delta(hf_case):
    case, hf, model, args = hf_case
    weights = case["attention"].format(0) + ".weights"

    def loss(output):
        return jnp.sum(jnp.tanh(output.logits))

    hooked = px.BackwardHook(model, log_fn=px.IdentityLog(), where=[case["head"], weights]).init(*args)
    with jax.checking_leaks():
        grads = eqx.filter_grad(lambda h: loss(h(*args)))(hooked)

    def with_deltas(deltas):
        edits = {case["head"]: lambda y: y + deltas[0], weights: lambda w: w + deltas[1]}
        return loss(px.ForwardHook(model, hook_fn=px.HookMap(edits), where=list(edits))(*args)[0])

    _, log = px.ForwardHook(model, log_fn=px.IdentityLog(), where=[case["head"], weights])(*args)
    expected = jax.grad(with_deltas)((jnp.zeros_like(log[case["head"]]), jnp.zeros_like(log[weights])))
    close(grads.log[case["head"]], expected[0], tol=1e-6)
    close(grads.log[weights], expected[1], tol=1e-6)


def test_sites_and_summary_list_the_new_sites(hf_case):
    case, _, model, args = hf_case
    inner = {row.key: row for row in px.sites(model, *args, inner=True)}
    assert case["head"] in inner
    for i in range(LAYERS):
        row = inner[case["attention"].format(i) + ".weights"]
        assert row.kind == "attention_weights" and row.output_shapes == ((1, HEADS, T, T),)
    text = str(px.summary(model, *args))
    assert case["head"] in text
    # `inner=` is summary's own keyword (as for px.sites), not passed on to the model.
    rows = px.summary(model, *args, inner=True).rows
    assert [row.key for row in rows] == list(inner)
    assert [row.key for row in px.summary(model, *args).rows] == [row.key for row in px.sites(model, *args)]


# -- the Gemma-shaped NNX model ----------------------------------------------------------
def gemma(**config):
    model = gemma_like.Transformer(gemma_like.Config(**config), rngs=nnx.Rngs(0))
    tokens = jnp.array([[1, 2, 3, 4, 5]])
    return model, (tokens, jnp.arange(T)[None], None, gemma_like.causal_mask(T))


def recomputed_scores(attention, qkv, positions, mask):
    """The scores of a Gemma attention (what its softmax receives) from its logged
    projection outputs, computed here as the example's attention computes them."""
    if attention.use_qkv_einsum:
        query, key, _ = qkv
    else:
        query, (key, _) = qkv
    query = gemma_like.apply_rope(query, positions) * attention.query_pre_attn_scalar
    key = gemma_like.apply_rope(key, positions)
    key = jnp.repeat(key, query.shape[2] // key.shape[2], axis=2)
    logits = jnp.einsum("BTNH,BSNH->BTNS", query, key)
    return jnp.where(mask[:, :, None, :], logits, gemma_like.K_MASK)


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["qkv_einsum", "grouped"])
def test_gemma_logits_projection_and_own_attention(kv_heads):
    model, args = gemma(kv_heads=kv_heads)
    converted = px.from_nnx(model)
    logits, _ = model(*args)
    out, log = px.ForwardHook(converted, log_fn=px.IdentityLog())(*args)
    np.testing.assert_array_equal(out[0], logits)
    np.testing.assert_array_equal(log["embedder.decode"], logits)  # the tied logits projection
    assert "embedder.encode" in log

    projections = "qkv_einsum" if kv_heads == 2 else ["q_einsum", "kv_einsum"]
    where = ["**.weights", "**.scores", *(f"**.{p}" for p in np.atleast_1d(projections))]
    _, log = jitted(px.ForwardHook(converted, log_fn=px.IdentityLog(), where=where), *args)
    for i, layer in enumerate(model.layers):
        qkv = log[f"layers.{i}.attn.qkv_einsum"] if kv_heads == 2 else (
            log[f"layers.{i}.attn.q_einsum"], log[f"layers.{i}.attn.kv_einsum"])
        scores = recomputed_scores(layer.attn, qkv, args[1], args[3])  # (B, T, N, S): the model's layout
        close(log[f"layers.{i}.attn.scores"], scores, tol=1e-6)
        close(log[f"layers.{i}.attn.weights"], jax.nn.softmax(scores, axis=-1), tol=1e-6)


def test_gemma_scores_edited_change_the_weights_as_the_softmax_predicts():
    model, args = gemma()
    converted = px.from_nnx(model)
    site = "layers.1.attn"
    scores = px.ForwardHook(converted, log_fn=px.IdentityLog(), where=f"{site}.scores")(*args)[1][f"{site}.scores"]

    def edit(s):  # head 0 sees the first token more, from every query
        return s.at[:, :, 0, 0].add(3.0)

    hooked = px.ForwardHook(
        converted, hook_fn=px.HookMap({f"{site}.scores": edit}), log_fn=px.IdentityLog(),
        where=[f"{site}.scores", f"{site}.weights"],
    )
    out, log = jitted(hooked, *args)
    close(log[f"{site}.weights"], jax.nn.softmax(edit(scores), axis=-1), tol=1e-6)
    assert not np.allclose(out[0], model(*args)[0], atol=1e-4)


def test_gemma_head_zeroed_through_its_weights_is_the_model_without_that_heads_output():
    model, args = gemma()
    converted = px.from_nnx(model)
    ablated = px.ForwardHook(converted, hook_fn=lambda w: w.at[:, :, 1].set(0.0), where="layers.1.attn.weights")
    edited, _ = jitted(ablated, *args)
    by_hand = nnx.clone(model)
    vec = by_hand.layers[1].attn.attn_vec_einsum.w
    vec[...] = vec[...].at[1].set(0.0)  # (heads, head_dim, width)
    close(edited[0], by_hand(*args)[0], tol=1e-5)


def test_gemma_backward_logs_of_logits_and_weights_are_the_gradients_of_an_added_delta():
    model, args = gemma()
    converted = px.from_nnx(model)
    sites = ["embedder.decode", "layers.0.attn.weights"]

    def loss(out):
        return jnp.sum(jnp.tanh(out[0]))

    hooked = px.BackwardHook(converted, log_fn=px.IdentityLog(), where=sites).init(*args)
    with jax.checking_leaks():
        grads = eqx.filter_grad(lambda h: loss(h(*args)))(hooked)
    _, log = px.ForwardHook(converted, log_fn=px.IdentityLog(), where=sites)(*args)

    def with_deltas(deltas):
        edits = {site: (lambda value, d=d: value + d) for site, d in zip(sites, deltas)}
        return loss(px.ForwardHook(converted, hook_fn=px.HookMap(edits), where=sites)(*args)[0])

    expected = jax.grad(with_deltas)([jnp.zeros_like(log[site]) for site in sites])
    for site, gradient in zip(sites, expected):
        close(grads.log[site], gradient, tol=1e-6)


def test_gemma_sites_summary_decode_cache_and_sown_residuals():
    model, args = gemma(sow=True)
    converted = px.from_nnx(model)
    rows = {row.key: row for row in px.sites(converted, *args, inner=True)}
    assert rows["embedder.decode"].kind == "method" and rows["layers.0.attn.weights"].kind == "attention_weights"
    summary = px.summary(converted, *args)
    # The embedder is reached through its methods only: its parameters show on its first.
    assert rows["embedder.encode"].trainable == model.embedder.input_embedding[...].size
    layers = [row.path.rpartition(".")[0] if row.kind == "method" else row.path for row in summary.rows]
    top = [row for row, layer in zip(summary.rows, layers) if not any(layer.startswith(p + ".") for p in layers)]
    assert sum(row.trainable for row in top) == summary.total[0] == px.total_params(converted)[0]

    with warnings.catch_warnings(record=True) as plain:
        warnings.simplefilter("always")
        model(*args)
    with warnings.catch_warnings(record=True) as hooked:
        warnings.simplefilter("always")
        px.ForwardHook(converted, log_fn=px.IdentityLog())(*args)
    assert sorted(map(str, (w.message for w in hooked))) == sorted(map(str, (w.message for w in plain)))

    # One decode step with a cache: the hooked call is the model's, and its weights
    # attend over the cache.
    decoder, _ = gemma()
    cache = decoder.init_cache(8, 1)
    token, position = jnp.array([[3]]), jnp.array([[0]])
    mask = jnp.zeros((1, 1, 8), bool).at[:, :, 0].set(True)
    step = px.from_nnx(decoder)
    logits, new_cache = decoder(token, position, cache, mask)
    hooked = px.ForwardHook(step, log_fn=px.IdentityLog(), where="**.weights")
    (out, hooked_cache), log = hooked(token, position, cache, mask)
    np.testing.assert_array_equal(out, logits)
    jax.tree.map(np.testing.assert_array_equal, hooked_cache, new_cache)
    assert log["layers.0.attn.weights"].shape == (1, 1, HEADS, 8)
    close(log["layers.0.attn.weights"][..., 0], 1.0)
