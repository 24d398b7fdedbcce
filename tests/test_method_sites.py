"""Issue 40: a method site (`<layer>.<method>`) has everything a layer call has: logs
and edits, backward logs, `px.CallSite`, `px.cache`/`px.patch`, one step of a scanned
stack and threaded transforms, under `eqx.filter_jit` and `jax.checking_leaks()`;
each compared with the method computed by hand."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import peex_interop as px
from models import close, jitted

STEPS, WIDTH, VOCAB = 3, 4, 7


class Block(eqx.Module):
    lin: eqx.nn.Linear

    def forward(self, x):
        return jnp.tanh(self.lin(x))


class TiedStack(eqx.Module):
    """A scanned stack whose body calls a method, and a tied embedding whose `attend`
    is the output projection."""

    blocks: Block
    embed: eqx.nn.Embedding

    def attend(self, h):
        return h @ self.embed.weight.T

    def __call__(self, ids):
        h = jax.vmap(self.embed)(ids)
        arrays, static = eqx.partition(self.blocks, eqx.is_array)
        h, _ = jax.lax.scan(lambda h, a: (jax.vmap(eqx.combine(a, static).forward)(h), None), h, arrays)
        return jax.vmap(self.attend)(h)


def model():
    k1, k2 = jax.random.split(jax.random.key(0))
    blocks = eqx.filter_vmap(lambda k: Block(eqx.nn.Linear(WIDTH, WIDTH, key=k)))(jax.random.split(k1, STEPS))
    return TiedStack(blocks, eqx.nn.Embedding(VOCAB, WIDTH, key=k2))


def by_hand(m, ids, edit_step=None, edit=lambda h: h):
    """The stack computed step by step, `edit` applied to one step's `forward`."""
    h = m.embed.weight[ids]
    outs = []
    for step in range(STEPS):
        lin = jax.tree.map(lambda a: a[step] if eqx.is_array(a) else a, m.blocks.lin)
        h = jnp.tanh(h @ lin.weight.T + lin.bias)
        h = edit(h) if step == edit_step else h
        outs.append(h)
    return jnp.stack(outs), h @ m.embed.weight.T


def test_method_sites_log_edit_and_step_like_layers():
    m, ids = model(), jnp.array([1, 2, 5])
    steps, logits = by_hand(m, ids)
    out, log = jitted(px.ForwardHook(m, log_fn=px.IdentityLog()), ids)
    assert set(log) == {"embed", "blocks.lin", "blocks.forward", "attend"}
    close(log["blocks.forward"], steps, tol=1e-6)
    close(log["attend"], logits, tol=1e-6)
    close(out, logits, tol=1e-6)
    # One step of the stack, named after the method's layer, edited.
    negated = px.ForwardHook(m, hook_fn=lambda h: -h, log_fn=px.IdentityLog(), where="blocks.1.forward")
    edited, log = jitted(negated, ids)
    close(log["blocks.1.forward"], -steps[1], tol=1e-6)
    close(edited, by_hand(m, ids, 1, lambda h: -h)[1], tol=1e-6)
    # The call site a hook sees.
    seen = px.ForwardHook(m, log_fn=lambda h, site: (site.kind, site.stack_root), where="blocks.forward")
    _, log = seen(ids)
    assert log["blocks.forward"] == ("method", "blocks")


def test_method_sites_cache_patch_and_backward():
    m, ids, other = model(), jnp.array([1, 2, 5]), jnp.array([3, 3, 0])
    _, cache = px.cache(m, ids, where="blocks.forward")
    patched = px.patch(m, cache, "blocks.2.forward")(other)
    clean_last = by_hand(m, ids)[0][2]
    np.testing.assert_allclose(patched, clean_last @ m.embed.weight.T, rtol=1e-5, atol=1e-6)

    hooked = px.BackwardHook(m, log_fn=px.IdentityLog(), where=["attend", "blocks.forward"]).init(ids)
    with jax.checking_leaks():
        grads = eqx.filter_grad(lambda h, x: jnp.sum(jnp.sin(h(x))))(hooked, ids)
    steps, logits = by_hand(m, ids)
    close(grads.log["attend"], jnp.cos(logits), tol=1e-6)
    last = jax.grad(lambda h: jnp.sum(jnp.sin(h @ m.embed.weight.T)))(steps[-1])
    close(grads.log["blocks.forward"][-1], last, tol=1e-6)
