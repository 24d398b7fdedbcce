"""The log-everything and dispatch rows: each library's model under its own jit and its
own log of every layer, against the converted model unhooked, identity-hooked and
log-hooked (`forward_variants`), and what this run measured that explains each row."""

from functools import partial

import equinox as eqx
import jax

import peex_interop as px
from harness import Variant, hooked_output
from libraries import BUILDERS, forward, input_shape, inputs
from page import fmt, micros_row, ratio_row, signed


def forward_variants(library, name):
    """Variant name -> `Variant`, for this library's model: its own jitted call ("raw",
    for `jax.jit` libraries also "raw (A/A)" and on the tiny model "bare module":
    `jitted_raw`) and log-everything mechanism ("native log"), and ours on the converted model
    (Equinox: the model itself, so that its "unhooked" repeats "raw"), unhooked and
    hooked, under `eqx.filter_jit` and `jax.jit`."""
    x = inputs(input_shape(name))
    converted, batched, calls = BUILDERS[library](name, x)
    fwd = forward(batched)
    jits = {"": eqx.filter_jit(fwd)}
    # Equinox modules hold non-array leaves that `jax.jit` cannot take (the attention's
    # dropout flags): they run under `eqx.filter_jit` only.
    if library != "Equinox":
        jits[" jax.jit"] = jax.jit(fwd)
    for suffix, jit in jits.items():
        calls[f"unhooked{suffix}"] = Variant(partial(jit, converted, x))
        calls[f"identity{suffix}"] = Variant(partial(jit, px.ForwardHook(converted), x), hooked_output)
    # Like for like: under the native log's own jit. With a dozen outputs, the same
    # program under `eqx.filter_jit` and under `jax.jit` measured up to 15% apart in one
    # run and not in the next, for the native log as for ours.
    calls["log"] = Variant(
        partial(jits.get(" jax.jit", jits[""]), px.ForwardHook(converted, log_fn=px.IdentityLog()), x),
        hooked_output,
    )
    if library == "Equinox" and name != "tiny":
        # peex 0.0.3 hooks the model's attributes only (`where="*"`: one segment):
        # the same sites, the same values returned.
        peex_sites = px.ForwardHook(converted, log_fn=px.IdentityLog(), where="*")
        calls["log, peex's sites"] = Variant(partial(jits[""], peex_sites, x), hooked_output)
        _check_same_logs(calls["log, peex's sites"], calls["native log"])
    return calls


def _check_same_logs(ours, theirs):
    """Raise unless two log-hooked calls return the same log: keys and values."""
    (_, mine), (_, native) = ours.call(), theirs.call()
    if set(mine) != set(native):
        raise AssertionError(f"not like for like: px logs {sorted(mine)}, peex {sorted(native)}")
    for key in mine:
        for a, b in zip(jax.tree.leaves(mine[key]), jax.tree.leaves(native[key]), strict=True):
            if a.shape != b.shape or not bool((a == b).all()):
                raise AssertionError(f"not like for like: {key!r} differs")


def flatten_text(flatten):
    """`jax.tree.flatten` of each tiny call's arguments, from `run`'s `flatten`."""
    return "`jax.tree.flatten` of the call's arguments: " + ", ".join(
        f"{name} {micros:.2f} µs" for name, (_, micros) in flatten.items()
    )


def dispatch_whys(library, name, steady, flatten):
    """`(eqx.filter_jit row's why, jax.jit row's why)` for a converted model, from this
    run: `eqx.filter_jit`'s own cost (the raw call under it, the same model under
    `jax.jit`; on the tiny model, Equinox's raw model too), and on the tiny model the
    floor, the bare module."""
    m = steady[library, name]
    filter_jit = (f"eqx.filter_jit's own cost: the raw call itself under eqx.filter_jit costs "
                  f"{m['raw eqx.filter_jit'] / m['raw']:.3f}x; the same converted model under jax.jit "
                  f"costs {fmt(m['unhooked jax.jit'])} (eqx.filter_jit: "
                  f"{signed(m['unhooked'] - m['unhooked jax.jit'])})")
    if name != "tiny":
        return filter_jit, ""
    filter_jit += (f"; Equinox's own tiny model costs {fmt(steady['Equinox', 'tiny']['raw'])} "
                   f"under eqx.filter_jit")
    jit = (f"the floor: a bare eqx.Module around the raw call's arguments costs "
           f"{m['bare module'] / m['raw']:.3f}x the raw call ({signed(m['bare module'] - m['raw'])}), "
           f"ours {m['unhooked jax.jit'] / m['bare module']:.3f}x the floor; "
           + flatten_text(flatten[library]))
    return filter_jit, jit


def forward_rows(library, name, steady, flatten, sizes):
    medians, model = steady[library, name], f"{library} {name}"
    # peex 0.0.3 logs the transformer's six blocks only, ours every layer: reported.
    like_for_like = library != "Equinox" or name == "MLP"
    native = {"Equinox": "peex 0.0.3 IdentityLog", "Haiku": "hk.intercept_methods",
              "NNX": "nnx.capture", "linen": "capture_intermediates"}[library]
    rows = []
    if name != "tiny":
        aa = medians["unhooked" if library == "Equinox" else "raw (A/A)"] / medians["raw"]
        why = f"the raw call timed twice gives {aa:.3f}"
        if (model, "log") in sizes:  # jaxprs are sized for the MLPs only
            ours, theirs = sizes[model, "log"], sizes[model, "native log"]
            why = (f"jaxprs: ours {ours[2]} equations returning {ours[3]:,} values, the native log "
                   f"{theirs[2]} returning {theirs[3]:,}; " + why)
        if not like_for_like:
            why = "px logs every layer at every depth, peex the model's attributes only; " + why
        rows.append(ratio_row("log-everything", f"px IdentityLog / {native}", model, medians,
                              "log", "native log", 1.05 if like_for_like else None, why))
        if library == "Equinox":
            rows.append(ratio_row(
                "log-everything", "px IdentityLog on peex's sites (where='*') / peex 0.0.3 IdentityLog", model,
                medians, "log, peex's sites", "native log", 1.05,
                "like for like: the same sites, the same values returned (checked before timing); " + why))
    # Equinox's "unhooked" is its raw call again.
    rows.append(ratio_row("dispatch", "A/A: the raw call timed twice (noise floor)", model, medians,
                          "unhooked" if library == "Equinox" else "raw (A/A)", "raw", None))
    if library != "Equinox":
        filter_jit, jit = dispatch_whys(library, name, steady, flatten)
        rows += [
            ratio_row("dispatch", "unhooked converted, eqx.filter_jit / raw jitted call",
                      model, medians, "unhooked", "raw", 1.05, filter_jit),
            ratio_row("dispatch", "unhooked converted, eqx.filter_jit / raw call under eqx.filter_jit",
                      model, medians, "unhooked", "raw eqx.filter_jit", 1.05),
            ratio_row("dispatch", "unhooked converted, jax.jit / raw jitted call", model,
                      medians, "unhooked jax.jit", "raw", 1.05, jit),
        ]
    if name == "tiny" and library != "Equinox":
        rows += [
            ratio_row("dispatch", "bare eqx.Module around the params, jax.jit / raw jitted call",
                      model, medians, "bare module", "raw", None, flatten_text(flatten[library])),
            ratio_row("dispatch", "unhooked converted, jax.jit / bare eqx.Module around the params",
                      model, medians, "unhooked jax.jit", "bare module", 1.05),
        ]
    # A few µs are measurable only where the call is all dispatch; on the bigger models
    # the difference is reported, within the A/A noise.
    target = 5e-6 if name == "tiny" else None
    rows += [
        micros_row("dispatch", "hook wrapper: identity-hooked - unhooked, eqx.filter_jit",
                   model, medians, "identity", "unhooked", target),
        micros_row("dispatch", "hook wrapper: identity-hooked - unhooked, jax.jit", model,
                   medians, "identity jax.jit", "unhooked jax.jit", target),
    ]
    return [r for r in rows if r is not None]
