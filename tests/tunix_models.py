"""Tiny random-weight builds of Google tunix 0.1.7's NNX language models, used as tunix
wrote them (vendored under `third_party/tunix`, see its README.md; no tunix install, no
download), and of Hugging Face transformers' Flax Gemma with the sizes of the tiny
tunix Gemma (linen; no torch, no download).

Every builder takes `seed` and keyword overrides of the model's own config class
(`gemma_lib.ModelConfig`, `qwen3_lib.ModelConfig`, `gemma3_lib.ModelConfig`,
transformers' `GemmaConfig`), plus:

- `remat`: `"none"`, `"block"` (attention and feed-forward blocks under `nnx.remat`) or
  `"decoder"` (each decoder layer under `nnx.remat`): the config's own `remat_config`.
- `abstract=True`: the model built by `nnx.eval_shape` (every array a
  `jax.ShapeDtypeStruct`, nothing computed).

tunix initialises its feed-forward kernels and its norm scales with constants (zeros,
ones), so the builders redraw every parameter: arrays of rank >= 2 normal with standard
deviation 1/sqrt(WIDTH), norm scales (rank 1) normal with standard deviation 0.1 around
0 (around 1 for Qwen3's RMSNorm, which multiplies by its weight instead of by
`1 + scale`). `hf_gemma` draws the same way.

A forward pass, for each model (positions and a causal mask made here; cache=None):

    logits = run_gemma(gemma(), tokens())        # or run_qwen3(qwen3(), ...), ...
    model(*inputs(tokens()))                     # -> (logits, None): tunix's call
    px.from_nnx(model)(*inputs(tokens()))        # the same, converted
    module, params = hf_gemma()
    logits = run_hf_gemma(module, params, tokens())

tunix's model files switch off Flax's eager variable sharding on import
(`flax_always_shard_variable`, in `env_utils.setup_sharding_environment`): their
parameters carry sharding annotations that need a mesh otherwise. This module puts the
flag back as it found it, so other tests in the same process are unaffected, and builds
the tunix models under `nnx.use_eager_sharding(False)`, which is what the flag does for
them.
"""

import warnings

import flax
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

_EAGER_SHARDING = flax.config.flax_always_shard_variable
from third_party.tunix.models.gemma import model as gemma_lib  # noqa: E402
from third_party.tunix.models.gemma3 import model as gemma3_lib  # noqa: E402
from third_party.tunix.models.qwen3 import model as qwen3_lib  # noqa: E402

flax.config.update("flax_always_shard_variable", _EAGER_SHARDING)

with warnings.catch_warnings():
    warnings.simplefilter("ignore", FutureWarning)
    from transformers import FlaxGemmaForCausalLM, GemmaConfig

VOCAB, WIDTH, HEADS, HEAD_DIM, HIDDEN, LAYERS = 64, 32, 4, 8, 64, 2
BATCH, LENGTH = 2, 6

# Gemma 2's features on the tiny Gemma: post-attention and post-ffw norms, logit soft
# caps, and a sliding-window layer then a global one: `gemma(**GEMMA2)`.
GEMMA2 = {
    "use_post_attn_norm": True,
    "use_post_ffw_norm": True,
    "final_logit_softcap": 30.0,
    "attn_logits_soft_cap": 50.0,
    "sliding_window_size": 4,
    "attention_types": (gemma_lib.AttentionType.LOCAL_SLIDING, gemma_lib.AttentionType.GLOBAL),
}


def tokens(batch: int = BATCH, length: int = LENGTH) -> jax.Array:
    """Token ids (batch, length), int32, in [1, VOCAB): no padding id 0 (Gemma 3's
    `get_attention_mask` treats 0 as padding). Fixed, no random draw."""
    ids = (np.arange(batch * length).reshape(batch, length) * 7 + 3) % (VOCAB - 1) + 1
    return jnp.asarray(ids, jnp.int32)


def positions(ids: jax.Array) -> jax.Array:
    batch, length = ids.shape
    return jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))


def causal_mask(ids: jax.Array) -> jax.Array:
    """tunix's attention mask: (batch, length, length) bool, True where a query position
    (row) may attend a key position (column)."""
    batch, length = ids.shape
    return jnp.broadcast_to(jnp.tril(jnp.ones((length, length), bool)), (batch, length, length))


def inputs(ids: jax.Array) -> tuple:
    """The positional arguments of a tunix model's `__call__` (Gemma, Gemma 3, Qwen 3
    alike): `(tokens, positions, cache, attention_mask)`, with no cache. The call
    returns `(logits, None)`: logits (batch, length, vocab)."""
    return ids, positions(ids), None, causal_mask(ids)


def run_gemma(model: "gemma_lib.Gemma", ids: jax.Array) -> jax.Array:
    logits, _ = model(ids, positions(ids), None, causal_mask(ids))
    return logits


def run_qwen3(model: "qwen3_lib.Qwen3", ids: jax.Array) -> jax.Array:
    logits, _ = model(ids, positions(ids), None, causal_mask(ids))
    return logits


def run_gemma3(model: "gemma3_lib.Gemma3", ids: jax.Array) -> jax.Array:
    # Gemma 3's own mask helper equals `causal_mask` for ids without padding (0):
    # model.get_attention_mask(ids).
    logits, _ = model(ids, positions(ids), None, causal_mask(ids))
    return logits


def _redraw(shapes, seed: int, *, norm_mean: float = 0.0):
    """Arrays with the shapes and dtypes of `shapes` (a pytree of arrays or
    `jax.ShapeDtypeStruct`s), drawn with NumPy (no program to compile): rank >= 2
    normal with standard deviation 1/sqrt(WIDTH), rank 1 (norm scales) normal around
    `norm_mean` with standard deviation 0.1."""
    rng = np.random.default_rng(seed)
    leaves, treedef = jax.tree.flatten(shapes)
    new = []
    for leaf in leaves:
        value = rng.standard_normal(leaf.shape, np.float32)
        value = value * WIDTH**-0.5 if len(leaf.shape) >= 2 else norm_mean + 0.1 * value
        new.append(jnp.asarray(value, leaf.dtype))
    return jax.tree.unflatten(treedef, new)


def _build(cls, config, seed: int, abstract: bool, norm_mean: float = 0.0):
    # The model is built abstractly (its own initialisers traced, not run), then its
    # parameters drawn with NumPy: a concrete init compiles one program per shape.
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(params=seed)))
    if abstract:
        return model
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    assert not jax.tree.leaves(rest), "tunix models hold parameters only"
    with nnx.use_eager_sharding(False):
        return nnx.merge(graphdef, _redraw(params, seed, norm_mean=norm_mean), rest)


def _remat(lib, remat: str | None, overrides: dict) -> dict:
    if remat is not None:
        overrides = {**overrides, "remat_config": lib.RematConfig[remat.upper()]}
    return overrides


def gemma_config(**overrides) -> "gemma_lib.ModelConfig":
    """Gemma 1 shape: as many kv heads as heads, so the attention has tunix's fused
    `qkv_einsum`; `num_kv_heads=2` gives `q_einsum` + `kv_einsum` with grouped queries,
    `num_kv_heads=1` multi-query (no grouping reshape); `**GEMMA2` Gemma 2's extras."""
    fields = {
        "num_layers": LAYERS,
        "num_embed": VOCAB,
        "embed_dim": WIDTH,
        "hidden_dim": HIDDEN,
        "num_heads": HEADS,
        "head_dim": HEAD_DIM,
        "num_kv_heads": HEADS,
        "final_logit_softcap": None,
        "use_post_attn_norm": False,
        "use_post_ffw_norm": False,
        "attention_types": (gemma_lib.AttentionType.GLOBAL,) * LAYERS,
    }
    fields.update(overrides)
    if "attention_types" not in overrides and "num_layers" in overrides:
        fields["attention_types"] = (gemma_lib.AttentionType.GLOBAL,) * fields["num_layers"]
    return gemma_lib.ModelConfig(**fields)


def gemma(seed: int = 0, *, remat: str | None = None, abstract: bool = False, **overrides) -> "gemma_lib.Gemma":
    """tunix's `Gemma` (models/gemma/model.py), tiny: see `gemma_config`."""
    config = gemma_config(**_remat(gemma_lib, remat, overrides))
    return _build(gemma_lib.Gemma, config, seed, abstract)


def gemma_gqa(seed: int = 0, **kwargs) -> "gemma_lib.Gemma":
    """tunix's `Gemma` with grouped queries: 4 heads over 2 kv heads (`q_einsum`,
    `kv_einsum`)."""
    return gemma(seed, **{"num_kv_heads": 2, **kwargs})


def qwen3_config(**overrides) -> "qwen3_lib.ModelConfig":
    """Qwen 3 dense, grouped queries (4 heads, 2 kv heads), untied `lm_head`;
    `use_tied_embedding=True` decodes with the embedding; `num_experts=4,
    num_experts_per_tok=2` gives the mixture of experts (its dense CPU path)."""
    fields = {
        "num_layers": LAYERS,
        "vocab_size": VOCAB,
        "embed_dim": WIDTH,
        "hidden_dim": HIDDEN,
        "num_heads": HEADS,
        "head_dim": HEAD_DIM,
        "num_kv_heads": 2,
        "rope_theta": 1_000_000,
        "norm_eps": 1e-06,
    }
    fields.update(overrides)
    return qwen3_lib.ModelConfig(**fields)


def qwen3(seed: int = 0, *, remat: str | None = None, abstract: bool = False, **overrides) -> "qwen3_lib.Qwen3":
    """tunix's `Qwen3` (models/qwen3/model.py), tiny: see `qwen3_config`."""
    config = qwen3_config(**_remat(qwen3_lib, remat, overrides))
    return _build(qwen3_lib.Qwen3, config, seed, abstract, norm_mean=1.0)


def gemma3_config(**overrides) -> "gemma3_lib.ModelConfig":
    """Gemma 3, text only, float32 parameters (tunix's default is bfloat16), grouped
    queries (4 heads, 2 kv heads; `num_kv_heads=4` gives the fused `qkv_einsum`). Layers
    follow tunix's pattern of 5 sliding-window layers then a global one, so both tiny
    layers slide, over a window of 4 (shorter than `tokens()`); `num_layers=6` reaches
    a global layer."""
    fields = {
        "num_layers": LAYERS,
        "num_embed": VOCAB,
        "embed_dim": WIDTH,
        "hidden_dim": HIDDEN,
        "num_heads": HEADS,
        "head_dim": HEAD_DIM,
        "num_kv_heads": 2,
        "sliding_window_size": 4,
        "local_base_frequency": 10_000,
        "global_base_frequency": 1_000_000,
        "param_dtype": jnp.float32,
    }
    fields.update(overrides)
    return gemma3_lib.ModelConfig(**fields)


def gemma3(seed: int = 0, *, remat: str | None = None, abstract: bool = False, **overrides) -> "gemma3_lib.Gemma3":
    """tunix's `Gemma3` (models/gemma3/model.py), tiny and text only: see
    `gemma3_config`."""
    config = gemma3_config(**_remat(gemma3_lib, remat, overrides))
    return _build(gemma3_lib.Gemma3, config, seed, abstract)


def hf_gemma_config(**overrides) -> "GemmaConfig":
    """transformers' `GemmaConfig` with the sizes of `gemma_config()`: the same vocab,
    width, heads, kv heads, head_dim, feed-forward width and layers; RMSNorm epsilon
    1e-6 and tanh GELU as tunix's; tied embedding; rope base 10,000 (HF's Flax Gemma
    ignores `rope_theta`). `max_position_embeddings` is kept small, as HF builds a causal
    mask of its square in each layer, but at least 2 * head_dim: HF's
    `create_sinusoidal_positions` cuts its table's sin|cos axis (2 * head_dim long) to
    `max_position_embeddings`, which breaks the rotary embedding below that."""
    fields = {
        "vocab_size": VOCAB,
        "hidden_size": WIDTH,
        "intermediate_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "head_dim": HEAD_DIM,
        "rms_norm_eps": 1e-06,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
    }
    fields.update(overrides)
    fields.setdefault("max_position_embeddings", max(16, 2 * fields["head_dim"]))
    return GemmaConfig(**fields)


def hf_gemma(seed: int = 0, **overrides):
    """Hugging Face's `FlaxGemmaForCausalLM` (transformers 4.57.6), tiny: returns
    `(module, params)`, the linen module (`FlaxGemmaForCausalLMModule`) and its
    parameters (`{"model": ...}`; no `lm_head` entry when tied), drawn as the tunix
    models' are (HF's own init draws N(0, 0.02) and sets norm weights to 1). The model's
    own init is not run: its parameter shapes come from `jax.eval_shape`."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        hf = FlaxGemmaForCausalLM(hf_gemma_config(**overrides), seed=seed, _do_init=False)
    module = hf.module
    ids = jnp.ones((1, 1), jnp.int32)
    shapes = jax.eval_shape(lambda: module.init(jax.random.key(seed), ids, ids, ids, return_dict=False))["params"]
    return module, _redraw(shapes, seed)


def run_hf_gemma(module, params, ids: jax.Array) -> jax.Array:
    """Logits (batch, length, vocab) of HF's Flax Gemma: all-ones padding mask (HF adds
    the causal mask itself), positions 0.. ."""
    return module.apply({"params": params}, ids, jnp.ones_like(ids), positions(ids)).logits
