"""Statistics leave the compiled step packed (`px.PackedLog`, `px.Stats`): one array per
dtype for every layer, read back as the same values."""

import pytest

pytest.importorskip("haiku")  # skipped where the [haiku] extra is not installed

import equinox as eqx
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

import peex_interop as px

call = eqx.filter_jit(lambda hooked, x: hooked(x))


@pytest.fixture(scope="module")
def haiku_mlp():
    transformed = hk.transform(lambda x: hk.nets.MLP([8, 8, 3])(x))
    x = jax.random.normal(jax.random.key(1), (6, 5))
    return px.from_haiku(transformed, transformed.init(jax.random.key(0), x)), x


def test_a_statistics_log_is_two_arrays_holding_every_layers_statistics(haiku_mlp):
    model, x = haiku_mlp
    out, log = call(px.ForwardHook(model, log_fn=px.activation_stats()), x)
    raw_out, raw = call(px.ForwardHook(model, log_fn=px.IdentityLog()), x)
    assert isinstance(log, px.PackedLog) and set(log) == set(raw) and len(raw) == 4
    assert sorted(leaf.dtype.name for leaf in jax.tree.leaves(log)) == ["float32", "int32"]
    np.testing.assert_array_equal(out, raw_out)
    for key, values in raw.items():
        values = np.asarray(values)
        np.testing.assert_allclose(log[key]["mean"], values.mean(), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(log[key]["std"], values.std(), rtol=1e-5)
        np.testing.assert_allclose(log[key]["near_zero"], np.mean(values <= 0.05))
        histogram = log[key]["hist"]
        np.testing.assert_array_equal(histogram.counts, np.histogram(values, bins=np.asarray(histogram.edges))[0])
    # One statistic alone packs too: its values are plain arrays.
    _, stds = call(px.ForwardHook(model, log_fn=px.StdLog()), x)
    assert isinstance(stds, px.PackedLog) and len(jax.tree.leaves(stds)) == 1
    for key, values in raw.items():
        np.testing.assert_allclose(stds[key], np.std(values), rtol=1e-5)


def test_packed_logs_read_the_same_on_the_host_and_as_shapes(haiku_mlp):
    model, x = haiku_mlp
    hooked = px.ForwardHook(model, log_fn=px.activation_stats())
    _, log = call(hooked, x)
    host = jax.device_get(log)
    shapes = eqx.filter_eval_shape(lambda h, x: h(x)[1], hooked, x)
    for key in log:
        for name in log[key]:
            values = zip(*(jax.tree.leaves(tree[key][name]) for tree in (log, host, shapes)), strict=True)
            for got, on_host, shape in values:
                assert isinstance(on_host, np.ndarray | np.generic)  # unpacked on the host
                np.testing.assert_array_equal(on_host, got)
                assert (shape.shape, shape.dtype) == (got.shape, got.dtype)
    with pytest.raises(KeyError):
        log["no such layer"]
    # Re-keyed (px.rename), it stays packed around the same buffers.
    renamed = px.rename(log, {key: f"old/{key}" for key in log})
    assert isinstance(renamed, px.PackedLog) and renamed.buffers == log.buffers
    assert [f"old/{key}" for key in log] == list(renamed)
    np.testing.assert_array_equal(renamed[f"old/{key}"]["hist"].counts, log[key]["hist"].counts)


def test_packed_logs_keep_the_axes_of_a_vmap_around_the_model_and_pool_packed():
    model = eqx.nn.MLP(5, 3, 8, 2, key=jax.random.key(0))
    xs = jax.random.normal(jax.random.key(1), (4, 5))
    hooked = px.ForwardHook(model, log_fn=px.activation_stats(axis_name="batch"))
    _, log = jax.vmap(hooked, axis_name="batch")(xs)
    _, raw = jax.vmap(px.ForwardHook(model, log_fn=px.IdentityLog()))(xs)
    pooled = px.pool_stats(log)
    assert isinstance(pooled, px.PackedLog) and len(jax.tree.leaves(pooled)) == 2
    for key, values in raw.items():
        values = np.asarray(values)
        np.testing.assert_allclose(log[key]["mean"], values.mean(axis=1), rtol=1e-5, atol=1e-7)
        assert log[key]["hist"].counts.shape == (4, 40)  # one per example, before pooling
        np.testing.assert_allclose(pooled[key]["std"], values.std(), rtol=1e-5)
        histogram = pooled[key]["hist"]
        np.testing.assert_array_equal(histogram.counts, np.histogram(values, bins=np.asarray(histogram.edges))[0])
    # The packed axis must stay last: a vmap putting its axis after it is refused on
    # reading, not sliced across examples.
    _, moved = jax.vmap(hooked, axis_name="batch", out_axes=(0, 1))(xs)
    with pytest.raises(ValueError, match="out_axes=0"):
        moved["layers.0"]
    # Also where the vmap's length equals the buffer's: one std per layer, 3 layers.
    stds = px.ForwardHook(model, log_fn=px.StdLog())
    assert jax.tree.leaves(stds(xs[0])[1])[0].shape[-1] == 3
    _, moved = jax.vmap(stds, out_axes=(0, 1))(xs[:3])
    with pytest.raises(ValueError, match="out_axes=0"):
        moved["layers.0"]


def test_a_log_holding_entries_of_other_logs_stays_a_dict(haiku_mlp):
    model, x = haiku_mlp
    _, log = px.ForwardHook(model, log_fn=px.activation_stats(), log={"step": jnp.asarray(3)})(x)
    assert type(log) is dict and log.pop("step") == 3
    assert len(log) == 4 and all(isinstance(stats, px.Stats) for stats in log.values())
    _, log = px.ForwardHook(model, log_fn=px.activation_stats(), pre_log_fn=px.IdentityLog())(x)
    assert type(log) is dict and sum(key.endswith(":in") for key in log) == 4


def test_a_histogram_logs_its_range_not_its_edges(haiku_mlp):
    """The floats a step packs per layer do not grow with the bins (the edges are
    computed where read); the counts do, one per bin. Read back, the edges are
    numpy's for the values and bins."""
    model, x = haiku_mlp
    narrow, wide = (call(px.ForwardHook(model, log_fn=px.activation_stats(bins=bins)), x)[1] for bins in (40, 400))
    (floats, counts), (wide_floats, wide_counts) = (
        sorted((leaf.dtype.name, leaf.size) for leaf in jax.tree.leaves(log)) for log in (narrow, wide)
    )
    assert floats == wide_floats and wide_counts[1] - counts[1] == 360 * len(narrow)
    _, raw = call(px.ForwardHook(model, log_fn=px.IdentityLog()), x)
    for key, values in raw.items():
        np.testing.assert_array_equal(wide[key]["hist"].edges, np.histogram(np.asarray(values), 400)[1])
