"""Issue 24: attention weights as a site of every built-in attention (`<attention>.weights`,
`(..., heads, q, k)`), in Equinox, NNX, linen and Haiku — each compared with a hand
computation, a hand-edited model, or `jax.vjp` of the rest of the model, under
`eqx.filter_jit` and `jax.checking_leaks()`."""

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from flax import nnx

import peex_interop as px
from models import close, jitted, nnx_scanned_stack, tokens, transformer, while_hooked_elsewhere

B, T, D, H = 2, 4, 8, 2
HEAD = D // H


def causal():
    return jnp.tril(jnp.ones((T, T), bool))


@dataclasses.dataclass
class Case:
    """One library's attention model: `attn` a child of the root; `q`/`k` the log keys of
    its query/key projections and `heads(log)` their values as (B, T, H, HEAD);
    `values` where its value projection's arrays are (a part of their key path) and
    which of their axes is (or merges) the heads."""

    model: Any
    q: str
    k: str
    heads: Callable[[Any], Any]
    values: dict[str, int]

    def scaled(self, m):
        """The model edited by hand: head h's values times m[h] (a value projection of
        each head's own)."""

        def scale(path, leaf):
            axis = next((a for part, a in self.values.items() if part in jtu.keystr(path)), None)
            if axis is None:
                return leaf
            shape = leaf.shape
            split = leaf.reshape(*shape[:axis], H, shape[axis] // H, *shape[axis + 1 :])
            return (split * m.reshape(H, *[1] * (len(shape) - axis))).reshape(shape)

        return jtu.tree_map_with_path(scale, self.model)

    def ablated(self, h):
        return self.scaled(1.0 - jax.nn.one_hot(h, H))


def merged_heads(a):
    return a.reshape(B, T, H, HEAD)


def same(a):
    return a


class EqxAttention(eqx.Module):
    attn: eqx.nn.MultiheadAttention

    def __call__(self, x):
        return jax.vmap(lambda xi: self.attn(xi, xi, xi, mask=causal()))(x)


def equinox_case():
    model = EqxAttention(eqx.nn.MultiheadAttention(H, D, key=jax.random.key(0)))
    # (H * HEAD, D); no value bias by default.
    return Case(model, "attn.query_proj", "attn.key_proj", merged_heads, {".attn.value_proj.weight": 0})


class NnxAttention(nnx.Module):
    def __init__(self, rngs):
        self.attn = nnx.MultiHeadAttention(num_heads=H, in_features=D, qkv_features=D, decode=False, rngs=rngs)

    def __call__(self, x):
        # dropout_rate 0: NNX calls `jax.nn.dot_product_attention` (the engine's site).
        return self.attn(x, mask=nnx.make_causal_mask(x[..., 0]))


FLAX_VALUES = {"['value']['kernel']": 1, "['value']['bias']": 0}  # (D, H, HEAD), (H, HEAD)


def nnx_case():
    return Case(px.from_nnx(NnxAttention(nnx.Rngs(0))), "attn.query", "attn.key", same, FLAX_VALUES)


class LinenAttention(nn.Module):
    @nn.compact
    def __call__(self, x):
        attention = nn.MultiHeadDotProductAttention(num_heads=H, qkv_features=D, name="attn")
        return attention(x, mask=nn.make_causal_mask(x[..., 0]))


def linen_case(x):
    module = LinenAttention()
    return Case(px.from_linen(module, module.init(jax.random.key(0), x)), "attn.query", "attn.key", same, FLAX_VALUES)


def haiku_case(x):
    def forward(x):
        mask = causal()[None, None]
        return hk.MultiHeadAttention(H, HEAD, w_init=hk.initializers.VarianceScaling(1.0), name="attn")(x, x, x, mask)

    transformed = hk.without_apply_rng(hk.transform(forward))
    model = px.from_haiku(transformed, transformed.init(jax.random.key(0), x))
    # (D, H * HEAD), (H * HEAD,)
    return Case(model, "attn.query", "attn.key", merged_heads, {"['attn/value']['w']": 1, "['attn/value']['b']": 0})


@pytest.fixture(scope="module")
def x():
    return jax.random.normal(jax.random.key(1), (B, T, D))


@pytest.fixture(scope="module", params=["equinox", "nnx", "linen", "haiku"])
def case(request, x):
    if request.param == "equinox":
        return equinox_case()
    if request.param == "nnx":
        return nnx_case()
    return linen_case(x) if request.param == "linen" else haiku_case(x)


def test_weights_are_the_softmax_of_the_logged_projections(case, x):
    hooked = px.ForwardHook(case.model, log_fn=px.IdentityLog(), where=["attn.weights", case.q, case.k])
    out, log = jitted(hooked, x)
    close(out, case.model(x))  # hooked == unhooked
    q, k = case.heads(log[case.q]), case.heads(log[case.k])
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(HEAD)
    expected = jax.nn.softmax(jnp.where(causal(), scores, -jnp.inf), axis=-1)
    assert log["attn.weights"].shape == (B, H, T, T)
    close(log["attn.weights"], expected)
    # Only a selection naming the site selects it: `where=None` logs the layers alone.
    assert "attn.weights" not in px.ForwardHook(case.model, log_fn=px.IdentityLog())(x)[1]


def test_a_head_ablated_through_the_weights_is_the_hand_edited_model(case, x):
    hooked = px.ForwardHook(case.model, hook_fn=lambda w: w.at[..., 1, :, :].set(0), where="attn.weights")
    out, _ = jitted(hooked, x)
    close(out, case.ablated(1)(x))
    assert not np.allclose(out, case.model(x), atol=1e-3)


class HeadMask(px.AbstractHook):
    """A learnable intervention: each head's weights times a trained scale."""

    scale: jax.Array

    def __call__(self, weights):
        return weights * self.scale[:, None, None]


def test_a_trained_head_mask_has_the_gradients_of_the_hand_edited_model(case, x):
    r, scale = jax.random.normal(jax.random.key(3), (B, T, D)), jnp.array([0.7, 1.3])
    hooked = px.ForwardHook(case.model, hook_fn=HeadMask(scale), where="attn.weights")
    with jax.checking_leaks():
        grads = eqx.filter_jit(eqx.filter_grad(lambda hooked: jnp.sum(hooked(x)[0] * r)))(hooked)
    expected = jax.grad(lambda m: jnp.sum(case.scaled(m)(x) * r))(scale)
    close(grads.hook_fn.scale, expected)
    close(hooked(x)[0], case.scaled(scale)(x))


def test_the_cotangent_of_the_weights_is_the_vjp_of_the_rest(case, x):
    r = jax.random.normal(jax.random.key(2), (B, T, D))
    hooked = px.BackwardHook(case.model, log_fn=px.IdentityLog(), where="attn.weights").init(x)

    def loss(hooked):
        return jnp.sum(hooked(x) * r)

    with jax.checking_leaks():
        grads = eqx.filter_jit(eqx.filter_grad(loss))(hooked)
    weights = px.ForwardHook(case.model, log_fn=px.IdentityLog(), where="attn.weights")(x)[1]["attn.weights"]

    def rest(w):  # the model after its weights, as a function of them
        # (each call's own weights: Equinox's model vmaps the attention over the batch)
        return px.ForwardHook(case.model, hook_fn=lambda _, site: w[site.log_index], where="attn.weights")(x)[0]

    _, vjp = jax.vjp(rest, weights)
    close(grads.log["attn.weights"], vjp(r)[0])


def test_scores_are_what_the_softmax_forming_the_weights_receives(case, x):
    # `.scores` (TransformerLens's hook_attn_scores) and `.weights` in one pass.
    hooked = px.ForwardHook(case.model, log_fn=px.IdentityLog(), where=["attn.weights", "attn.scores", case.q, case.k])
    out, log = jitted(hooked, x)
    close(out, case.model(x))
    q, k = case.heads(log[case.q]), case.heads(log[case.k])
    expected = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(HEAD)
    scores = log["attn.scores"]
    assert scores.shape == (B, H, T, T)
    # Each library masks with a value of its own: the masked entries are far below.
    close(jnp.where(causal(), scores, 0.0), jnp.where(causal(), expected, 0.0))
    assert np.all(np.asarray(scores)[..., ~np.asarray(causal())] <= -1e9)
    close(log["attn.weights"], jax.nn.softmax(scores, axis=-1))
    # Selected alone, and left out of `where=None`.
    assert set(jitted(px.ForwardHook(case.model, log_fn=px.IdentityLog(), where="attn.scores"), x)[1]) == {
        "attn.scores"
    }
    assert "attn.scores" not in px.ForwardHook(case.model, log_fn=px.IdentityLog())(x)[1]


def test_edited_scores_change_the_weights_as_the_softmax_predicts(case, x):
    scores = px.ForwardHook(case.model, log_fn=px.IdentityLog(), where="attn.scores")(x)[1]["attn.scores"]

    def edit(s):  # the first key seen more by every query
        return s.at[..., 0].add(2.0)

    hooked = px.ForwardHook(
        case.model, hook_fn=px.HookMap({"attn.scores": edit}), log_fn=px.IdentityLog(),
        where=["attn.scores", "attn.weights"],
    )
    out, log = jitted(hooked, x)
    close(log["attn.scores"], edit(scores))
    close(log["attn.weights"], jax.nn.softmax(edit(scores), axis=-1))
    assert not np.allclose(out, case.model(x), atol=1e-4)


def test_the_cotangent_of_the_scores_is_the_gradient_of_an_added_delta(case, x):
    r = jax.random.normal(jax.random.key(2), (B, T, D))
    hooked = px.BackwardHook(case.model, log_fn=px.IdentityLog(), where="attn.scores").init(x)
    with jax.checking_leaks():
        grads = eqx.filter_jit(eqx.filter_grad(lambda hooked: jnp.sum(hooked(x) * r)))(hooked)
    scores = px.ForwardHook(case.model, log_fn=px.IdentityLog(), where="attn.scores")(x)[1]["attn.scores"]

    def with_delta(delta):
        added = px.ForwardHook(case.model, hook_fn=lambda s, site: s + delta[site.log_index], where="attn.scores")
        return jnp.sum(added(x)[0] * r)

    close(grads.log["attn.scores"], jax.grad(with_delta)(jnp.zeros_like(scores)))


class KeywordAttention(eqx.Module):
    """A model's own attention that passes its scores to the softmax by keyword."""

    proj: eqx.nn.Linear

    def __call__(self, x):
        q = k = jax.vmap(self.proj)(x)
        return jax.nn.softmax(x=q @ k.T, axis=-1) @ x


class TwoAttentions(eqx.Module):
    first: KeywordAttention
    second: eqx.nn.MultiheadAttention

    def __call__(self, x):
        y = self.first(x)
        return self.second(y, y, y)


def test_scores_given_to_the_softmax_by_keyword_are_a_site_too():
    # With another attention's scores reached, a missing one would pass the
    # closed-world check: every attention's scores must be logged.
    keys = jax.random.split(jax.random.key(0))
    first = KeywordAttention(eqx.nn.Linear(D, D, key=keys[0]))
    model = TwoAttentions(first, eqx.nn.MultiheadAttention(H, D, key=keys[1]))
    x = jax.random.normal(jax.random.key(1), (T, D))
    out, log = jitted(px.ForwardHook(model, log_fn=px.IdentityLog(), where=["**.scores", "first.proj"]), x)
    close(out, model(x))
    assert set(log) == {"first.scores", "second.scores", "first.proj"}
    q = log["first.proj"]
    close(log["first.scores"], q @ q.T)


def test_one_step_of_a_scanned_stack():
    model, ids = transformer(num_blocks=3), tokens(seq=T)
    one = px.ForwardHook(model, log_fn=px.IdentityLog(), hook_fn=lambda w: w * 0, where="blocks.1.attn.weights")
    out, one_log = jitted(one, ids)
    close(one_log["blocks.1.attn.weights"], jnp.zeros((H, T, T)))
    # Step 1's weights zeroed: its attention adds nothing (no output bias), as with
    # its value projection zeroed by hand.
    weight = model.blocks.attn.value_proj.weight
    edited = eqx.tree_at(lambda m: m.blocks.attn.value_proj.weight, model, weight.at[1].set(0))
    close(out, edited(ids))


def test_fused_attention_refuses_the_weights():
    class Fused(eqx.Module):
        proj: eqx.nn.Linear

        def __call__(self, x):
            q = jax.vmap(self.proj)(x).reshape(1, T, H, HEAD)
            return jax.nn.dot_product_attention(q, q, q, implementation="cudnn")

    model = Fused(eqx.nn.Linear(D, D, key=jax.random.key(0)))
    with pytest.raises(px.HookError, match=r"layer '' .*implementation='cudnn'.*never formed"):
        jax.eval_shape(px.ForwardHook(model, log_fn=px.IdentityLog(), where="**.weights"), jnp.ones((T, D)))


def test_linen_decode_mode_gives_each_steps_row(x):
    # Decoding one token at a time attends over the cache: step t's weights are row t
    # of the causal weights of the whole sequence (one call without decode).
    kwargs = dict(num_heads=H, qkv_features=D)
    whole = Wrapped(nn.MultiHeadDotProductAttention(**kwargs))
    variables = whole.init(jax.random.key(0), x)
    full = px.ForwardHook(px.from_linen(whole, variables), log_fn=px.IdentityLog(), where="attention.weights")
    expected = full(x, mask=nn.make_causal_mask(x[..., 0]))[1]["attention.weights"]
    decoder = Wrapped(nn.MultiHeadDotProductAttention(**kwargs, decode=True))
    cache = decoder.init(jax.random.key(0), x)["cache"]
    for t in range(T):
        model = px.from_linen(decoder, {"params": variables["params"], "cache": cache}, mutable=["cache"])
        hooked = px.ForwardHook(model, log_fn=px.IdentityLog(), where="attention.weights")
        (_, updates), log = jitted(hooked, x[:, t : t + 1])
        cache = updates["cache"]
        close(log["attention.weights"][:, :, 0, : t + 1], expected[:, :, t, : t + 1])
        close(log["attention.weights"][:, :, 0, t + 1 :], jnp.zeros((B, H, T - t - 1)))


class Wrapped(nn.Module):
    attention: nn.Module

    def __call__(self, x, mask=None):
        return self.attention(x, mask=mask)


def test_other_threads_see_no_weights_site(x):
    # While one thread's hook pauses inside the weights site (patches installed), the
    # same attention called in another thread is the library's own.
    case = equinox_case()
    expected = case.model(x)
    hooked, plain = while_hooked_elsewhere(
        lambda pause: px.ForwardHook(case.model, hook_fn=pause, where="attn.weights")(x)[0],
        lambda: px.ForwardHook(case.model, log_fn=px.IdentityLog())(x),
    )
    close(hooked, expected)
    close(plain[0], expected)
    assert "attn.weights" not in plain[1]


def test_jax_dot_product_attention_weights_with_groups_bias_and_a_causal_mask():
    # 4 query heads sharing 2 key/value heads, a bias and a causal mask: the weights
    # formed for the site give JAX's own output, and are the softmax by hand.
    class Grouped(eqx.Module):
        def __call__(self, q, k, v, bias):
            return jax.nn.dot_product_attention(q, k, v, bias, is_causal=True)

    q, k, v = (jax.random.normal(jax.random.key(i), (B, T, n, HEAD)) for i, n in ((4, 4), (5, 2), (6, 2)))
    bias = jax.random.normal(jax.random.key(7), (1, 4, T, T))
    out, log = px.ForwardHook(Grouped(), log_fn=px.IdentityLog(), where="**.weights")(q, k, v, bias)
    close(out, jax.nn.dot_product_attention(q, k, v, bias, is_causal=True))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, jnp.repeat(k, 2, axis=2)) / np.sqrt(HEAD) + bias
    close(log["weights"], jax.nn.softmax(jnp.where(causal(), scores, -jnp.inf), axis=-1))


def test_nnx_weights_are_one_site_on_both_of_its_paths(x):
    # With dropout NNX forms the weights itself (`dot_product_attention_weights`),
    # without it calls `jax.nn.dot_product_attention`: the same weights either way.
    fused = NnxAttention(nnx.Rngs(0))
    explicit = nnx.clone(fused)
    explicit.attn.dropout_rate = 0.5
    explicit.attn.deterministic = True
    hooked = [px.ForwardHook(px.from_nnx(m), log_fn=px.IdentityLog(), where="attn.weights") for m in (fused, explicit)]
    logs = [h(x)[1] for h in hooked]
    close(logs[1]["attn.weights"], logs[0]["attn.weights"])


def test_patches_are_undone_when_a_hook_raises(x):
    from equinox.nn import _attention as eqx_attention
    from haiku._src import attention as hk_attention

    def fail(weights):
        raise RuntimeError("from the hook")

    attention = jax.nn.dot_product_attention
    for case in (equinox_case(), haiku_case(x)):
        with pytest.raises(RuntimeError, match="from the hook"):
            px.ForwardHook(case.model, hook_fn=fail, where="attn.weights")(x)
    assert eqx_attention.jax is jax and hk_attention.jax is jax
    assert jax.nn.dot_product_attention is attention


STEPS = 3


def _nnx_attention_stack():
    class Block(nnx.Module):
        def __init__(self, rngs):
            self.attn = nnx.MultiHeadAttention(num_heads=H, in_features=D, qkv_features=D, decode=False, rngs=rngs)

        def __call__(self, x):
            return x + self.attn(x)

    module = nnx_scanned_stack(Block, STEPS, nnx.Rngs(0))
    value = module.blocks.attn.value

    def value_of_step_1_zeroed():
        edited = nnx.clone(module)
        edited.blocks.attn.value.kernel[...] = value.kernel[...].at[1].set(0)
        edited.blocks.attn.value.bias[...] = value.bias[...].at[1].set(0)
        return edited

    return px.from_nnx(module), lambda: px.from_nnx(value_of_step_1_zeroed())


def _haiku_attention_stack(x):
    def block(h):
        return h + hk.MultiHeadAttention(H, HEAD, w_init=hk.initializers.VarianceScaling(1.0), name="attn")(h, h, h)

    def forward(x):
        return hk.experimental.layer_stack(STEPS, name="blocks")(block)(x)

    transformed = hk.without_apply_rng(hk.transform(forward))
    params = transformed.init(jax.random.key(0), x)

    def value_of_step_1_zeroed():
        zeroed = jax.tree.map(lambda a: a.at[1].set(0), params["blocks/attn/value"])
        return px.from_haiku(transformed, {**params, "blocks/attn/value": zeroed})

    return px.from_haiku(transformed, params), value_of_step_1_zeroed


def _linen_attention_stack(x):
    class Block(nn.Module):
        @nn.compact
        def __call__(self, h, _):
            return h + nn.MultiHeadDotProductAttention(num_heads=H, qkv_features=D, name="attn")(h), None

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, h):
            scan = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=STEPS)
            return scan(name="blocks")(h, None)[0]

    module = Stack()
    variables = module.init(jax.random.key(0), x)

    def value_of_step_1_zeroed():
        value = jax.tree.map(lambda a: a.at[1].set(0), variables["params"]["blocks"]["attn"]["value"])
        blocks = {**variables["params"]["blocks"], "attn": {**variables["params"]["blocks"]["attn"], "value": value}}
        return px.from_linen(module, {"params": {"blocks": blocks}})

    return px.from_linen(module, variables), value_of_step_1_zeroed


STACKS = {"nnx": lambda x: _nnx_attention_stack(), "haiku": _haiku_attention_stack, "linen": _linen_attention_stack}


@pytest.mark.parametrize("library", list(STACKS))
def test_one_step_of_a_library_stack(library, x):
    # One step's weights: the same as that step's row of every step's, and zeroed
    # there, the model with that step's value projection zeroed by hand (its attention
    # then adds the output projection's bias alone, as with zero weights). Also
    # `**.weights` on linen, whose nn.scan traces its body once silently first.
    model, edited = STACKS[library](x)
    every = "blocks.attn.weights"
    # Haiku's layer_stack names a step after the layer's own path (as for its layers).
    one = "blocks.attn.1.weights" if library == "haiku" else "blocks.1.attn.weights"
    _, all_steps = jitted(px.ForwardHook(model, log_fn=px.IdentityLog(), where=every), x)
    assert all_steps[every].shape == (STEPS, B, H, T, T)
    hooked = px.ForwardHook(model, log_fn=px.IdentityLog(), hook_fn=lambda w: w * 0, where=one)
    out, one_step = jitted(hooked, x)
    close(one_step[one], all_steps[every][1] * 0)
    close(out, edited()(x))
    _, logged = jitted(px.ForwardHook(model, log_fn=px.IdentityLog(), where=one), x)
    close(logged[one], all_steps[every][1])
    _, globbed = jitted(px.ForwardHook(model, log_fn=px.IdentityLog(), where="**.weights"), x)
    assert list(globbed) == [every]
