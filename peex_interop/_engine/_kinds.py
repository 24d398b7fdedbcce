"""Layer kinds that mean the same thing in every library (linear/dense, conv, ...).

Each adapter maps its library's classes to these names; `kind_of` looks a module's
class (and its bases, so subclasses inherit their parent's kind) up in such a table.
"""

from typing import Any

KINDS = (
    "linear", "conv", "attention", "norm", "embedding", "dropout", "recurrent",
    "pool", "activation", "container", "other", "method", "sown", "perturbation",
    "attention_weights", "attention_scores", "function",
)

# The kind of a call of a layer's method other than `__call__` (`embedder.attend`,
# `_methods.py`): which kind of layer it belongs to does not tell what it computes.
METHOD = "method"
# A value a layer sows (Flax's `self.sow(..., name, value)`), and one it marks for its
# gradient (`self.perturb(name, value)`).
SOWN, PERTURBATION = "sown", "perturbation"
# The kinds of a layer's own sites besides its call, named `<layer>.<name>`: they are
# the layer's (its parameters, the sites inside it).
MEMBERS = (METHOD, SOWN, PERTURBATION)

# Kinds of sites *inside* a layer (`_engine/_inner_sites.py`): attention weights and
# scores, and calls of functions named with `px.function_sites`.
INNER_KINDS = ("attention_weights", "attention_scores", "function")


def kind_of(module: Any, table: dict[type, str]) -> str:
    """The kind of `module` (an instance or a class) according to `table`."""
    cls = module if isinstance(module, type) else type(module)
    for base in cls.__mro__:
        if base in table:
            return table[base]
    return "other"
