"""What both Flax APIs share, linen's and NNX's adapters alike: the parameter layout
of their `ConvTranspose` (one module, one implementation in Flax)."""

import dataclasses
from typing import Any

from .._engine import Declared, at, declare, lax_transpose_padding


def flax_transpose_spec(layer: Any, dims: int) -> Declared:
    """The layout of an NNX or linen `ConvTranspose`: its kernel is run unflipped over
    the input dilated by the stride, or with `transpose_kernel=True` stored (*window,
    out, in) and spatially flipped."""
    window = tuple(f"window{i}" for i in range(dims))
    ones = (1,) * dims

    def spread(value: Any) -> tuple[int, ...]:
        return ones if value is None else (value,) * dims if isinstance(value, int) else tuple(value)

    kernel_size, strides, dilation = spread(layer.kernel_size), spread(layer.strides), spread(layer.kernel_dilation)
    padding = layer.padding
    if isinstance(padding, int):
        padding = [(padding, padding)] * dims
    elif not isinstance(padding, str):
        padding = [(p, p) if isinstance(p, int) else p for p in padding]
    if padding != "CIRCULAR":
        padding = lax_transpose_padding(kernel_size, strides, dilation, padding)
    facts = {"groups": 1, "stride": strides, "dilation": dilation, "padding": padding}
    if layer.transpose_kernel:
        kernel = dataclasses.replace(at("kernel", *window, "out", "in"), flipped=window)
    else:
        kernel = at("kernel", *window, "in", "out")
    return declare("conv_transpose", kernel=kernel, bias=at("bias", "out"), facts=facts)
