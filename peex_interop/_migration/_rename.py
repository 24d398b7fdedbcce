import re
from collections.abc import Mapping
from typing import Any

from .._diagnostics import PackedLog

_SUFFIX = re.compile(r"(@\d+)?(:in)?\Z")


def rename(log: Mapping[str, Any], mapping: dict[str, str]) -> Mapping[str, Any]:
    """Re-key a log: `path` -> `mapping[path]`, keeping repeated-call (`@n`) and pre-log
    (`:in`) suffixes; keys not in `mapping` are kept.

    **Arguments:**

    - `log`: a log returned by a hook wrapper (or a `BackwardHook`'s gradient log).
    - `mapping`: `{path: new_key}`, e.g. an `px.align(...).mapping` to give a ported
        model's logs the keys of the original (invert it to go back).

    **Returns:**

    A new dict, the values the same objects; a `px.PackedLog` (a statistics log) stays
    packed, re-keyed around the same buffers.
    """
    renamed = {}
    for key, value in log.items():
        base = _SUFFIX.sub("", key, count=1)  # both parts are optional: every key has a (maybe empty) suffix
        suffix = key[len(base):]
        new = mapping.get(base, base) + suffix
        if new in renamed:
            raise ValueError(f"rename maps two keys of the log to {new!r}")
        renamed[new] = value
    if isinstance(log, PackedLog):
        return log.with_keys(tuple(renamed))
    return renamed
