"""px's patching sweeps against TransformerLens's patching loops (issue 48), side by side
in one run on the same machine, weights and tokens.

A Hugging Face Flax GPT-2 of random weights (`FULL`: GPT-2 small's sizes, 12 layers of
width 768, 12 heads, vocabulary 50,257, on 64 positions) runs in px (`px.from_linen`);
the same weights, in TransformerLens's layout, run in a `HookedTransformer` in a
persistent process of build/tl-venv (`make tl-venv`: torch and transformer-lens in a
Python 3.11 venv of their own; tests/transformer_lens_harness.py). Two sweeps, each with
a logit difference at the last position as the metric:

- resid_pre: every block's input, one position at a time (TransformerLens's
  `get_act_patch_resid_pre`: layers x positions forward passes);
- head out: every head's output at all positions (`get_act_patch_attn_head_out_all_pos`:
  layers x heads passes).

Variants: TransformerLens's function (its Python loop, one forward pass per cell, under
`torch.no_grad`, as TransformerLens's demos run: `torch.set_grad_enabled(False)`); px's
`px.patch_sweep` with the metric of the output (like for like: the logits of every
position computed, as TransformerLens does); and with `metric_site="transformer.ln_f"`,
the metric of the final residual stream (the same numbers: the residual dotted with the
difference of the two unembedding columns; the runs stop before the unembedding). Both
sides use the machine's cores (torch's and XLA's default thread counts). Each round
times every variant once, in a shuffled order; first calls (px: trace, compile and run
in this process; TransformerLens: its first call after building the model) stand beside
the warm medians. Every px table is compared with TransformerLens's.

Usage: `python benchmarks/bench.py --only transformer-lens [--quick] --out
docs/benchmarks_transformer_lens.md` (`make bench-tl`).
"""

import dataclasses
import random
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import peex_interop as px
from page import fmt

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from transformer_lens_harness import ReferenceServer, available, gpt2_to_transformer_lens

with warnings.catch_warnings():
    warnings.simplefilter("ignore", FutureWarning)
    from transformers import FlaxGPT2LMHeadModel, GPT2Config


@dataclasses.dataclass(frozen=True)
class Sizes:
    layers: int
    width: int
    heads: int
    vocab: int
    positions: int
    rounds: int


FULL = Sizes(layers=12, width=768, heads=12, vocab=50_257, positions=64, rounds=3)
QUICK = Sizes(layers=2, width=64, heads=4, vocab=512, positions=12, rounds=2)
CORRECT, WRONG = 0, 1  # the metric's two tokens


@dataclasses.dataclass
class Timing:
    first: float
    warm: list[float]
    table: np.ndarray | None = None


def gpt2(sizes: Sizes, seed: int = 0):
    """The px model and the tokens: clean and corrupted, differing at one position."""
    config = GPT2Config(n_layer=sizes.layers, n_embd=sizes.width, n_head=sizes.heads,
                        n_positions=sizes.positions, vocab_size=sizes.vocab)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = FlaxGPT2LMHeadModel(config, seed=seed)
    rng = np.random.default_rng(seed)
    clean = rng.integers(0, sizes.vocab, (1, sizes.positions))
    corrupted = clean.copy()
    corrupted[0, sizes.positions // 2] = (clean[0, sizes.positions // 2] + 1) % sizes.vocab
    return hf, px.from_linen(hf.module, {"params": hf.params}), clean, corrupted


def px_sweeps(model, hf, clean, corrupted, heads):
    """The px variants: name -> zero-argument call returning the sweep's table."""
    rest = (jnp.ones_like(clean), jnp.arange(clean.shape[1])[None])
    _, cache = px.cache(model, jnp.asarray(clean), *rest,
                        where=["transformer.h.*", "transformer.h.*.attn.c_proj"], inputs=True)
    embedding = hf.params["transformer"]["wte"]["embedding"]  # tied: the unembedding's columns
    direction = embedding[CORRECT] - embedding[WRONG]

    def of_logits(out):
        return out.logits[0, -1, CORRECT] - out.logits[0, -1, WRONG]

    def of_residual(normed):
        return normed[0, -1] @ direction

    sweeps = {
        "resid_pre": dict(where="transformer.h.*", inputs=True, cells=px.Along(1)),
        "head out": dict(where="transformer.h.*.attn.c_proj", inputs=True, cells=px.Groups(-1, heads)),
    }
    variants = {}
    for sweep, spec in sweeps.items():
        variants[sweep, "px"] = lambda spec=spec: px.patch_sweep(
            model, cache, jnp.asarray(corrupted), *rest, metric=of_logits, **spec)
        variants[sweep, "px, metric of ln_f"] = lambda spec=spec: px.patch_sweep(
            model, cache, jnp.asarray(corrupted), *rest, metric=of_residual, metric_site="transformer.ln_f", **spec)
    return variants


TL_FUNCTIONS = {"resid_pre": "get_act_patch_resid_pre", "head out": "get_act_patch_attn_head_out_all_pos"}


def measure(sizes: Sizes) -> tuple[dict, str]:
    """`(timings, versions)`: a `Timing` per (sweep, variant)."""
    hf, model, clean, corrupted = gpt2(sizes)
    variants = px_sweeps(model, hf, clean, corrupted, sizes.heads)
    timings: dict = {}
    with ReferenceServer() as tl, tempfile.TemporaryDirectory() as folder:
        weights = Path(folder, "weights.npz")
        np.savez(weights, **gpt2_to_transformer_lens(hf.params, sizes.heads))
        built = tl.build(n_layers=sizes.layers, d_model=sizes.width, n_heads=sizes.heads,
                         n_ctx=sizes.positions, d_vocab=sizes.vocab, weights=str(weights),
                         clean=clean.tolist(), corrupted=corrupted.tolist(), correct=CORRECT, wrong=WRONG)
        for (sweep, variant), call in variants.items():
            start = time.perf_counter()
            table = np.asarray(jax.block_until_ready(call()))
            timings[sweep, variant] = Timing(time.perf_counter() - start, [], table)
        for sweep, fn in TL_FUNCTIONS.items():
            answer = tl.request(op="time", fn=fn, repeats=1, table=True)  # its first call
            timings[sweep, "TransformerLens"] = Timing(answer["seconds"][0], [], np.asarray(answer["table"]))
        names, rng = [*variants, *((sweep, "TransformerLens") for sweep in TL_FUNCTIONS)], random.Random(0)
        for _ in range(sizes.rounds):
            rng.shuffle(names)
            for sweep, variant in names:
                if variant == "TransformerLens":
                    seconds = tl.time(TL_FUNCTIONS[sweep])[0]
                else:
                    start = time.perf_counter()
                    jax.block_until_ready(variants[sweep, variant]())
                    seconds = time.perf_counter() - start
                timings[sweep, variant].warm.append(seconds)
    for (sweep, variant), timing in timings.items():
        reference = timings[sweep, "TransformerLens"].table
        if timing.table.shape != reference.shape or not np.allclose(timing.table, reference, atol=1e-4, rtol=1e-4):
            raise AssertionError(f"{sweep}, {variant}: the table differs from TransformerLens's")
    return timings, built["versions"]


def duration(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds >= 1 else fmt(seconds)


def page(sizes: Sizes, timings: dict, versions: str, quick: bool) -> str:
    """The markdown of the rows: per sweep and variant, first call, warm median (min,
    max), TransformerLens's warm median over this variant's, and the largest difference
    of the table from TransformerLens's."""
    lines = [
        "| sweep | variant | first call | warm, median (min-max) | TransformerLens / variant, warm | "
        "max abs diff from TransformerLens (max abs value) |",
        "|---|---|---|---|---|---|",
    ]
    for sweep in TL_FUNCTIONS:
        reference = timings[sweep, "TransformerLens"]
        for variant in ("TransformerLens", "px", "px, metric of ln_f"):
            t = timings[sweep, variant]
            ratio = statistics.median(reference.warm) / statistics.median(t.warm)
            diff = float(np.max(np.abs(t.table - reference.table)))
            scale = float(np.max(np.abs(reference.table)))
            lines.append(
                f"| {sweep} | {variant} | {duration(t.first)} | {duration(statistics.median(t.warm))} "
                f"({duration(min(t.warm))} - {duration(max(t.warm))}) | {ratio:.2f} | {diff:.1e} ({scale:.1e}) |"
            )
    head = (
        "# Benchmarks: patching sweeps, px and TransformerLens\n\n"
        + ("**Smoke run (`--quick`): a tiny model, numbers are noise.**\n\n" if quick else "")
        + __doc__.split("\n\n", 1)[1].split("Usage:")[0]
        + f"This run: {sizes.layers} layers, width {sizes.width}, {sizes.heads} heads, vocabulary "
        f"{sizes.vocab}, {sizes.positions} positions, batch 1; {sizes.rounds} rounds; jax {jax.__version__}, "
        f"{versions}; {jax.devices()[0].platform.upper()}, date {time.strftime('%Y-%m-%d')}.\n\n"
    )
    return head + "\n".join(lines) + "\n"


def transformer_lens_page(quick: bool) -> str:
    """The page, or why it could not be measured."""
    if not available():
        return "# Benchmarks: patching sweeps, px and TransformerLens\n\nNot measured: `make tl-venv` first.\n"
    sizes = QUICK if quick else FULL
    timings, versions = measure(sizes)
    return page(sizes, timings, versions, quick)
