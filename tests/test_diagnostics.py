"""Statistics logs, summaries, parameter counts and the recorder."""

import pytest

pytest.importorskip("haiku")  # skipped where the [haiku] extra is not installed
pytest.importorskip("flax")  # skipped where the [flax] extra is not installed

import math

import equinox as eqx
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import peex_interop as px
from models import Deep, transformer, tokens


def activations():
    return {"a": jax.random.normal(jax.random.key(0), (7, 5)) * 3 + 1, "b": jnp.abs(jax.random.normal(jax.random.key(1), (9,))) * 4}


@pytest.mark.parametrize(
    "log, reference",
    [
        (px.MeanLog(), np.mean),
        (px.StdLog(), np.std),
        (px.NearZeroLog(), lambda x: np.mean(x <= 0.05)),
        (px.NearZeroLog(0.5), lambda x: np.mean(x <= 0.5)),
        (px.AbsMaxLog(), lambda x: np.max(np.abs(x))),
        (px.L2NormLog(), lambda x: np.sqrt(np.sum(np.asarray(x, np.float64) ** 2))),
        (px.HistogramLog(), lambda x: np.histogram(x, bins=40, range=(0, 10))[0]),
        (px.HistogramLog(7, (-2.0, 3.0)), lambda x: np.histogram(x, bins=7, range=(-2, 3))[0]),
    ],
)
def test_statistics_equal_numpy(log, reference):
    values = activations()
    got = jax.jit(log)(values)
    for key, x in values.items():
        np.testing.assert_allclose(got[key], reference(np.asarray(x)), rtol=1e-5)


def test_stats_log_combines_and_works_inside_scan_and_vmap():
    model = transformer()
    stats = px.activation_stats()
    _, log = eqx.filter_jit(lambda h, t: h(t))(px.ForwardHook(model, log_fn=stats), tokens())
    _, raw = px.ForwardHook(model, log_fn=px.IdentityLog())(tokens())
    assert set(log["blocks.norm1"]) == {"mean", "std", "near_zero", "hist"}
    # norm1 runs per position (vmap) in each scanned layer: one statistic per both.
    assert log["blocks.norm1"]["hist"].shape == (3, 5, 40)
    for layer in range(3):
        for position in range(5):
            x = np.asarray(raw["blocks.norm1"][layer, position])
            np.testing.assert_allclose(log["blocks.norm1"]["mean"][layer, position], np.mean(x), atol=1e-6)
            np.testing.assert_allclose(log["blocks.norm1"]["std"][layer, position], np.std(x), rtol=1e-5)
            np.testing.assert_array_equal(log["blocks.norm1"]["hist"][layer, position], np.histogram(x, 40, (0, 10))[0])


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
    assert haiku_counts(lambda x: hk.LSTM(20)(x, hk.LSTM(20).initial_state(2))[0], x) == (4 * 20 * (10 + 20) + 4 * 20, 0)


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
        f"{g}.{leaf}": shape for g in ("hi", "hf", "hg", "ho") for leaf, shape in (("kernel", (20, 20)), ("bias", (20,)))
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
        np.testing.assert_array_equal(recorder.hist("out")[record], np.histogram(out, 40, (0, 10))[0])
    with pytest.raises(KeyError, match="recorded:"):
        recorder.hist("nope")


def test_plots_write_png_files(tmp_path):
    recorder, _ = recorded()
    recorder.plot_layer_stats("layers.0", tmp_path / "stats.png")
    recorder.color_dim("layers.0", tmp_path / "color.png")
    for name in ("stats.png", "color.png"):
        data = (tmp_path / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 1000


def test_tensorboard_events_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    recorder, model = recorded(tmp_path)
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    scalars = events.Scalars("out/mean")
    assert [e.step for e in scalars] == [0, 2, 4]
    np.testing.assert_allclose(scalars[1].value, np.mean(model(jnp.full(3, 1.0))), rtol=1e-5)


def test_pooled_statistics_equal_statistics_of_the_whole_batch():
    model = Deep(key=jax.random.key(0))
    xs = jax.random.normal(jax.random.key(1), (16, 3)) * 2
    _, per_example = jax.vmap(px.ForwardHook(model, log_fn=px.activation_stats()))(xs)
    pooled = jax.jit(px.pool_stats)(per_example)
    _, raw = jax.vmap(px.ForwardHook(model, log_fn=px.IdentityLog()))(xs)
    for path, batch in raw.items():
        batch = np.asarray(batch)
        np.testing.assert_allclose(pooled[path]["mean"], batch.mean(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(pooled[path]["std"], batch.std(), rtol=1e-4)
        np.testing.assert_allclose(pooled[path]["near_zero"], np.mean(batch <= 0.05), rtol=1e-6)
        np.testing.assert_array_equal(pooled[path]["hist"], np.histogram(batch, 40, (0, 10))[0])


@pytest.mark.parametrize("bins, value_range", [(40, (0.0, 10.0)), (7, (-2.0, 3.0)), (3, (0.1, 0.7))])
def test_histogram_matches_numpy_at_bin_edges(bins, value_range):
    low, high = value_range
    edges = np.linspace(low, high, bins + 1, dtype=np.float32)
    # Exact edges, their float neighbours, the range's ends and values outside it.
    values = np.concatenate([edges, np.nextafter(edges, -np.inf), np.nextafter(edges, np.inf), [low - 1, high + 1]]).astype(np.float32)
    # XLA flushes subnormals (the neighbours of 0.0) to zero; numpy does not.
    values = values[(values == 0) | (np.abs(values) >= np.finfo(np.float32).tiny)]
    got = jax.jit(px.HistogramLog(bins, value_range))(values)
    np.testing.assert_array_equal(got, np.histogram(values, bins=bins, range=value_range)[0])
