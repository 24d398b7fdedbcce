"""Layer kinds that mean the same thing in every library (linear/dense, conv, ...).

Each adapter maps its library's classes to these names; `kind_of` looks a module's
class (and its bases, so subclasses inherit their parent's kind) up in such a table.
"""

from typing import Any

import equinox as eqx

from ._paths import AbstractConverted

KINDS = (
    "linear", "conv", "attention", "norm", "embedding", "dropout", "recurrent",
    "pool", "activation", "container", "other",
)


def kind_of(module: Any, table: dict[type, str]) -> str:
    """The kind of `module` (an instance or a class) according to `table`."""
    cls = module if isinstance(module, type) else type(module)
    for base in cls.__mro__:
        if base in table:
            return table[base]
    return "other"


EQUINOX_KINDS: dict[type, str] = {
    eqx.nn.Linear: "linear",
    eqx.nn.Identity: "other",
    eqx.nn.Conv: "conv",
    eqx.nn.ConvTranspose: "conv",
    eqx.nn.MultiheadAttention: "attention",
    eqx.nn.LayerNorm: "norm",
    eqx.nn.BatchNorm: "norm",
    eqx.nn.GroupNorm: "norm",
    eqx.nn.RMSNorm: "norm",
    eqx.nn.Embedding: "embedding",
    eqx.nn.Dropout: "dropout",
    eqx.nn.LSTMCell: "recurrent",
    eqx.nn.GRUCell: "recurrent",
    eqx.nn.Pool: "pool",
    eqx.nn.Lambda: "activation",
    eqx.nn.Sequential: "container",
    eqx.nn.MLP: "container",
}


def layer_kind(owner: Any, module: Any) -> str:
    """The kind of `module` called as a layer of `owner`: converted models know their
    library's classes; everything else is an Equinox module."""
    if isinstance(owner, AbstractConverted) and owner is not module:
        return owner.layer_kind(module)
    return kind_of(module, EQUINOX_KINDS)
