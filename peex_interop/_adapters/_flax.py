"""What both Flax APIs share, linen's and NNX's adapters alike: the parameter layouts
of their multi-head attention's projections and of their `ConvTranspose` (one module,
one implementation in Flax each), and the gates of their LSTM cell."""

import dataclasses
from typing import Any

from .._engine import Declared, at, declare, lax_transpose_padding

# The projections of a Flax multi-head attention, named so in both APIs.
ATTENTION_INPUTS = ("query", "key", "value")
LSTM_GATES = ("i", "f", "g", "o")


def flax_attention_spec(name: str) -> Declared | None:
    """The layout of the projection `name` of a Flax multi-head attention (`None` for
    another name): the inputs' kernels split their output into heads, the output's its
    input."""
    if name in ATTENTION_INPUTS:
        return declare(
            "attention_in", kernel=at("kernel", "in", "heads", "head_dim"), bias=at("bias", "heads", "head_dim")
        )
    if name == "out":
        return declare("attention_out", kernel=at("kernel", "heads", "head_dim", "out"), bias=at("bias", "out"))
    return None


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
