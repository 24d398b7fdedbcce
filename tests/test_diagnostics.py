"""Statistics logs, summaries, parameter counts and the recorder."""

import pytest

pytest.importorskip("haiku")  # skipped where the [haiku] extra is not installed
pytest.importorskip("flax")  # skipped where the [flax] extra is not installed

import html
import math
from typing import Any

import equinox as eqx
import haiku as hk
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from flax import nnx

import peex_interop as px
from models import BatchedNormalised, Deep, normalised, tokens, transformer


def activations():
    return {
        "a": jax.random.normal(jax.random.key(0), (7, 5)) * 3 + 1,
        "b": jnp.abs(jax.random.normal(jax.random.key(1), (9,))) * 4,
    }


@pytest.mark.parametrize(
    "log, reference",
    [
        (px.MeanLog(), np.mean),
        (px.StdLog(), np.std),
        (px.NearZeroLog(), lambda x: np.mean(x <= 0.05)),
        (px.NearZeroLog(0.5), lambda x: np.mean(x <= 0.5)),
        (px.AbsMaxLog(), lambda x: np.max(np.abs(x))),
        (px.L2NormLog(), lambda x: np.sqrt(np.sum(np.asarray(x, np.float64) ** 2))),
    ],
)
def test_statistics_equal_numpy(log, reference):
    values = activations()
    got = jax.jit(log)(values)
    for key, x in values.items():
        np.testing.assert_allclose(got[key], reference(np.asarray(x)), rtol=1e-5)


FLOAT_MAX = float(np.finfo(np.float32).max)


class IdentityRows(eqx.Module):
    inner: eqx.nn.Identity

    def __call__(self, xs):
        return jax.vmap(self.inner)(xs)


@pytest.mark.parametrize(
    "values",
    [
        [np.inf, 1.0, 2.0], [-np.inf, 1.0], [1.0, np.inf, 2.0], [np.nan, 1.0], [-np.inf, np.inf],
        [3e38, 1.0, 2.0], [-2e38, 1.0, 3.0], [1e30, 1e30], [1e4 + 0.01, 1e4, 1e4 - 0.01],
    ],
)
def test_statistics_of_non_finite_and_huge_values_are_exact(values):
    # The sums are shifted by the first value: one not finite, or large enough for the
    # shifted values to overflow, must not change what the statistics say. Against
    # float64; a variance past float32's range is inf (and so its std).
    x = np.asarray(values, np.float32)
    rows = np.stack([x, x[::-1]])  # pooled over the vmap inside the model: each row its own first value
    hooked = px.ForwardHook(IdentityRows(eqx.nn.Identity()), log_fn=px.activation_stats(bins=4))

    def inside(of):
        return hooked(jnp.asarray(of))[1]["inner"]

    def around(of):  # each row an example of a vmap around the model, pooled by px.pool_stats
        return px.pool_stats(jax.vmap(hooked)(jnp.asarray(of)[:, None])[1], 1)["inner"]

    with np.errstate(all="ignore"):
        for of, logged in ((x[None], inside), (rows, inside), (rows, around)):
            log = logged(of)
            exact = of.astype(np.float64)
            var = np.var(exact)
            np.testing.assert_allclose(log["mean"], np.mean(exact).astype(np.float32), rtol=1e-6)
            np.testing.assert_allclose(log["std"], np.inf if var > FLOAT_MAX else np.sqrt(var), rtol=1e-5)
            np.testing.assert_allclose(log["near_zero"], np.mean(of <= 0.05))


def test_a_spread_of_complex_values_is_refused_and_their_mean_logged():
    # The variance's sums square the values (no conjugate): a std of complex values
    # would be silently wrong (was 0j for [1+2j, 3-1j], numpy's std 1.80).
    x = jnp.array([1 + 2j, 3 - 1j])
    np.testing.assert_allclose(px.StatsLog({"mean": px.MeanLog()})(x)["mean"], np.mean(np.asarray(x)))
    for log in (px.StdLog(), px.NearZeroLog(), px.activation_stats()):
        with pytest.raises(TypeError, match=r"take real arrays, got complex64\[2\]: log jnp.abs\(x\)"):
            log(x)


def assert_counts_every_value(histogram, x):
    assert int(histogram.total) == x.size
    finite = x[np.isfinite(x)]
    assert int(histogram.nan) == np.isnan(x).sum()
    assert int(histogram.below) == np.sum(x < histogram.low) and int(histogram.above) == np.sum(x > histogram.high)
    # Counted against the logged edges exactly (numpy's edges to the bit on CPU).
    np.testing.assert_array_equal(histogram.counts, np.histogram(finite, bins=np.asarray(histogram.edges))[0])


def test_histogram_range_follows_the_data_and_counts_what_it_cannot_bin():
    x = np.asarray(activations()["a"]).ravel()
    x = np.concatenate([x, [np.nan, np.nan, np.inf, -np.inf]]).astype(np.float32)
    histogram = jax.jit(px.HistogramLog(bins=12))(x)
    finite = x[np.isfinite(x)]
    counts, edges = np.histogram(finite, 12)  # numpy's own data range
    assert (histogram.low, histogram.high) == (finite.min(), finite.max())
    np.testing.assert_array_equal(histogram.counts, counts)
    np.testing.assert_array_equal(histogram.edges, edges)
    assert (int(histogram.below), int(histogram.above), int(histogram.nan)) == (1, 1, 2)
    assert_counts_every_value(histogram, x)
    # numpy's conventions for a single value, and no finite value at all.
    one = jax.jit(px.HistogramLog(bins=4))(jnp.full(5, 2.0))
    np.testing.assert_array_equal(one.edges, np.histogram(np.full(5, 2.0), 4)[1])
    assert one.counts.sum() == 5
    nothing = jax.jit(px.HistogramLog(bins=4))(jnp.full(3, jnp.nan))
    assert nothing.counts.sum() == 0 and nothing.nan == 3


def test_numpy_reads_a_histogram_as_its_counts():
    x = np.asarray(activations()["a"]).ravel()
    histogram = jax.jit(px.HistogramLog(bins=12))(x)
    counts = np.asarray(histogram)
    assert counts.dtype != object and counts.shape == (12,)
    np.testing.assert_array_equal(counts, np.histogram(x, 12)[0])
    # The range follows the data: every value is in a bin.
    assert np.sum(np.asarray(histogram)) == x.size
    assert np.asarray(histogram, np.float64).dtype == np.float64


def test_a_histogram_over_a_fixed_range_counts_the_values_outside_it():
    # A pre-activation layer: about half its values are below fastai's range (0, 10).
    x = np.asarray(activations()["a"]).ravel() - 1
    histogram = jax.jit(px.HistogramLog(40, (0.0, 10.0)))(x)
    np.testing.assert_array_equal(histogram.counts, np.histogram(x, 40, (0, 10))[0])
    assert int(histogram.below) == np.sum(x < 0) > 0.3 * x.size
    assert int(histogram.above) == np.sum(x > 10)
    assert_counts_every_value(histogram, x)
    with pytest.raises(ValueError, match="low < high"):
        px.HistogramLog(4, (1.0, 1.0))


def test_histogram_edges_in_the_data_range_match_numpy_exactly():
    x = np.asarray(jax.random.normal(jax.random.key(3), (500,))) * 3
    edges = np.histogram(x, 40)[1]
    # Values on the inner edges and their float neighbours, binned as numpy bins them.
    inner = edges[1:-1]
    x = np.concatenate([x, inner, np.nextafter(inner, -np.inf), np.nextafter(inner, np.inf)]).astype(np.float32)
    histogram = jax.jit(px.HistogramLog())(x)
    np.testing.assert_array_equal(histogram.counts, np.histogram(x, 40)[0])


def test_a_histogram_over_a_range_wider_than_the_dtype_counts_exactly():
    # float32 -3e38 .. 3e38: the width overflows (numpy refuses: "Cannot create 40
    # finite-sized bins"); the edges stay finite and increasing, every value counted.
    x = np.array([-3e38, 3e38, 0.0, 1e38, -2.9e38, 2.5e38], np.float32)
    histogram = jax.jit(px.HistogramLog(bins=40))(x)
    edges = np.asarray(histogram.edges)
    assert np.isfinite(edges).all() and np.all(np.diff(edges) > 0)
    assert (edges[0], edges[-1]) == (x.min(), x.max())
    assert_counts_every_value(histogram, x)


def test_histograms_over_ranges_of_a_few_float_steps_count_exactly_against_their_edges():
    # Edges repeat when the range spans few steps of the data's precision: the bins are
    # then searched in the logged edges (numpy's fast path would put 1.0 in bin 1).
    steps = (1 + np.arange(4) * np.finfo(np.float32).eps).astype(np.float32)
    narrow = np.concatenate([steps, [np.nan, np.inf]]).astype(np.float32)
    bfloat = (jax.random.normal(jax.random.key(4), (500,)) * 3 + 100).astype(jnp.bfloat16)
    for bins, x in [(40, narrow), (200, bfloat)]:
        histogram = jax.tree.map(lambda a: np.asarray(a, np.float64), jax.jit(px.HistogramLog(bins))(x))
        assert len(np.unique(histogram.edges)) < bins + 1  # the case at hand
        assert_counts_every_value(histogram, np.asarray(x, np.float64))
    # Under vmap the rows share one range, that of all their values: a narrow one here.
    rows = jnp.stack([jnp.resize(steps, 50), jnp.resize(steps[:2], 50)])
    stacked = jax.jit(jax.vmap(px.HistogramLog()))(rows)
    np.testing.assert_array_equal(stacked.edges[0], stacked.edges[1])
    for row in range(2):
        assert_counts_every_value(jax.tree.map(lambda a: np.asarray(a[row]), stacked), np.asarray(rows[row]))


def assert_stats_of(stats, x):
    """`stats` (of `px.activation_stats()`) are those of all the values `x`."""
    x = np.asarray(x)
    np.testing.assert_allclose(stats["mean"], np.mean(x), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stats["std"], np.std(x), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(stats["near_zero"], np.mean(x <= 0.05), rtol=1e-6)
    # The range of all the values; counted exactly against the edges logged.
    edges = np.asarray(stats["hist"].edges)
    np.testing.assert_allclose(edges, np.histogram(x, 40)[1], rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(stats["hist"].counts, np.histogram(x, edges)[0])


def at(stats, index):
    return jtu.tree_map(lambda field: field[index], stats)


def test_stats_pool_the_vmaps_inside_the_model_and_keep_the_scanned_layers():
    # Equinox's own vmaps (eqx.nn.MultiheadAttention over positions), the model's
    # jax.vmap over positions, inside a scan over a stack of 2 blocks.
    model = transformer(num_blocks=2)
    call = eqx.filter_jit(lambda h, t: h(t))
    _, log = call(px.ForwardHook(model, log_fn=px.activation_stats()), tokens())
    _, raw = call(px.ForwardHook(model, log_fn=px.IdentityLog()), tokens())
    assert set(log) == set(raw) and set(log["blocks.norm1"]) == {"mean", "std", "near_zero", "hist"}
    assert log["blocks.attn.query_proj"]["hist"].counts.shape == (2, 40)  # one per layer
    for path, values in raw.items():
        if not path.startswith("blocks"):
            assert_stats_of(log[path], values)
            continue
        for layer in range(2):  # the scan's steps are different layers: kept apart
            assert_stats_of(at(log[path], layer), values[layer])
    # pool=False keeps one statistic per position, the histograms over the range of all
    # positions (every vmap shares it), each layer's its own.
    _, per_position = call(px.ForwardHook(model, log_fn=px.activation_stats(pool=False)), tokens())
    assert per_position["blocks.norm1"]["hist"].counts.shape == (2, 5, 40)
    layer = np.asarray(raw["blocks.norm1"][1])
    for position in range(5):
        stats = at(per_position["blocks.norm1"], (1, position))
        np.testing.assert_allclose(stats["mean"], layer[position].mean(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(stats["hist"].edges, np.histogram(layer, 40)[1], rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(stats["hist"].counts, np.histogram(layer[position], stats["hist"].edges)[0])


def test_statistics_run_under_plain_jax_jit_of_the_hooked_model():
    # jax.jit traces every leaf of its arguments: a threshold or a statistic log held as
    # a leaf became a tracer, and the statistics, which hash them, failed.
    model = eqx.nn.Sequential([eqx.nn.Linear(3, 4, key=jax.random.key(0)), eqx.nn.Linear(4, 2, key=jax.random.key(1))])
    x = jax.random.normal(jax.random.key(2), (3,))
    _, log = jax.jit(lambda h, x: h(x))(px.ForwardHook(model, log_fn=px.activation_stats()), x)
    _, raw = px.ForwardHook(model, log_fn=px.IdentityLog())(x)
    assert set(log) == set(raw) == {"layers.0", "layers.1"}
    for path, values in raw.items():
        assert_stats_of(log[path], values)


class ScaledMean(px.MeanLog):
    scale: Any = None


def test_a_statistic_log_holding_arrays_is_refused_by_name():
    with pytest.raises(TypeError, match="statistic log 'scaled' holds arrays"):
        px.StatsLog({"scaled": ScaledMean(jnp.ones(()))})


class OneRow(eqx.Module):
    linear: eqx.nn.Linear

    def __call__(self, row):
        return self.linear(row)


class Rows(eqx.Module):
    linear: eqx.nn.Linear

    def __call__(self, rows):
        return jax.vmap(self.linear)(rows)


def test_one_statistics_log_on_the_same_shapes_inside_and_outside_a_vmap_of_the_model():
    # A statistic is compiled once per log, shapes and enclosing vmaps: the same layer,
    # the same (5,) values per call, first alone, then under a vmap over rows (whose
    # histograms share one range, by a pmin), then alone again.
    linear = eqx.nn.Linear(3, 5, key=jax.random.key(0))
    rows = jax.random.normal(jax.random.key(1), (4, 3))
    for model, x in ((OneRow(linear), rows[0]), (Rows(linear), rows), (OneRow(linear), rows[1])):
        _, log = px.ForwardHook(model, log_fn=px.activation_stats())(x)
        _, raw = px.ForwardHook(model, log_fn=px.IdentityLog())(x)
        assert log["linear"]["hist"].counts.shape == (40,)
        assert_stats_of(log["linear"], raw["linear"])


class Tag:
    """A leaf of a layer's output that is no array, and cannot be hashed."""

    __hash__ = None  # type: ignore[assignment]


def test_statistics_skip_leaves_that_are_no_arrays_even_unhashable_ones():
    values = {"x": jnp.arange(6.0), "tag": Tag(), "steps": 3}
    stats = px.activation_stats()(values)
    np.testing.assert_allclose(stats["mean"]["x"], 2.5)
    assert stats["mean"]["tag"] is None and stats["mean"]["steps"] is None


def test_stats_pool_the_vmaps_inside_a_converted_haiku_model():
    def rows(x):  # hk.vmap over the rows inside the model
        return hk.vmap(lambda r: jnp.tanh(hk.Linear(5, name="rows")(r)), split_rng=False)(x)

    transformed = hk.transform(rows)
    x = jax.random.normal(jax.random.key(1), (4, 3))
    model = px.from_haiku(transformed, transformed.init(jax.random.key(0), x))
    call = eqx.filter_jit(lambda h, x: h(x))
    _, log = call(px.ForwardHook(model, log_fn=px.activation_stats()), x)
    _, raw = call(px.ForwardHook(model, log_fn=px.IdentityLog()), x)
    assert raw["rows"].shape == (4, 5) and log["rows"]["hist"].counts.shape == (40,)
    assert_stats_of(log["rows"], raw["rows"])


def stats_bytes(log):
    return sum(np.prod(leaf.shape) * leaf.dtype.itemsize for leaf in jtu.tree_leaves(log))


def test_statistics_size_is_independent_of_batch_and_sequence_length():
    # Equinox: per example under a vmap of ours, pooled with px.pool_stats; Haiku: batched.
    equinox = px.ForwardHook(transformer(), log_fn=px.activation_stats(axis_name="batch"))

    def equinox_log(batch, seq):
        xs = jnp.zeros((batch, seq), jnp.int32)
        _, log = jax.vmap(equinox, axis_name="batch")(xs)
        return px.pool_stats(log)

    t = hk.transform(mha_fn)
    converted = px.from_haiku(t, t.init(jax.random.key(0), jnp.zeros((2, 3, 6))))
    haiku = px.ForwardHook(converted, log_fn=px.activation_stats())
    haiku_log = lambda batch, seq: haiku(jnp.zeros((batch, seq, 6)))[1]
    for log_of in (equinox_log, haiku_log):
        sizes = {stats_bytes(eqx.filter_eval_shape(log_of, batch, seq)) for batch, seq in ((2, 3), (4, 3), (2, 5))}
        assert len(sizes) == 1, sizes


def mha_fn(x):
    return hk.MultiHeadAttention(num_heads=2, key_size=4, w_init=hk.initializers.VarianceScaling())(x, x, x)


def test_backward_statistics():
    model = Deep(key=jax.random.key(0))
    x = jnp.linspace(-1.0, 1.0, 3)
    grads = eqx.filter_grad(lambda h: jnp.sum(h(x) ** 2))(px.BackwardHook(model, log_fn=px.AbsMaxLog()).init(x))
    raw = eqx.filter_grad(lambda h: jnp.sum(h(x) ** 2))(px.BackwardHook(model, log_fn=px.IdentityLog()).init(x))
    for path, value in raw.log.items():
        np.testing.assert_allclose(grads.log[path], np.max(np.abs(value)), rtol=1e-6)


@pytest.mark.parametrize("n", [11, 12, 13])
@pytest.mark.parametrize("every", [1, 4])
def test_every_follows_fastai(n, every):
    recorder = px.Recorder(every=every)
    for step in range(n):
        recorder.record(step, {"layer": {"mean": jnp.float32(step)}})
    assert len(recorder.records) == math.ceil(n / every)
    assert recorder.steps == list(range(0, n, every))


def test_equinox_parameter_counts_match_hand_counts():
    key = jax.random.key(0)
    assert px.total_params(eqx.nn.Linear(10, 32, key=key)) == (352, 0)
    assert px.total_params(eqx.nn.Linear(10, 32, use_bias=False, key=key)) == (320, 0)
    assert px.total_params(eqx.nn.BatchNorm(20, "batch", mode="batch")) == (40, 40)
    assert px.total_params(eqx.nn.Conv2d(16, 32, 3, key=key)) == (16 * 32 * 9 + 32, 0)
    # LSTM: 4 gates x (input + hidden) weights, and one bias per gate unit.
    assert px.total_params(eqx.nn.LSTMCell(10, 20, key=key)) == (4 * 20 * (10 + 20) + 4 * 20, 0)


def test_equinox_running_statistics_in_a_state_are_counted_from_it():
    # eqx.nn.make_with_state moves a BatchNorm's running mean and variance out of the
    # model into its State: the counts read them there, or refuse naming the layer.
    model, state = normalised(0)
    in_state = sum(x.size for x in jtu.tree_leaves(state) if jnp.issubdtype(x.dtype, jnp.inexact))
    assert in_state == 2 * 4  # running mean and variance over 4 features
    trainable = (3 * 4 + 4) + (4 + 4) + (4 * 2 + 2)  # lin, bn's weight and bias, head
    assert px.total_params(model, state) == (trainable, in_state)
    with pytest.raises(px.HookError, match=r"px.total_params: the eqx.nn.StateIndex at 'bn\.[a-z_]+'.*none was given"):
        px.total_params(model)
    rows = {row.key: row for row in px.summary(BatchedNormalised(model), jnp.ones((5, 3)), state).rows}
    assert (rows["model.bn"].trainable, rows["model.bn"].non_trainable) == (8, in_state)
    assert rows["model"].non_trainable == in_state
    assert px.summary(BatchedNormalised(model), jnp.ones((5, 3)), state).total == (trainable, in_state)
    # Abstract layers (eval_shape) count their running statistics too.
    abstract = eqx.filter_eval_shape(lambda: eqx.nn.BatchNorm(20, "batch", mode="batch"))
    assert px.total_params(abstract) == (40, 40)


def haiku_counts(fn, *inputs):
    t = hk.transform_with_state(fn)
    params, state = t.init(jax.random.key(0), *inputs)
    return px.total_params(px.from_haiku(t, params, state))


def test_haiku_parameter_counts_match_hand_counts():
    x = jnp.ones((2, 10))
    assert haiku_counts(lambda x: hk.Linear(32)(x), x) == (352, 0)
    assert haiku_counts(lambda x: hk.Linear(32, with_bias=False)(x), x) == (320, 0)
    # BatchNorm's moving averages (average and hidden of mean and var, plus counters) are state.
    trainable, other = haiku_counts(lambda x: hk.BatchNorm(True, True, 0.9)(x, True), jnp.ones((2, 20)))
    assert trainable == 40 and other == 2 * (20 + 20 + 1)
    assert haiku_counts(lambda x: hk.Conv2D(32, 3)(x), jnp.ones((1, 8, 8, 16))) == (16 * 32 * 9 + 32, 0)
    # Haiku's LSTM has one bias per gate.
    lstm = lambda x: hk.LSTM(20)(x, hk.LSTM(20).initial_state(2))[0]
    assert haiku_counts(lstm, x) == (4 * 20 * (10 + 20) + 4 * 20, 0)


def nnx_counts(module):
    return px.total_params(px.from_nnx(module))


def test_nnx_parameter_counts_match_hand_counts():
    rngs = nnx.Rngs(0)
    assert nnx_counts(nnx.Linear(10, 32, rngs=rngs)) == (352, 0)
    assert nnx_counts(nnx.Linear(10, 32, use_bias=False, rngs=rngs)) == (320, 0)
    # scale and bias are nnx.Params; the running mean and var are nnx.BatchStats.
    assert nnx_counts(nnx.BatchNorm(20, rngs=rngs)) == (40, 40)
    assert nnx_counts(nnx.Conv(16, 32, (3, 3), rngs=rngs)) == (16 * 32 * 9 + 32, 0)
    # NNX's LSTMCell holds, per gate (i, f, g, o), an input Linear without bias
    # (`ii`, `if_`, `ig`, `io`: 10x20 kernels) and a hidden Linear with bias (`hi`, `hf`,
    # `hg`, `ho`: 20x20 kernels, 20 biases): 4 * 20 * (10 + 20) + 4 * 20, one bias per
    # gate unit like Equinox's and Haiku's.
    cell = nnx.LSTMCell(10, 20, rngs=rngs)
    shapes = {".".join(map(str, path)): v.get_value().shape for path, v in nnx.to_flat_state(nnx.state(cell))}
    assert shapes == {f"{g}.kernel": (10, 20) for g in ("ii", "if_", "ig", "io")} | {
        f"{g}.{leaf}": shape
        for g in ("hi", "hf", "hg", "ho")
        for leaf, shape in (("kernel", (20, 20)), ("bias", (20,)))
    }
    assert nnx_counts(cell) == (4 * 20 * (10 + 20) + 4 * 20, 0)


class EqxNet(eqx.Module):
    conv: eqx.nn.Conv2d
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.conv = eqx.nn.Conv2d(1, 4, 3, padding=1, key=k1)
        self.norm = eqx.nn.LayerNorm((4, 8, 8))
        self.head = eqx.nn.Linear(4 * 8 * 8, 10, key=k2)

    def __call__(self, x):  # (1, 8, 8): channels first, one example
        return self.head(jnp.ravel(jax.nn.relu(self.norm(self.conv(x)))))


def haiku_net(x):  # (batch, 8, 8, 1): channels last
    x = hk.Conv2D(4, 3)(x)
    x = hk.LayerNorm(axis=(-3, -2, -1), create_scale=True, create_offset=True, param_axis=(-3, -2, -1))(x)
    return hk.Linear(10)(hk.Flatten()(jax.nn.relu(x)))


def test_summaries_of_twins_list_the_same_kinds_and_counts():
    eqx_summary = px.summary(EqxNet(jax.random.key(0)), jnp.ones((1, 8, 8)))
    t = hk.transform(haiku_net)
    x = jnp.ones((1, 8, 8, 1))
    hk_model = px.from_haiku(t, t.init(jax.random.key(0), x))
    hk_summary = px.summary(hk_model, x)
    layers = lambda s: [(r.kind, r.trainable) for r in s.rows if r.kind in ("conv", "norm", "linear")]
    assert layers(eqx_summary) == layers(hk_summary) == [("conv", 40), ("norm", 512), ("linear", 2570)]
    assert eqx_summary.total == hk_summary.total == (40 + 512 + 2570, 0)
    assert [r.output_shapes for r in hk_summary.rows if r.kind == "linear"] == [((1, 10),)]
    assert px.num_features(EqxNet(jax.random.key(0)), jnp.ones((1, 8, 8))) == px.num_features(hk_model, x) == 10
    assert px.model_sizes(hk_model, x)["conv2_d"] == ((1, 8, 8, 4),)
    text = str(hk_summary)
    assert "conv2_d" in text and "3,122 trainable" in text and "<table>" in hk_summary._repr_html_()


class NnxNet(nnx.Module):
    def __init__(self, rngs):  # (batch, 8, 8, 1): channels last, like Haiku's
        self.conv = nnx.Conv(1, 4, (3, 3), padding="SAME", rngs=rngs)
        # One scale and offset per element of the (8, 8, 4) feature map, like the twins'.
        self.norm = nnx.LayerNorm(8 * 8 * 4, reduction_axes=(-3, -2, -1), feature_axes=(-3, -2, -1), rngs=rngs)
        self.head = nnx.Linear(8 * 8 * 4, 10, rngs=rngs)

    def __call__(self, x):
        x = jax.nn.relu(self.norm(self.conv(x)))
        return self.head(x.reshape(x.shape[0], -1))


def test_summary_of_the_nnx_twin_lists_the_same_kinds_counts_and_shapes():
    eqx_model, eqx_x = EqxNet(jax.random.key(0)), jnp.ones((1, 8, 8))
    t = hk.transform(haiku_net)
    x = jnp.ones((1, 8, 8, 1))
    hk_model = px.from_haiku(t, t.init(jax.random.key(0), x))
    nnx_model = px.from_nnx(NnxNet(nnx.Rngs(0)))
    summaries = [px.summary(eqx_model, eqx_x), px.summary(hk_model, x), px.summary(nnx_model, x)]
    layers = lambda s: [(r.kind, r.trainable, r.non_trainable) for r in s.rows if r.kind in ("conv", "norm", "linear")]
    expected = [("conv", 40, 0), ("norm", 512, 0), ("linear", 2570, 0)]
    assert [layers(s) for s in summaries] == [expected] * 3
    assert [s.total for s in summaries] == [(40 + 512 + 2570, 0)] * 3
    # The batched twins (Haiku, NNX) have the same output shapes; Equinox's are per example.
    shapes = lambda s: [r.output_shapes for r in s.rows if r.kind in ("conv", "norm", "linear")]
    assert shapes(summaries[2]) == shapes(summaries[1]) == [((1, 8, 8, 4),), ((1, 8, 8, 4),), ((1, 10),)]
    assert shapes(summaries[0]) == [((4, 8, 8),), ((4, 8, 8),), ((10,),)]
    assert px.num_features(nnx_model, x) == px.num_features(hk_model, x) == px.num_features(eqx_model, eqx_x) == 10
    assert px.model_sizes(nnx_model, x) == {"conv": ((1, 8, 8, 4),), "norm": ((1, 8, 8, 4),), "head": ((1, 10),)}
    assert "conv" in str(summaries[2]) and "3,122 trainable" in str(summaries[2])


def recorded(tmp_path=None):
    model = Deep(key=jax.random.key(0))
    hooked = px.ForwardHook(model, log_fn=px.activation_stats())
    recorder = px.Recorder(every=2, tensorboard_dir=tmp_path)
    step = eqx.filter_jit(lambda h, x: h(x)[1])
    for i in recorder.track(range(6)):
        recorder.record(i, step(hooked, jnp.full(3, 0.5 * i)))
    recorder.close()
    return recorder, model


def test_recorder_series_match_the_logged_values():
    recorder, model = recorded()
    stats = recorder.layer_stats("out")
    for record, i in enumerate(range(0, 6, 2)):
        out = np.asarray(model(jnp.full(3, 0.5 * i)))
        np.testing.assert_allclose(stats["mean"][record], out.mean(), rtol=1e-5)
        np.testing.assert_allclose(stats["near_zero"][record], np.mean(out <= 0.05))
        np.testing.assert_array_equal(recorder.hist("out").counts[record], np.histogram(out, 40)[0])
    with pytest.raises(KeyError, match="recorded:"):
        recorder.hist("nope")


def test_plots_write_png_files_and_display_in_notebooks(tmp_path):
    import matplotlib.pyplot as plt
    from matplotlib.figure import Figure

    recorder, _ = recorded()
    figures = {
        "stats.png": recorder.plot_layer_stats("layers.0", tmp_path / "stats.png"),
        "color.png": recorder.color_dim("layers.0", tmp_path / "color.png"),
    }
    for name, figure in figures.items():
        data = (tmp_path / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 1000
        # A Figure that IPython shows as an image, and that pyplot does not hold.
        assert isinstance(figure, Figure) and figure._repr_png_().startswith(b"\x89PNG")
    assert plt.get_fignums() == []


def test_color_dim_has_value_and_step_axes_a_colorbar_and_shows_what_is_outside():
    model = Deep(key=jax.random.key(0))
    recorder = px.Recorder(every=3)
    hooked = px.ForwardHook(model, log_fn=px.activation_stats(range=(0.0, 1.0)))
    for i in range(7):
        recorder.record(i, hooked(jnp.linspace(-1.0, 1.0, 3) * (i + 1))[1])
    hist = recorder.hist("layers.0")
    figure = recorder.color_dim("layers.0")
    image, outside, colorbar = figure.axes
    assert (image.get_xlabel(), image.get_ylabel()) == ("", "value") and outside.get_xlabel() == "step"
    assert colorbar.get_ylabel() == "share of values per unit"
    assert image.get_ylim() == (0.0, 1.0) and image.get_xlim() == (-1.5, 7.5)
    # One rectangle per non-empty bin, coloured by the share of values per unit of value.
    cells = image.collections[0]
    density = hist.counts / hist.total[:, None] / np.diff(hist.edges, axis=1)
    np.testing.assert_allclose(np.sort(cells.get_array()), np.sort(density[hist.counts > 0]), rtol=1e-6)
    # The percentage below the range, at every recorded step.
    lines = {line.get_label(): line for line in outside.get_lines()}
    np.testing.assert_allclose(lines["below the bins"].get_ydata(), 100 * hist.below / hist.total)
    np.testing.assert_array_equal(lines["below the bins"].get_xdata(), [0, 3, 6])


def test_color_dim_of_unpooled_histograms_says_to_pool_them():
    recorder = px.Recorder()
    hooked = jax.vmap(px.ForwardHook(Deep(key=jax.random.key(0)), log_fn=px.activation_stats()))
    recorder.record(0, hooked(jnp.ones((4, 3)))[1])
    with pytest.raises(ValueError, match=r"layer 'layers\.0'.*px\.pool_stats"):
        recorder.color_dim("layers.0")


def test_color_dim_of_a_hist_that_is_no_histogram_says_what_it_needs():
    # A StatsLog-style record of the user's own, with plain counts under "hist".
    recorder = px.Recorder()
    recorder.record(0, {"out": {"hist": jnp.histogram(jnp.arange(5.0), 4)[0]}})
    with pytest.raises(
        TypeError, match=r"layer 'out' to be a px\.Histogram.*px\.HistogramLog.*got a ndarray of shape \(1, 4\)"
    ):
        recorder.color_dim("out")


def test_tensorboard_events_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import HISTOGRAMS, EventAccumulator

    recorder, model = recorded(tmp_path)
    events = EventAccumulator(str(tmp_path), size_guidance={HISTOGRAMS: 0})
    events.Reload()
    scalars = events.Scalars("out/mean")
    assert [e.step for e in scalars] == [0, 2, 4]
    np.testing.assert_allclose(scalars[1].value, np.mean(model(jnp.full(3, 1.0))), rtol=1e-5)
    histograms = events.Histograms("out/hist")
    assert [e.step for e in histograms] == [0, 2, 4]
    for record, event in enumerate(histograms):
        value = event.histogram_value
        counts, edges = np.histogram(np.asarray(model(jnp.full(3, 0.5 * 2 * record))), 40)
        np.testing.assert_array_equal(value.bucket, counts)
        np.testing.assert_allclose(value.bucket_limit, edges[1:], rtol=1e-6)
        assert (value.min, value.max, value.num) == pytest.approx((edges[0], edges[-1], counts.sum()))
    assert [e.value for e in events.Scalars("out/hist/outside")] == [0.0, 0.0, 0.0]


def test_tables_render_as_text_rich_and_html():
    from rich.console import Console

    model = eqx.nn.MLP(2, 2, 4, depth=1, key=jax.random.key(0))
    x = jnp.ones(2)
    broken = eqx.tree_at(lambda m: m.layers[1].bias, model, model.layers[1].bias + 1)
    recorder, _ = recorded()
    results = [
        (px.summary(model, x), ["layers.0", "(4,)", "22 trainable"]),
        (px.align(model, broken, x), ["layers.1", "matched", "2 layers matched, 0 unmatched"]),
        (px.compare(model, broken, x), ["layers.1", "<- first divergence", "first divergence at layers.1 -> layers.1"]),
        (recorder, ["out", "mean", "3 records (steps 0 to 4, every 2)"]),
    ]
    for result, expected in results:
        console = Console(record=True, width=200)
        console.print(result)
        for text in (str(result), console.export_text()):
            assert all(e in text for e in expected), text
        assert all(html.escape(e) in result._repr_html_() for e in expected)
@pytest.mark.parametrize("value_range", [None, (-1.0, 1.0)])
def test_pooled_statistics_equal_statistics_of_the_whole_batch(value_range):
    model = Deep(key=jax.random.key(0))
    xs = jax.random.normal(jax.random.key(1), (16, 3)) * 2
    # Without an explicit range, the examples share theirs over the vmap's axis name.
    stats = px.activation_stats(range=value_range, axis_name="batch")
    _, per_example = jax.vmap(px.ForwardHook(model, log_fn=stats), axis_name="batch")(xs)
    pooled = jax.jit(px.pool_stats)(per_example)
    _, raw = jax.vmap(px.ForwardHook(model, log_fn=px.IdentityLog()))(xs)
    for path, batch in raw.items():
        batch = np.asarray(batch)
        np.testing.assert_allclose(pooled[path]["mean"], batch.mean(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(pooled[path]["std"], batch.std(), rtol=1e-4)
        np.testing.assert_allclose(pooled[path]["near_zero"], np.mean(batch <= 0.05), rtol=1e-6)
        hist = pooled[path]["hist"]
        # numpy's histogram over the shared range, in the data's precision.
        counts, edges = np.histogram(batch, 40, value_range and np.float32(value_range))
        np.testing.assert_array_equal(hist.counts, counts)
        np.testing.assert_array_equal(hist.edges, edges)
        assert_counts_every_value(hist, batch)


def test_shared_range_histograms_inside_a_differentiated_loss_leave_the_gradients_alone():
    model = Deep(key=jax.random.key(0))
    xs = jax.random.normal(jax.random.key(1), (8, 3))
    hooked = px.ForwardHook(model, log_fn=px.activation_stats(axis_name="batch"))

    def loss(hooked):
        out, log = jax.vmap(hooked, axis_name="batch")(xs)
        return jnp.sum(out**2), px.pool_stats(log)

    (_, log), grads = eqx.filter_jit(eqx.filter_value_and_grad(loss, has_aux=True))(hooked)
    expected = eqx.filter_grad(lambda m: jnp.sum(jax.vmap(m)(xs) ** 2))(model)
    for got, want in zip(jtu.tree_leaves(grads.model), jtu.tree_leaves(expected)):
        np.testing.assert_allclose(got, want, rtol=1e-5)
    out = np.asarray(jax.vmap(model)(xs))
    np.testing.assert_array_equal(log["out"]["hist"].counts, np.histogram(out, 40)[0])


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("jit", [False, True])
def test_per_example_histograms_under_unnamed_vmaps_pool_exactly(nested, jit):
    # The usual Equinox idiom: a vmap of the user's own around the model, unnamed (and
    # nested: two groups of examples at different scales). Every example's histogram
    # shares the range of all of them, so pooling adds counts of the same bins.
    mlp = eqx.nn.MLP(4, 2, 8, depth=2, key=jax.random.key(0))
    xs = jax.random.normal(jax.random.key(1), (2, 3, 4)) * jnp.array([1.0, 10.0])[:, None, None]
    mapped, num_axes = (lambda f: jax.vmap(jax.vmap(f)), 2) if nested else (jax.vmap, 1)
    xs = xs if nested else xs.reshape(6, 4)

    def pooled(xs):
        _, log = mapped(px.ForwardHook(mlp, log_fn=px.activation_stats()))(xs)
        return px.pool_stats(log, num_axes)

    def activations(xs):
        return mapped(px.ForwardHook(mlp, log_fn=px.IdentityLog()))(xs)[1]

    # The activations compiled as the statistics are (XLA's fusions may round them
    # differently from the eager ones).
    got, raw = (eqx.filter_jit(pooled)(xs), eqx.filter_jit(activations)(xs)) if jit else (pooled(xs), activations(xs))
    # No run-time check of the bins (a host callback) in the step: they agree by construction.
    assert "callback" not in str(jax.make_jaxpr(pooled)(xs))
    for path, values in raw.items():
        values = np.asarray(values)
        counts, edges = np.histogram(values, 40)  # over the range of all examples' values
        np.testing.assert_array_equal(got[path]["hist"].counts, counts)
        np.testing.assert_array_equal(got[path]["hist"].edges, edges.astype(np.float32))
        np.testing.assert_allclose(got[path]["mean"], values.mean(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got[path]["std"], values.std(), rtol=1e-4)


class ScannedStack(eqx.Module):
    layers: eqx.nn.Linear  # a stack built with eqx.filter_vmap, scanned over

    def __call__(self, x):
        dynamic, static = eqx.partition(self.layers, eqx.is_array)
        step = lambda x, layer: (jnp.tanh(eqx.combine(layer, static)(x)), None)
        return jax.lax.scan(step, x, dynamic)[0]


def test_pooling_the_steps_of_a_scan_inside_the_model_raises_while_tracing():
    # Each step of the scan (another layer) bins over its own range: pool_stats pools
    # the vmap around the model, exactly, and refuses the steps while tracing.
    layers = eqx.filter_vmap(lambda k: eqx.nn.Linear(4, 4, key=k))(jax.random.split(jax.random.key(0), 3))
    xs = jax.random.normal(jax.random.key(1), (5, 4))
    hooked = jax.vmap(px.ForwardHook(ScannedStack(layers), log_fn=px.activation_stats()))
    pooled = px.pool_stats(hooked(xs)[1])
    _, raw = jax.vmap(px.ForwardHook(ScannedStack(layers), log_fn=px.IdentityLog()))(xs)
    assert raw["layers"].shape == (5, 3, 4) and pooled["layers"]["hist"].counts.shape == (3, 40)
    for step in range(3):
        counts = np.histogram(np.asarray(raw["layers"][:, step]), 40)[0]
        np.testing.assert_array_equal(pooled["layers"]["hist"].counts[step], counts)
    with pytest.raises(ValueError, match=r"histograms of layer 'layers'.*jax\.lax\.scan.*explicit range"):
        eqx.filter_eval_shape(lambda xs: px.pool_stats(hooked(xs)[1], 2), xs)
    # Over an explicit range every step has the same bins: they pool.
    fixed = jax.vmap(px.ForwardHook(ScannedStack(layers), log_fn=px.activation_stats(range=(-1.0, 1.0))))
    both = px.pool_stats(fixed(xs)[1], 2)["layers"]["hist"]
    counts = np.histogram(np.asarray(raw["layers"]), 40, np.float32((-1.0, 1.0)))[0]
    np.testing.assert_array_equal(both.counts, counts)


@pytest.mark.parametrize("value_range", [None, (-3.0, 3.0)])
def test_histograms_of_a_scan_around_the_model_pool_exactly_or_not_at_all(value_range):
    # A jax.lax.scan of the user's own around the model: no trace tells its axis from
    # a vmap's, and each step bins over its own range. Pooled, the bins are compared:
    # eagerly that raises, under jit the histogram is unusable (NaN edges, counts -1);
    # over an explicit range the steps share the bins and pool exactly.
    mlp = eqx.nn.MLP(4, 2, 8, depth=1, key=jax.random.key(0))
    xs = jax.random.normal(jax.random.key(1), (3, 4)) * jnp.array([1.0, 3.0, 9.0])[:, None]
    hooked = px.ForwardHook(mlp, log_fn=px.activation_stats(range=value_range))
    log = jax.lax.scan(lambda carry, x: (carry, hooked(x)[1]), None, xs)[1]
    raw = jax.lax.scan(lambda carry, x: (carry, px.ForwardHook(mlp, log_fn=px.IdentityLog())(x)[1]), None, xs)[1]
    compiled = jax.jit(px.pool_stats)(log)
    for path, values in raw.items():
        values = np.asarray(values)
        np.testing.assert_allclose(compiled[path]["mean"], values.mean(), rtol=1e-5, atol=1e-6)
        hist = compiled[path]["hist"]
        if value_range is None:
            assert np.isnan(hist.edges).all() and (hist.counts == -1).all()
            assert (hist.below, hist.above, hist.nan) == (-1, -1, -1)
        else:
            counts = np.histogram(values, 40, np.float32(value_range))[0]
            np.testing.assert_array_equal(hist.counts, counts)
            assert hist.below + hist.above == np.sum(np.abs(values) > 3)
    if value_range is None:
        # The packed log (pooled in one pass) and a plain dict of its statistics.
        for unpooled in (log, dict(log)):
            with pytest.raises(ValueError, match=r"layer 'layers\.0' have different bins.*jax\.lax\.scan.*range"):
                px.pool_stats(unpooled)


@pytest.mark.parametrize("bins, value_range", [(40, (0.0, 10.0)), (7, (-2.0, 3.0)), (3, (0.1, 0.7))])
def test_histogram_matches_numpy_at_bin_edges(bins, value_range):
    # The range in the data's precision, as the histogram logs it.
    low, high = np.float32(value_range[0]), np.float32(value_range[1])
    edges = np.histogram(np.zeros(0, np.float32), bins, (low, high))[1]
    assert edges.dtype == np.float32
    # Exact edges, their float neighbours, the range's ends and values outside it.
    neighbours = [np.nextafter(edges, -np.inf), np.nextafter(edges, np.inf)]
    values = np.concatenate([edges, *neighbours, [low - 1, high + 1]]).astype(np.float32)
    # XLA flushes subnormals (the neighbours of 0.0) to zero; numpy does not.
    values = values[(values == 0) | (np.abs(values) >= np.finfo(np.float32).tiny)]
    got = jax.jit(px.HistogramLog(bins, value_range))(values)
    np.testing.assert_array_equal(got.edges, edges)
    np.testing.assert_array_equal(got.counts, np.histogram(values, bins, (low, high))[0])
    assert (got.below, got.above) == (np.sum(values < low), np.sum(values > high))


@pytest.mark.parametrize("on_host", [False, True])
def test_recorder_computes_statistics_of_due_steps_only(on_host):
    # In one compiled step (`when_due` of a traced step: the histograms share the
    # batch's range, a collective, inside the lax.cond), or decided on the host (`when`
    # of `recorder.due(i)`, static: a step with statistics and one without).
    hooked = px.ForwardHook(Deep(key=jax.random.key(0)), log_fn=px.activation_stats(axis_name="batch"))
    recorder = px.Recorder(every=3)
    traces = []

    @eqx.filter_jit
    def step(hooked, xs, i):
        traces.append(i)
        with recorder.when(i) if on_host else recorder.when_due(i):
            _, log = jax.vmap(hooked, axis_name="batch")(xs)
        return px.pool_stats(log)

    batches = [jax.random.normal(jax.random.key(i), (4, 3)) for i in range(7)]
    logs = []
    for i, xs in enumerate(batches):
        logs.append(step(hooked, xs, recorder.due(i) if on_host else jnp.asarray(i)))
        assert recorder.record(i, logs[-1]) == (i % 3 == 0)
    assert (traces == [True, False]) if on_host else len(traces) == 1
    assert recorder.steps == [0, 3, 6]
    direct = eqx.filter_jit(lambda h, xs: px.pool_stats(jax.vmap(h, axis_name="batch")(xs)[1]))
    for record, i in zip(recorder.records, recorder.steps):
        want = direct(hooked, batches[i])
        assert jtu.tree_structure(record) == jtu.tree_structure(want)
        for got, expected in zip(jtu.tree_leaves(record), jtu.tree_leaves(want)):
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)
    # Other steps skip the work: zeros (no NaN), which record() ignores.
    assert all(not np.any(leaf) for leaf in jtu.tree_leaves(logs[1]))
    with pytest.raises(TypeError, match="Python bool"):
        recorder.when(jnp.asarray(True))


def test_pool_stats_and_stats_log_refuse_what_does_not_pool():
    with pytest.raises(ValueError, match=r"layer 'layer' have 0 leading axes"):
        px.pool_stats({"layer": px.activation_stats()(jnp.ones(3))})
    with pytest.raises(ValueError, match=r"layer 'layer'.*plain arrays"):
        px.pool_stats({"layer": {"mean": jnp.ones(4)}})
    with pytest.raises(TypeError, match="IdentityLog"):
        px.StatsLog({"raw": px.IdentityLog()})


def test_statistics_of_an_ensemble_inside_the_model_stay_per_member():
    # A vmap over a stack of layers runs different layers: their statistics are not
    # pooled (members keep their own), while a vmap over positions inside each is.
    class Ensemble(eqx.Module):
        members: eqx.nn.Linear

        def __call__(self, xs):  # (positions, 3)
            run = lambda member: jax.vmap(member)(xs)
            return eqx.filter_vmap(run)(self.members)

    members = eqx.filter_vmap(lambda k: eqx.nn.Linear(3, 2, key=k))(jax.random.split(jax.random.key(0), 4))
    xs = jax.random.normal(jax.random.key(1), (5, 3))
    _, log = px.ForwardHook(Ensemble(members), log_fn={"members": px.activation_stats()})(xs)
    outputs = jax.vmap(lambda w, b: xs @ w.T + b)(members.weight, members.bias)  # (4, 5, 2)
    np.testing.assert_allclose(log["members"]["mean"], outputs.mean(axis=(1, 2)), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(log["members"]["std"], outputs.std(axis=(1, 2)), rtol=1e-4, atol=1e-6)
