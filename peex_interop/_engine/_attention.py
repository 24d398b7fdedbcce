"""The attention weights of `jax.nn.dot_product_attention`, as a site of the layer that
calls it (`<layer>.weights`, shape `(..., heads, q, k)`).

JAX's XLA implementation forms the weights inside a `vmap` over the query heads of
each key/value head group, and other implementations (cuDNN) never form them at all.
While the weights site of the calling layer is selected, the call is computed with the
weights of all heads formed at once, as the XLA implementation defines them
(`softmax(q k^T * scale + bias)`, masked, in float32); otherwise it is JAX's own call.
Selecting the weights of an implementation that never forms them raises.
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._errors import HookError
from . import _jax
from ._inner_sites import WEIGHTS, attention_sites_wanted, inner_site, running_path


def _explicit(original: Any) -> Any:
    def dot_product_attention(
        query: Any, key: Any, value: Any, bias: Any = None, mask: Any = None, *,
        scale: float | None = None, is_causal: bool = False, query_seq_lengths: Any = None,
        key_value_seq_lengths: Any = None, local_window_size: Any = None,
        implementation: str | None = None, return_residual: bool = False,
    ) -> Any:
        options = dict(
            scale=scale, is_causal=is_causal, query_seq_lengths=query_seq_lengths,
            key_value_seq_lengths=key_value_seq_lengths, local_window_size=local_window_size,
            implementation=implementation, return_residual=return_residual,
        )
        if not attention_sites_wanted():
            return original(query, key, value, bias, mask, **options)
        fused = implementation not in (None, "xla")
        if fused or return_residual:
            reason = f"implementation={implementation!r}" if fused else "return_residual=True"
            raise HookError(
                f"layer {running_path()!r} selects a site formed with the attention weights of its "
                f"jax.nn.dot_product_attention call, which with {reason} are never formed "
                "(a fused kernel): they cannot be a site. Use implementation=None or 'xla', or "
                "exclude the attention's sites from the selection."
            )
        return _with_weights(query, key, value, bias, mask, options)

    return dot_product_attention


def _with_weights(query: Any, key: Any, value: Any, bias: Any, mask: Any, options: dict) -> Any:
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    batch = query.shape[:-3]

    def four_d(t: Any) -> Any:
        # JAX's own layout: (B, T, N, H), all batch dimensions in one.
        t = jnp.asarray(t)
        t = jnp.expand_dims(t, tuple(range(4 - t.ndim))) if t.ndim < 4 else t
        return jnp.reshape(t, (-1, *t.shape[-3:]))

    q, k, v = four_d(query), four_d(key), four_d(value)
    groups = q.shape[2] // k.shape[2]
    # Query head n attends with key/value head n // groups (JAX's grouping).
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    scale = options["scale"]
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    logits = jnp.einsum("BTNH,BSNH->BNTS", q, k, preferred_element_type=jnp.promote_types(q.dtype, np.float32))
    logits = logits * jnp.array(scale, dtype=logits.dtype)
    if bias is not None:
        logits = (logits + four_d(bias)).astype(logits.dtype)
    window = options["local_window_size"]
    window = (window, window) if isinstance(window, int) else window
    q_lengths, kv_lengths = options["query_seq_lengths"], options["key_value_seq_lengths"]
    logits = _jax.apply_masks(
        logits, None if mask is None else four_d(mask).astype(bool), options["is_causal"],
        None if q_lengths is None else jnp.asarray(q_lengths),
        None if kv_lengths is None else jnp.asarray(kv_lengths), window,
    )
    logits = jnp.reshape(logits, (*batch, *logits.shape[1:]))

    def weights_of(logits: Any) -> Any:
        return jax.nn.softmax(logits.astype(np.float32), axis=-1).astype(key.dtype)

    weights = inner_site(*WEIGHTS, weights_of, (logits,), {})
    encoded = jnp.einsum("BNTS,BSNH->BTNH", jnp.reshape(weights, (-1, *weights.shape[-3:])), v)
    if q_lengths is not None:
        padding = _jax.padding_mask_encoded(encoded.shape[1], jnp.asarray(q_lengths))
        encoded = encoded * padding.astype(encoded.dtype)
    return jnp.reshape(encoded, query.shape)


def attention_patches() -> list[tuple[Any, str, Any]]:
    """The patch making the weights of `jax.nn.dot_product_attention` a site."""
    return [(jax.nn, "dot_product_attention", _explicit)]
