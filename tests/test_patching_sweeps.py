"""Issue 48: `px.patch_sweep` (TransformerLens's `patching.get_act_patch_*`, any model,
any site) and `px.path_patch`/`px.path_patch_sweep`, each compared with a Python loop
of plain `px.patch`/`px.ForwardHook` forward passes on the same weights, one per cell
(its cell cut out by slicing, not by the sweeps' masks): on Hugging Face's Flax GPT-2
(linen), an Equinox scanned stack (steps are rows) and an NNX `nnx.scan` stack."""

import itertools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import peex_interop as px
from models import close, nnx_scanned_stack, tokens, transformer

with warnings.catch_warnings():
    warnings.simplefilter("ignore", FutureWarning)
    from transformers import FlaxGPT2LMHeadModel, GPT2Config

LAYERS, HEADS, WIDTH, T = 2, 2, 16, 6


def answer(out):
    """A logit difference at the last position (any scalar of the output would do)."""
    logits = out.logits if hasattr(out, "logits") else out
    return jnp.sum(logits[..., -1, 3] - logits[..., -1, 5])


@pytest.fixture(scope="module")
def gpt2():
    config = GPT2Config(vocab_size=16, n_positions=8, n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS,
                        initializer_range=0.1)  # effects well above float rounding
    hf = FlaxGPT2LMHeadModel(config, seed=0)
    model = px.from_linen(hf.module, {"params": hf.params})
    clean_ids = jnp.array([[1, 7, 3, 9, 4, 2]])
    rest = (jnp.ones_like(clean_ids), jnp.arange(T)[None])
    corrupted_ids = clean_ids.at[0, 1].set(11)
    where = ["transformer.h.*", "transformer.h.*.attn.c_proj", "transformer.h.*.attn.c_attn", "transformer.h.*.mlp"]
    _, cache = px.cache(model, clean_ids, *rest, where=where, inputs=True)
    return model, cache, (corrupted_ids, *rest)


def cut(value, cells, index):
    """`value`'s cell `index` as a tuple of slices (Along: one index; Groups: a range)."""
    slices = [slice(None)] * value.ndim
    for part, i in zip(cells, index):
        size = value.shape[part.axis]
        width = size // part.count if isinstance(part, px.Groups) else 1
        slices[part.axis % value.ndim] = slice(i * width, (i + 1) * width)
    return tuple(slices)


def looped(model, cache, args, rows, cells, counts, inputs=False):
    """One `px.patch` forward per row and cell, the cell set by slicing."""
    table = np.zeros((len(rows), *counts))
    for r, row in enumerate(rows):
        for index in itertools.product(*(range(n) for n in counts)):

            def fn(current, cached, site, index=index):
                if inputs:
                    (x, *rest), kwargs = current
                    at = cut(x, cells, index)
                    return (x.at[at].set(cached[0][0][at]), *rest), kwargs
                at = jax.tree.map(lambda leaf: cut(leaf, cells, index), current)
                return jax.tree.map(lambda c, k, a: c.at[a].set(k[a]), current, cached, at)

            table[(r, *index)] = answer(px.patch(model, cache, row, fn=fn, inputs=inputs)(*args))
    return table


# TransformerLens's sweeps on GPT-2, in px terms: (where, cells, inputs).
GPT2_SWEEPS = {
    "resid_pre": ("transformer.h.*", (px.Along(1),), True),
    "attn_head_out_all_pos": ("transformer.h.*.attn.c_proj", (px.Groups(-1, HEADS),), True),
    "attn_head_out_by_pos": ("transformer.h.*.attn.c_proj", (px.Along(1), px.Groups(-1, HEADS)), True),
    "mlp_out": ("transformer.h.*.mlp", (px.Along(1),), False),
}


@pytest.mark.parametrize("sweep", GPT2_SWEEPS, ids=list(GPT2_SWEEPS))
def test_gpt2_sweeps_equal_a_loop_of_patches(gpt2, sweep):
    model, cache, args = gpt2
    where, cells, inputs = GPT2_SWEEPS[sweep]
    table = px.patch_sweep(model, cache, *args, where=where, cells=cells, inputs=inputs, metric=answer)
    rows = px.sweep_rows(model, *args, where=where, inputs=inputs)
    assert rows == [where.replace("*", str(i)) for i in range(LAYERS)]
    counts = {"attn_head_out_all_pos": (HEADS,), "attn_head_out_by_pos": (T, HEADS)}.get(sweep, (T,))
    assert table.shape == (LAYERS, *counts)
    expected = looped(model, cache, args, rows, cells, counts, inputs)
    assert np.ptp(expected) > 1e-3  # the cells differ: the table is no constant
    close(table, expected, tol=1e-4)


def test_batch_size_gives_the_same_table(gpt2):
    model, cache, args = gpt2
    where, cells, inputs = GPT2_SWEEPS["attn_head_out_by_pos"]
    whole = px.patch_sweep(model, cache, *args, where=where, cells=cells, inputs=inputs, metric=answer)
    batched = px.patch_sweep(model, cache, *args, where=where, cells=cells, inputs=inputs, metric=answer, batch_size=5)
    close(batched, whole, tol=1e-5)


def test_a_scanned_stacks_steps_are_rows_under_checking_leaks():
    model = transformer(num_blocks=2)
    clean = tokens(1, seq=4)
    corrupted = clean.at[2].set((clean[2] + 1) % 11)
    _, cache = px.cache(model, clean, where=["blocks", "blocks.attn.output_proj"], inputs=True)
    with jax.checking_leaks():
        table = px.patch_sweep(model, cache, corrupted, where="blocks", cells=px.Along(0), inputs=True, metric=answer)
    assert px.sweep_rows(model, corrupted, where="blocks", inputs=True) == ["blocks.0", "blocks.1"]
    close(table, looped(model, cache, (corrupted,), ["blocks.0", "blocks.1"], (px.Along(0),), (4,), True))
    # Equinox's attention projects each position in a vmap: a row's value is (T, width)
    # though each call sees one position; the cell is cut by the call's position index.
    heads = px.patch_sweep(
        model, cache, corrupted, where="blocks.attn.output_proj", inputs=True,
        cells=(px.Along(0), px.Groups(-1, 2)), metric=answer,
    )
    assert heads.shape == (2, 4, 2)
    for position, head in itertools.product((0, 3), range(2)):  # cells of step 1

        def fn(current, cached, site, position=position, head=head):
            (x, *rest), kwargs = current
            at = slice(4 * head, 4 * head + 4)
            return (jnp.where(site.indices[1] == position, x.at[at].set(cached[0][0][at]), x), *rest), kwargs

        patched = px.patch(model, cache, "blocks.1.attn.output_proj", fn=fn, inputs=True)
        close(heads[1, position, head], answer(patched(corrupted)))


def test_an_nnx_scanned_stack():
    class Block(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(4, 4, rngs=rngs)

        def __call__(self, x):
            return x + jnp.tanh(self.lin(x))

    model = px.from_nnx(nnx_scanned_stack(Block, 2, nnx.Rngs(0)))
    clean = jax.random.normal(jax.random.key(1), (T, 4))
    corrupted = clean.at[1].add(1.0)
    _, cache = px.cache(model, clean, where="blocks.lin")
    metric = lambda out: out[-1].sum()
    table = px.patch_sweep(model, cache, corrupted, where="blocks.lin", cells=px.Along(-1), metric=metric)
    rows = px.sweep_rows(model, corrupted, where="blocks.lin")
    assert rows == ["blocks.0.lin", "blocks.1.lin"] and table.shape == (2, 4)
    expected = np.zeros((2, 4))
    for step, neuron in itertools.product(range(2), range(4)):
        fn = lambda current, cached, site, n=neuron: current.at[..., n].set(cached[..., n])
        expected[step, neuron] = px.patch(model, cache, rows[step], fn=fn)(corrupted)[-1].sum()
    close(table, expected)


def test_errors_name_the_layer_and_the_shapes(gpt2):
    model, cache, args = gpt2
    sweep = lambda **kw: px.patch_sweep(model, cache, *args, metric=answer, **kw)
    with pytest.raises(px.HookError, match=r"transformer\.h\.0\.attn\.c_proj.*\(1, 6, 16\).*3 equal groups"):
        sweep(where="transformer.h.*.attn.c_proj", inputs=True, cells=px.Groups(-1, 3))
    with pytest.raises(px.HookError, match=r"transformer\.h\.0\.mlp.*axis 3 is out of range.*\(1, 6, 16\)"):
        sweep(where="transformer.h.*.mlp", cells=px.Along(3))
    with pytest.raises(px.HookError, match=r"no entry 'transformer\.h\.0\.mlp\.c_fc'"):
        sweep(where="transformer.h.*.mlp.c_fc")
    with pytest.raises(px.HookError, match="selects no call"):
        sweep(where=px.kind("conv"))
    small = {key: value[..., :3] for key, value in cache.items() if key == "transformer.h.0.mlp"}
    with pytest.raises(px.HookError, match=r"transformer\.h\.0\.mlp.*\(1, 6, 3\).*\(1, 6, 16\)"):
        px.patch_sweep(model, small, *args, where="transformer.h.0.mlp", metric=answer)


# Path patching: head 1 of block 0 -> the query of head 0 of block 1, every head's
# output (the input of its c_proj) and every MLP frozen.
HEAD = px.Groups(-1, HEADS)
FREEZE = [px.Component("transformer.h.*.attn.c_proj", inputs=True), px.Component("transformer.h.*.mlp")]


def two_passes(model, cache, args, frozen, sender_block, sender_head, receiver_block, receiver_group):
    """Pass 1 and pass 2 written out with `px.ForwardHook` and `px.patch`."""
    width = WIDTH // HEADS

    def heads_in(block):
        def hook(inputs):
            (x, *rest), kwargs = inputs
            x = frozen[f"transformer.h.{block}.attn.c_proj:in"][0][0]
            if block == sender_block:
                at = slice(sender_head * width, (sender_head + 1) * width)
                x = x.at[..., at].set(cache[f"transformer.h.{block}.attn.c_proj:in"][0][0][..., at])
            return (x, *rest), kwargs

        return hook

    receiver = f"transformer.h.{receiver_block}.attn.c_attn"
    pass_1 = px.ForwardHook(
        model,
        pre_hook_fn={f"transformer.h.{b}.attn.c_proj": heads_in(b) for b in range(LAYERS)},
        hook_fn={f"transformer.h.{b}.mlp": (lambda _, b=b: frozen[f"transformer.h.{b}.mlp"]) for b in range(LAYERS)},
        log_fn={receiver: px.IdentityLog()},
        where=["transformer.h.*.attn.c_proj", "transformer.h.*.mlp", receiver],
    )
    _, recorded = pass_1(*args)
    at = slice(receiver_group * width, (receiver_group + 1) * width)
    fn = lambda current, cached, site: current.at[..., at].set(cached[..., at])
    return px.patch(model, dict(recorded), receiver, fn=fn)(*args)


@pytest.fixture(scope="module")
def frozen(gpt2):
    model, _, args = gpt2
    return px.cache(model, *args, where=["transformer.h.*.attn.c_proj", "transformer.h.*.mlp"], inputs=True)[1]


def test_path_patch_is_the_two_passes_written_out(gpt2, frozen):
    model, cache, args = gpt2
    out = px.path_patch(
        model, cache, *args,
        sender=px.Component("transformer.h.0.attn.c_proj", HEAD, inputs=True), sender_cell=1,
        receiver=px.Component("transformer.h.1.attn.c_attn", px.Groups(-1, 3 * HEADS)), receiver_cell=2 * HEADS,
        freeze=FREEZE,
    )  # the receiver: block 1's head 0's values (queries, keys, values: 3 x HEADS groups)
    expected = two_passes(model, cache, args, frozen, 0, 1, 1, 2 * HEADS)
    close(out.logits, expected.logits)
    assert np.abs(out.logits - model(*args).logits).max() > 1e-4  # well above rounding: something was patched


def test_path_patch_sweep_over_every_pair_of_heads(gpt2, frozen):
    model, cache, args = gpt2
    table = px.path_patch_sweep(
        model, cache, *args,
        sender=px.Component("transformer.h.*.attn.c_proj", HEAD, inputs=True),
        receiver=px.Component("transformer.h.*.attn.c_attn", px.Groups(-1, 3 * HEADS)),
        freeze=FREEZE, metric=answer,
    )
    assert table.shape == (LAYERS, HEADS, LAYERS, 3 * HEADS)  # queries, keys, values of each head
    for head, group in itertools.product(range(HEADS), range(3 * HEADS)):  # block 0 -> block 1
        close(table[0, head, 1, group], answer(two_passes(model, cache, args, frozen, 0, head, 1, group)), tol=1e-5)
    assert np.ptp(table[0, :, 1]) > 1e-4
    # A receiver before its sender receives nothing: the corrupted run.
    close(table[1, :, 0], jnp.full((HEADS, 3 * HEADS), answer(model(*args))), tol=1e-5)


def test_an_mlp_to_the_unembedding(gpt2):
    model, cache, args = gpt2
    out = px.path_patch(
        model, cache, *args,
        sender=px.Component("transformer.h.0.mlp"),
        receiver=px.Component("lm_head", inputs=True),
        freeze=FREEZE,
    )
    # Every other component frozen, the MLP's output reaches the unembedding through the
    # residual stream only: the final norm's input is the corrupted one plus the change.
    _, corrupted_log = px.cache(model, *args, where=["transformer.ln_f", "transformer.h.0.mlp"], inputs=True)
    delta = cache["transformer.h.0.mlp"] - corrupted_log["transformer.h.0.mlp"]
    final_in = corrupted_log["transformer.ln_f:in"][0][0] + delta
    ln_f = px.ForwardHook(
        model, pre_hook_fn=lambda a: ((final_in,), a[1]), log_fn=px.IdentityLog(), where="transformer.ln_f"
    )
    normed = ln_f(*args)[1]["transformer.ln_f"]
    expected = px.patch(model, {"lm_head:in": ((normed,), {})}, "lm_head", inputs=True)(*args)
    close(out.logits, expected.logits)
    assert np.abs(out.logits - model(*args).logits).max() > 1e-4


def test_a_metric_of_the_final_residual_gives_the_logit_differences(gpt2):
    """`metric_site="transformer.ln_f"`: the same table from the final residual stream
    dotted with the difference of two unembedding columns (the unembedding of every
    position no longer computed), for a sweep and a path patch sweep."""
    model, cache, args = gpt2
    embedding = model.variables["params"]["transformer"]["wte"]["embedding"]  # tied to the unembedding
    direction = embedding[3] - embedding[5]
    final = lambda normed: jnp.sum(normed[..., -1, :] @ direction)
    where, cells, inputs = GPT2_SWEEPS["resid_pre"]
    sweep = lambda **kw: px.patch_sweep(model, cache, *args, where=where, cells=cells, inputs=inputs, **kw)
    close(sweep(metric=final, metric_site="transformer.ln_f"), sweep(metric=answer), tol=1e-5)
    paths = lambda **kw: px.path_patch_sweep(
        model, cache, *args, sender=px.Component("transformer.h.0.mlp"),
        receiver=px.Component("transformer.h.1.attn.c_proj", HEAD, inputs=True), freeze=FREEZE, **kw)
    close(paths(metric=final, metric_site="transformer.ln_f"), paths(metric=answer), tol=1e-5)
    with pytest.raises(px.HookError, match=r"metric_site='transformer\.h\.\*' selects 2 calls"):
        sweep(metric=final, metric_site="transformer.h.*")


def test_rows_are_in_call_order_past_ten_layers():
    """Eleven layers: row i is layer i (a log's keys, sorted as strings, would put
    `layers.10` before `layers.2`)."""
    import equinox as eqx

    class Deep(eqx.Module):
        layers: list

        def __call__(self, x):
            for layer in self.layers:
                x = x + layer(x)  # a residual stream: each layer's patch reaches the output
            return x

    keys = jax.random.split(jax.random.key(0), 11)
    model = Deep([eqx.nn.Linear(3, 3, key=k) for k in keys])
    clean, corrupted = jnp.arange(3.0), -jnp.arange(3.0)
    _, cache = px.cache(model, clean, where="layers.*")
    rows = px.sweep_rows(model, corrupted, where="layers.*")
    assert rows == [f"layers.{i}" for i in range(11)]
    table = px.patch_sweep(model, cache, corrupted, where="layers.*", cells=px.Along(0), metric=jnp.sum)
    first = lambda current, cached, site: current.at[0].set(cached[0])  # one feature: the rest differs
    expected = [jnp.sum(px.patch(model, cache, row, fn=first)(corrupted)) for row in rows]
    close(table[:, 0], jnp.stack(expected), tol=1e-6)
    assert np.ptp(np.asarray(expected)) > 1e-3
