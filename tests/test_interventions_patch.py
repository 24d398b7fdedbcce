"""Issue 12: `px.cache`, `px.patch` and the ablation hooks, in Equinox, NNX and Haiku
stacks of layers, each compared with a forward pass written out by hand (no hooks),
under `eqx.filter_jit` and `jax.checking_leaks()`."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import peex_interop as px
from models import close, tokens, transformer

STEPS, T, W = 3, 5, 3


def jitted(fn, *args):
    with jax.checking_leaks():
        return eqx.filter_jit(fn)(*args)


def run(model, *args):
    return jitted(lambda m, *a: m(*a), model, *args)


@pytest.fixture(scope="module")
def model():
    return transformer(num_blocks=STEPS)


@pytest.fixture(scope="module")
def inputs():
    clean = tokens(1, seq=T)
    return clean, clean.at[2].set((clean[2] + 1) % 11)


@pytest.fixture(scope="module")
def clean_cache(model, inputs):
    """Every layer's output and inputs on the clean tokens, taken once."""
    _, cache = jitted(lambda m, x: px.cache(m, x, inputs=True), model, inputs[0])
    return cache


def only(cache, *keys):
    return {key: cache[key] for key in keys}


def manual(model, x, edit_block=lambda i, h: h, edit_attn=lambda i, a: a):
    """The Transformer's forward pass written out, block by block: `edit_block(i, h)`
    edits block i's output (the residual stream), `edit_attn(i, a)` its attention
    output. Returns (output, block outputs, attention outputs), stacked per block."""
    h = jax.vmap(model.embed)(x)
    arrays, static = eqx.partition(model.blocks, eqx.is_array)
    blocks, attns = [], []
    for i in range(model.num_blocks):
        block = eqx.combine(jax.tree.map(lambda a: a[i], arrays), static)
        normed = jax.vmap(block.norm1)(h)
        attns.append(edit_attn(i, block.attn(normed, normed, normed)))
        h = h + attns[-1]
        h = edit_block(i, h + jax.vmap(block.mlp)(jax.vmap(block.norm2)(h)))
        blocks.append(h)
    return jax.vmap(model.head)(h), jnp.stack(blocks), jnp.stack(attns)


def test_cache_is_the_forward_pass(model, inputs):
    clean, _ = inputs
    out, cache = jitted(lambda m, x: px.cache(m, x, where=["blocks", "blocks.attn"]), model, clean)
    expected, blocks, attns = manual(model, clean)
    assert set(cache) == {"blocks", "blocks.attn"}
    close(out, expected)
    close(cache["blocks"], blocks)
    close(cache["blocks.attn"], attns)


def test_patching_every_layer_gives_the_clean_output(model, inputs, clean_cache):
    clean, corrupted = inputs
    clean_out = model(clean)
    assert not np.allclose(model(corrupted), clean_out, atol=1e-3)
    close(run(px.patch(model, clean_cache), corrupted), clean_out)
    # The residual stream alone suffices; so do the inputs of the head.
    close(run(px.patch(model, only(clean_cache, "blocks")), corrupted), clean_out)
    close(run(px.patch(model, only(clean_cache, "head:in"), inputs=True), corrupted), clean_out)


class MaskedAttention(eqx.Module):
    """Equinox's attention per example, called with keyword arguments (a mask that
    depends on the input, or None; a Python flag)."""

    attn: eqx.nn.MultiheadAttention
    causal: bool = eqx.field(static=True)

    def __call__(self, xs):
        def one(x):
            keep = jnp.broadcast_to(x[:, 0] > -0.5, (len(x), len(x)))
            mask = jnp.tril(keep) | jnp.eye(len(x), dtype=bool) if self.causal else None
            return self.attn(x, x, x, mask=mask, inference=True)

        return jax.vmap(one)(xs)


@pytest.mark.parametrize("causal", [True, False])
def test_patched_inputs_keep_their_keyword_arguments(causal):
    model = MaskedAttention(eqx.nn.MultiheadAttention(2, 4, key=jax.random.key(0)), causal)
    clean, corrupted = (jax.random.normal(jax.random.key(i), (2, T, 4)) for i in (1, 2))
    assert not np.allclose(model(corrupted), model(clean), atol=1e-3)
    _, cache = jitted(lambda m, x: px.cache(m, x, inputs=True, where="attn"), model, clean)
    _, kwargs = cache["attn:in"]
    assert (kwargs["mask"] is None) == (not causal)
    # The clean queries, keys, values and mask in place: the clean output, per example.
    close(run(px.patch(model, cache, "attn", inputs=True), corrupted), model(clean))


def at_step_1(current, cached, site):
    return jnp.where(site.step == 1, cached, current)


def test_patching_one_step_is_the_hand_computed_effect(model, inputs, clean_cache):
    clean, corrupted = inputs
    _, clean_blocks, _ = manual(model, clean)
    expected, _, _ = manual(model, corrupted, edit_block=lambda i, h: clean_blocks[1] if i == 1 else h)
    whole = only(clean_cache, "blocks")
    _, one = px.cache(model, clean, where="blocks.1")
    assert one["blocks.1"].shape == (T, 8)
    # One step, patched from a cache of that step or of the whole stack.
    close(run(px.patch(model, one), corrupted), expected)
    close(run(px.patch(model, whole, "blocks.1"), corrupted), expected)
    # The same through `fn` and the traced step.
    by_step = px.patch(model, whole, "blocks", fn=at_step_1)
    close(run(by_step, corrupted), expected)


def test_patching_inside_a_vmap_inside_the_stack(model, inputs):
    # The projections run under a vmap over positions inside the scanned stack: each
    # call takes its own (step, position) entry. Clean queries, keys and values give
    # every block its clean attention output.
    clean, corrupted = inputs
    projections = ["blocks.attn.query_proj", "blocks.attn.key_proj", "blocks.attn.value_proj"]
    _, cache = jitted(lambda m, x: px.cache(m, x, where=projections), model, clean)
    assert cache["blocks.attn.value_proj"].shape == (STEPS, T, 8)
    _, _, clean_attns = manual(model, clean)
    close(run(px.patch(model, cache), corrupted), manual(model, corrupted, edit_attn=lambda i, a: clean_attns[i])[0])


def patch_one(model, cache, corrupted, layer, position):
    """The corrupted run with the clean residual stream patched in at one layer and
    position, both traced."""

    def fn(current, cached, site):
        return jnp.where((site.step == layer) & (jnp.arange(T) == position)[:, None], cached, current)

    return px.patch(model, cache, "blocks", fn=fn)(corrupted)


def check_sweep(model, cache, corrupted, by_hand):
    """Every layer x position in one compiled call equals the loop of single patches
    and `by_hand(layer, position)`, the same patch written out."""
    grid = jnp.meshgrid(jnp.arange(STEPS), jnp.arange(T), indexing="ij")
    every = jax.vmap(jax.vmap(patch_one, (None, None, None, 0, 0)), (None, None, None, 0, 0))
    swept = jitted(every, model, cache, corrupted, *grid)
    single = eqx.filter_jit(patch_one)
    with jax.checking_leaks():
        # Array indices, so that the loop compiles once.
        loop = [
            [single(model, cache, corrupted, *jnp.asarray((layer, position))) for position in range(T)]
            for layer in range(STEPS)
        ]
    close(swept, jnp.asarray(loop))
    close(swept, jax.jit(jax.vmap(jax.vmap(by_hand)))(*grid))


def test_vmapped_sweep_equals_the_loop_of_single_patches(model, inputs, clean_cache):
    clean, corrupted = inputs
    cache = only(clean_cache, "blocks")
    _, clean_blocks, _ = manual(model, clean)

    def by_hand(layer, position):
        def edit(i, h):
            return jnp.where((i == layer) & (jnp.arange(T) == position)[:, None], clean_blocks[i], h)

        return manual(model, corrupted, edit_block=edit)[0]

    check_sweep(model, cache, corrupted, by_hand)
    # One cell as a patch of one step.
    one_step = px.patch(model, cache, "blocks.2", fn=lambda current, cached, site: current.at[3].set(cached[3]))
    close(run(one_step, corrupted), by_hand(2, 3))


def test_ablations_equal_hand_edited_models(model, inputs, clean_cache):
    clean, _ = inputs
    batch = jnp.stack([tokens(key, seq=T) for key in range(4)])
    _, batched = jax.vmap(lambda x: px.cache(model, x, where="blocks.attn"))(batch)
    assert batched["blocks.attn"].shape == (4, STEPS, T, 8)
    means = jnp.mean(jax.vmap(lambda x: manual(model, x)[2])(batch), axis=0)

    out = run(px.ForwardHook(model, hook_fn=px.MeanAblation(batched), where="blocks.attn"), clean)[0]
    close(out, manual(model, clean, edit_attn=lambda i, a: means[i])[0])
    out = run(px.ForwardHook(model, hook_fn=px.ZeroAblation(), where="blocks.1.attn"), clean)[0]
    close(out, manual(model, clean, edit_attn=lambda i, a: jnp.zeros_like(a) if i == 1 else a)[0])
    # Mixed with a patch in one wrapper: the first matching pattern wins.
    hooks = {"blocks.0.attn": px.ZeroAblation(), "blocks.attn": px.CachePatch(only(clean_cache, "blocks.attn"))}
    out = run(px.ForwardHook(model, hook_fn=hooks, where="blocks.attn"), batch[0])[0]
    _, _, clean_attns = manual(model, clean)
    close(out, manual(model, batch[0], edit_attn=lambda i, a: jnp.zeros_like(a) if i == 0 else clean_attns[i])[0])


def test_patched_model_can_be_hooked_again(model, inputs):
    clean, corrupted = inputs
    _, cache = px.cache(model, clean, where="blocks.1")
    patched = px.patch(model, cache)
    out, log = run(px.ForwardHook(patched, log_fn=px.IdentityLog(), where="blocks"), corrupted)
    _, clean_blocks, _ = manual(model, clean)
    expected, blocks, _ = manual(model, corrupted, edit_block=lambda i, h: clean_blocks[1] if i == 1 else h)
    close(out, expected)
    close(log["blocks"], blocks)  # the outer log sees the patched values


def test_missing_or_misshapen_cache_entries_raise(model, inputs, clean_cache):
    clean, corrupted = inputs
    cache = only(clean_cache, "blocks")
    with pytest.raises(px.HookError, match=r"no entry 'head'.*its keys: blocks"):
        px.patch(model, cache, "head")(corrupted)
    with pytest.raises(px.HookError, match=r"'blocks\.1\.attn'"):
        px.patch(model, cache, "blocks.1.attn")(corrupted)
    with pytest.raises(px.HookError, match="cache is empty"):
        px.patch(model, {})
    with pytest.raises(px.HookError, match="must keep shapes"):
        px.patch(model, {"blocks": cache["blocks"][:, :2]})(corrupted)
    with pytest.raises(px.HookError, match=r"no entry 'blocks\.attn'"):
        px.ForwardHook(model, hook_fn=px.MeanAblation(cache), where="blocks.attn")(clean)


def test_nnx_stack():
    nnx = pytest.importorskip("flax.nnx")

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(W, W, rngs=rngs)

        def __call__(self, x):
            return x + jnp.tanh(self.lin(x))

    class Stack(nnx.Module):
        def __init__(self, rngs):
            self.blocks = nnx.vmap(lambda key: Block(nnx.Rngs(key)))(jax.random.split(rngs.params(), STEPS))

        def __call__(self, x):  # (T, W)
            return nnx.scan(lambda c, m: m(c), in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(x, self.blocks)

    module = Stack(nnx.Rngs(0))
    kernel, bias = module.blocks.lin.kernel[...], module.blocks.lin.bias[...]

    def by_hand(x, edit=lambda i, h: h):
        hs = []
        for i in range(STEPS):
            x = edit(i, x + jnp.tanh(x @ kernel[i] + bias[i]))
            hs.append(x)
        return x, jnp.stack(hs)

    clean = jax.random.normal(jax.random.key(1), (T, W))
    corrupted = clean.at[2].add(1.0)
    model = px.from_nnx(module)
    out, cache = jitted(lambda m, x: px.cache(m, x, where="blocks"), model, clean)
    expected, clean_blocks = by_hand(clean)
    close(out, expected)
    close(cache["blocks"], clean_blocks)
    close(run(px.patch(model, cache), corrupted), expected)
    one_step = by_hand(corrupted, lambda i, h: clean_blocks[1] if i == 1 else h)[0]
    close(run(px.patch(model, cache, "blocks.1"), corrupted), one_step)

    def edit_at(layer, position):
        return lambda i, h: jnp.where((i == layer) & (jnp.arange(T) == position)[:, None], clean_blocks[i], h)

    check_sweep(model, cache, corrupted, lambda layer, position: by_hand(corrupted, edit_at(layer, position))[0])


def test_haiku_layer_stack():
    hk = pytest.importorskip("haiku")

    def forward(x):
        return hk.experimental.layer_stack(STEPS, name="blocks")(lambda h: jnp.tanh(hk.Linear(W, name="lin")(h)))(x)

    transformed = hk.without_apply_rng(hk.transform(forward))
    clean = jnp.asarray([0.3, -0.2, 0.9])
    corrupted = clean.at[0].set(-1.0)
    params = transformed.init(jax.random.key(0), clean)
    model = px.from_haiku(transformed, params)
    w, b = params["blocks/lin"]["w"], params["blocks/lin"]["b"]

    def by_hand(x, edit=lambda i, y: y):
        linears = []
        for i in range(STEPS):
            linears.append(edit(i, x @ w[i] + b[i]))
            x = jnp.tanh(linears[-1])
        return x, jnp.stack(linears)

    expected, clean_linears = by_hand(clean)
    # The stack's body calls no module of its own: its layers are the linears.
    out, cache = jitted(lambda m, x: px.cache(m, x, where="blocks.lin"), model, clean)
    close(out, expected)
    close(cache["blocks.lin"], clean_linears)
    close(run(px.patch(model, cache), corrupted), expected)
    by_step = px.patch(model, cache, fn=at_step_1)
    one_step = by_hand(corrupted, lambda i, y: clean_linears[1] if i == 1 else y)[0]
    close(run(by_step, corrupted), one_step)
    close(run(px.patch(model, cache, "blocks.lin.1"), corrupted), one_step)
