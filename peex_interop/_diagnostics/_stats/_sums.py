"""The sums over one array that its statistics share: a mean's, a spread's and a
fraction's come from one pass over the centred values (`_Sums`)."""

from collections.abc import Hashable
from typing import Any

import jax.numpy as jnp
from jax import lax

from ._pooled import _Average, _Spread


class _Sums:
    """The sums over an array of the terms its statistics need (`_terms_of`), each
    computed once for all of them (the mean's and the variance's share the centred
    values). The values are shifted by one of them so that a mean large against the
    spread does not cancel the variance away, and summed in float32 at least. The shift
    is the first value clipped to `eps * max` of the dtype: an infinite one (a masked
    -inf logit) would make every shifted value NaN, and a huge one would overflow the
    differences where the values' sum does not. One reduction per term: stacking the
    terms into one reduction measured slower on CPU (XLA then writes the stacked terms
    out, 3x the layer's values), and so did one variadic reduction of all terms (XLA:CPU
    then loops over them unvectorised: 17 µs a layer of 16,384 values instead of 13)."""

    def __init__(self, x: Any, terms: tuple[Hashable, ...]):
        self.dtype, self.size = x.dtype, x.size
        total = jnp.promote_types(x.dtype, jnp.float32)
        values = x.astype(total)
        if jnp.issubdtype(x.dtype, jnp.complexfloating) and set(terms) - {"centred"}:
            raise TypeError(
                f"px.StdLog and px.NearZeroLog (so px.activation_stats) take real arrays, got "
                f"{x.dtype}{list(x.shape)}: log jnp.abs(x), or x.real and x.imag, with a px.FunctionLog"
            )
        self.shift = jnp.zeros((), total)
        if x.size:
            first, info = lax.stop_gradient(jnp.ravel(values)[0]), jnp.finfo(total)
            # A clip, which XLA fuses into each use (a select was a kernel per layer).
            real = not jnp.issubdtype(total, jnp.complexfloating)
            self.shift = jnp.clip(first, -info.eps * info.max, info.eps * info.max) if real else first
        centred = values - self.shift

        def term(name: Any) -> Any:
            if name == "centred":
                return centred
            if name == "centred squares":
                return centred * centred
            _, threshold = name  # ("at most", threshold)
            return (x <= threshold).astype(total)

        self.sums = {name: jnp.sum(term(name)) for name in terms}

    # The statistics, in the forms that pool (`_Statistic`): sums, divided where read.
    def mean(self) -> _Average:
        return _Average(self.sums["centred"], self.shift, self.size, self.dtype)

    def spread(self) -> _Spread:
        return _Spread(self.sums["centred"], self.sums["centred squares"], self.shift, self.size, self.dtype)

    def fraction(self, threshold: float) -> _Average:
        return _Average(self.sums[("at most", threshold)], None, self.size, self.dtype)

