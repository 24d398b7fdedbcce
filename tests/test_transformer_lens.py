"""Issue 48: px's interpretability workflows give TransformerLens's numbers on the same
weights. A tiny Hugging Face Flax GPT-2 (random weights, biases and LayerNorms included)
through `px.from_linen`; TransformerLens (build/tl-venv, `make tl-venv`; skipped with a
message without it) runs a `HookedTransformer` holding the same weights, unprocessed
(tests/transformer_lens_reference.py, one subprocess per session: the `tl_gpt2` fixture).

- `px.cache` gives `run_with_cache`'s values, hook by hook, in TransformerLens's layout
  after the reshape each row names;
- TransformerLens's activation patching (`transformer_lens.patching`) equals one
  compiled `px.patch_sweep` per function (which tests/test_patching_sweeps.py checks
  against a loop of `px.patch`ed forwards, one per cell)."""

import jax.numpy as jnp
import numpy as np
import pytest

import peex_interop as px
import transformer_lens_harness as harness

# TransformerLens hook (in block {i}) -> (the px site, whether its inputs are read, the
# value in TransformerLens's layout). HF GPT-2's activations are (batch, position, ...)
# as TransformerLens's are; its attention's heads are (batch, position, head, d_head)
# after splitting the features head-major; its scores and weights are
# (batch, head, query, key), TransformerLens's layout.
ROWS = {
    # The block's input (its first argument); 0: the token plus position embeddings.
    "hook_resid_pre": ("transformer.h.{i}", True, lambda v, c: v[0][0]),
    # The block's output, a 1-tuple (HF returns attentions beside it when asked).
    "hook_resid_post": ("transformer.h.{i}", False, lambda v, c: v[0]),
    # c_attn's output is [q | k | v] along the features, each split into heads.
    "attn.hook_q": ("transformer.h.{i}.attn.c_attn", False, lambda v, c: heads(jnp.split(v, 3, -1)[0], c)),
    "attn.hook_k": ("transformer.h.{i}.attn.c_attn", False, lambda v, c: heads(jnp.split(v, 3, -1)[1], c)),
    "attn.hook_v": ("transformer.h.{i}.attn.c_attn", False, lambda v, c: heads(jnp.split(v, 3, -1)[2], c)),
    # Causal entries only: the masked ones differ (test below).
    "attn.hook_attn_scores": ("transformer.h.{i}.attn.scores", False, lambda v, c: v),
    "attn.hook_pattern": ("transformer.h.{i}.attn.weights", False, lambda v, c: v),
    # The heads' outputs, merged head-major: the output projection's input.
    "attn.hook_z": ("transformer.h.{i}.attn.c_proj", True, lambda v, c: heads(v[0][0], c)),
    # The attention's output, a 1-tuple; the output projection's bias included in both.
    "hook_attn_out": ("transformer.h.{i}.attn", False, lambda v, c: v[0]),
    "mlp.hook_pre": ("transformer.h.{i}.mlp.c_fc", False, lambda v, c: v),
    # HF's gelu_new is `partial(jax.nn.gelu, approximate=True)`: a function site.
    "mlp.hook_post": ("transformer.h.{i}.mlp.gelu", False, lambda v, c: v),
    "hook_mlp_out": ("transformer.h.{i}.mlp", False, lambda v, c: v),
}


def heads(features, case):
    """(batch, position, heads * d_head) -> (batch, position, head, d_head)."""
    return features.reshape(*features.shape[:2], case.n_heads, case.d_head)


def assert_matches(px_value, tl_value, tol=1e-5):
    """Equal within `tol` relative to the reference's largest magnitude."""
    tl_value = np.asarray(tl_value)
    np.testing.assert_allclose(np.asarray(px_value), tl_value, rtol=tol, atol=tol * np.max(np.abs(tl_value)))


@pytest.fixture(scope="module")
def px_clean(tl_gpt2):
    """px's cache of the clean run: every site a row names (and the logits), explicitly."""
    case = tl_gpt2
    where = sorted({site.format(i=i) for site, _, _ in ROWS.values() for i in range(case.n_layers)} | {"lm_head"})
    return px.cache(case.model, *case.inputs(case.clean), where=where, inputs=True)


@pytest.mark.parametrize("hook", list(ROWS))
def test_px_cache_is_run_with_cache(tl_gpt2, px_clean, hook):
    case, (_, cache) = tl_gpt2, px_clean
    site, inputs, to_tl = ROWS[hook]
    for i in range(case.n_layers):
        value = to_tl(cache[site.format(i=i) + (":in" if inputs else "")], case)
        reference = case.tl[f"cache/blocks.{i}.{hook}"]
        assert value.shape == reference.shape, (hook, value.shape, reference.shape)
        if hook == "attn.hook_attn_scores":
            causal = np.tril(np.ones(reference.shape[-2:], bool))
            value, reference = np.asarray(value)[..., causal], reference[..., causal]
        assert_matches(value, reference)


def test_logits_and_metric(tl_gpt2, px_clean):
    case, (output, cache) = tl_gpt2, px_clean
    assert_matches(cache["lm_head"], case.tl["logits/clean"])
    assert_matches(output.logits, case.tl["logits/clean"])
    corrupted = case.model(*case.inputs(case.corrupted)).logits
    assert_matches(corrupted, case.tl["logits/corrupted"])
    assert_matches(case.metric(output), case.tl["metric/clean"])
    assert_matches(case.metric_of_logits(corrupted), case.tl["metric/corrupted"])
    # The two runs differ in the metric, so that patching has something to move.
    assert abs(case.tl["metric/clean"] - case.tl["metric/corrupted"]) > 0.5


def test_masked_scores_are_finfo_min_in_px_and_minus_inf_in_transformer_lens(tl_gpt2, px_clean):
    """HF adds `finfo(float32).min` above the diagonal (a bias), TransformerLens puts
    `-inf` there: the same weights after the softmax, different scores."""
    case, (_, cache) = tl_gpt2, px_clean
    for i in range(case.n_layers):
        scores = np.asarray(cache[f"transformer.h.{i}.attn.scores"])
        reference = case.tl[f"cache/blocks.{i}.attn.hook_attn_scores"]
        masked = ~np.tril(np.ones(reference.shape[-2:], bool))
        assert np.all(reference[..., masked] == -np.inf)
        assert np.all(scores[..., masked] == np.finfo(np.float32).min)


@pytest.fixture(scope="module")
def patch_cache(tl_gpt2):
    return harness.clean_cache(tl_gpt2)


def sweep_spec(name, case):
    """TransformerLens's patching function `name` as `px.patch_sweep`'s where/inputs/cells
    (the table of docs/patching.md): positions are axis 1 of (batch, pos, features)
    values, heads the head-major groups of the output projection's input."""
    site, inputs, by_position, by_head = harness.PATCH_SITES[name]
    cells = (*([px.Along(1)] if by_position else []), *([px.Groups(-1, case.n_heads)] if by_head else []))
    return dict(where=site.format("*"), inputs=inputs, cells=cells)


@pytest.mark.parametrize("name", list(harness.PATCH_SITES))
def test_px_patch_sweep_is_transformer_lens_patching(tl_gpt2, patch_cache, name):
    """One compiled `px.patch_sweep` per function, TransformerLens's table, cell by cell
    (its metric averages the batch's logit differences: so does the case's)."""
    case = tl_gpt2
    table = px.patch_sweep(case.model, patch_cache, *case.inputs(case.corrupted), metric=case.metric,
                           **sweep_spec(name, case))
    reference = case.tl[f"patching/{name}"]
    assert_matches(table, reference)
    assert np.ptp(reference) > 0.1  # not a constant: some cells move the metric


def sweep_of(case, metric_where, **spec):
    _, cache = px.cache(case.model, *case.inputs(case.clean), where=metric_where, inputs=True)
    return px.patch_sweep(case.model, cache, *case.inputs(case.corrupted), metric=case.metric, **spec)


def test_a_sweep_of_the_weights_head_axis_is_pattern_patching(tl_gpt2):
    """`get_act_patch_attn_head_pattern_all_pos`: the weights' head axis, 1 in (batch,
    head, query, key)."""
    case, where = tl_gpt2, "transformer.h.*.attn.weights"
    reference = case.tl["patching/get_act_patch_attn_head_pattern_all_pos"]
    assert_matches(sweep_of(case, where, where=where, cells=px.Along(1)), reference)
    assert np.ptp(reference) > 0.1


def test_hf_gpt2_has_no_resid_mid_site(tl_gpt2):
    """docs/patching.md says so: HF's block keeps the residual sum in a local, and the
    second LayerNorm's input is only the MLP's; patching it is not TransformerLens's
    `get_act_patch_resid_mid`."""
    case, where = tl_gpt2, "transformer.h.*.ln_2"
    table = sweep_of(case, where, where=where, inputs=True, cells=px.Along(1))
    assert not np.allclose(table, case.tl["patching/get_act_patch_resid_mid"], atol=1e-2)


def test_one_sweep_of_c_attn_is_the_query_key_and_value_patching(tl_gpt2):
    """`get_act_patch_attn_head_{q,k,v}_all_pos` in one table: c_attn's output is
    [q | k | v], each head-major."""
    case, where = tl_gpt2, "transformer.h.*.attn.c_attn"
    table = sweep_of(case, where, where=where, cells=px.Groups(-1, 3 * case.n_heads))
    for i, part in enumerate("qkv"):
        reference = case.tl[f"patching/get_act_patch_attn_head_{part}_all_pos"]
        assert_matches(table[:, i * case.n_heads : (i + 1) * case.n_heads], reference)
        assert np.ptp(reference) > 0.01


def test_skipped_with_a_message_without_the_venv(monkeypatch, tmp_path):
    monkeypatch.setattr(harness, "TL_VENV", tmp_path / "absent")
    monkeypatch.setattr(harness, "TL_PYTHON", tmp_path / "absent" / "bin" / "python")
    assert not harness.available()
    with pytest.raises(pytest.skip.Exception, match="make tl-venv"):
        harness.skip_unless_available()
