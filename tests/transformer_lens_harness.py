"""The px side of the TransformerLens reference (issue 48): Hugging Face's Flax GPT-2
weights in TransformerLens's layout, the reference script run in build/tl-venv's Python
(tests/transformer_lens_reference.py, a subprocess: torch and transformer-lens live in a
Python 3.11 venv of their own, `make tl-venv`), and a tiny case to compare with.

(Not named `transformer_lens.py`: the tests folder is on `sys.path`, where such a module
would hide the real package.)

Reuse: `tiny_gpt2_case()` (the session fixture `tl_gpt2` in tests/conftest.py) gives a
`GPT2Case`: the px model, clean and corrupted inputs, the metric as a function of the
model's output, TransformerLens's results (`case.tl["patching/get_act_patch_resid_pre"]`,
`case.tl["cache/blocks.0.attn.hook_pattern"]`, ...); `PATCH_SITES` says where each of
TransformerLens's patching functions patches, in px's terms. `ReferenceServer` times TransformerLens's patching
in a persistent process, for a benchmark that interleaves rounds with px.
"""

import contextlib
import json
import os
import subprocess
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import peex_interop as px

ROOT = Path(__file__).resolve().parent.parent
TL_VENV = ROOT / "build" / "tl-venv"
TL_PYTHON = TL_VENV / "bin" / "python"
REFERENCE = Path(__file__).with_name("transformer_lens_reference.py")
SKIP_REASON = (
    "the TransformerLens comparisons need build/tl-venv (torch and transformer-lens in a "
    "Python 3.11 venv of their own): run `make tl-venv` to enable them"
)


def available() -> bool:
    """Whether `make tl-venv` completed (its stamp is written last)."""
    return (TL_VENV / ".installed").exists() and TL_PYTHON.exists()


def skip_unless_available() -> None:
    import pytest

    if not available():
        pytest.skip(SKIP_REASON)


def _env() -> dict[str, str]:
    # No progress bars (TransformerLens's patching shows tqdm's); nothing of this
    # Python's path in the 3.11 venv's.
    return {**os.environ, "TQDM_DISABLE": "1", "PYTHONPATH": ""}


# --- weights ---------------------------------------------------------------------------


def gpt2_to_transformer_lens(params: Any, n_heads: int) -> dict[str, np.ndarray]:
    """Hugging Face's Flax GPT-2 params (`hf.params`, the "params" collection) as a
    TransformerLens state dict, nothing folded. HF's `FlaxConv1D` stores its kernel
    (out, in) and applies `x @ kernel.T + bias`; `c_attn`'s output is [q | k | v], each
    (head, d_head) in head-major order; `c_proj`'s input is the heads merged the same
    way; the LM head is the token embedding transposed, without a bias."""
    p = jax.tree.map(np.asarray, params)["transformer"]
    d_model = p["wte"]["embedding"].shape[1]
    d_head = d_model // n_heads
    state = {
        "embed.W_E": p["wte"]["embedding"],
        "pos_embed.W_pos": p["wpe"]["embedding"],
        "ln_final.w": p["ln_f"]["scale"],
        "ln_final.b": p["ln_f"]["bias"],
        "unembed.W_U": p["wte"]["embedding"].T,
        "unembed.b_U": np.zeros(p["wte"]["embedding"].shape[0], np.float32),
    }
    for i, block in ((int(k), v) for k, v in p["h"].items()):
        attn, mlp = block["attn"], block["mlp"]
        w_qkv = attn["c_attn"]["kernel"].T  # (d_model, 3 d_model)
        b_qkv = attn["c_attn"]["bias"]
        for j, name in enumerate("QKV"):
            w = w_qkv[:, j * d_model : (j + 1) * d_model]  # (d_model, heads * d_head)
            state[f"blocks.{i}.attn.W_{name}"] = w.reshape(d_model, n_heads, d_head).transpose(1, 0, 2)
            state[f"blocks.{i}.attn.b_{name}"] = b_qkv[j * d_model : (j + 1) * d_model].reshape(n_heads, d_head)
        state[f"blocks.{i}.attn.W_O"] = attn["c_proj"]["kernel"].T.reshape(n_heads, d_head, d_model)
        state[f"blocks.{i}.attn.b_O"] = attn["c_proj"]["bias"]
        state[f"blocks.{i}.mlp.W_in"] = mlp["c_fc"]["kernel"].T
        state[f"blocks.{i}.mlp.b_in"] = mlp["c_fc"]["bias"]
        state[f"blocks.{i}.mlp.W_out"] = mlp["c_proj"]["kernel"].T
        state[f"blocks.{i}.mlp.b_out"] = mlp["c_proj"]["bias"]
        for hf_name, tl_name in (("ln_1", "ln1"), ("ln_2", "ln2")):
            state[f"blocks.{i}.{tl_name}.w"] = block[hf_name]["scale"]
            state[f"blocks.{i}.{tl_name}.b"] = block[hf_name]["bias"]
    return {k: np.ascontiguousarray(v, np.float32) for k, v in state.items()}


def tl_config(config: Any) -> dict[str, Any]:
    """A `GPT2Config`'s sizes as the reference script reads them."""
    d_model, n_heads = config.n_embd, config.n_head
    return dict(
        n_layers=config.n_layer, d_model=d_model, n_heads=n_heads, d_head=d_model // n_heads,
        d_mlp=config.n_inner or 4 * d_model, d_vocab=config.vocab_size, n_ctx=config.n_positions,
        eps=config.layer_norm_epsilon,
    )


# --- the reference, run -----------------------------------------------------------------


class Reference:
    """The reference script running on a request (`start_reference`): `result()` waits
    for it and returns TransformerLens's cache, logits, metrics and patching results
    (keys as the script's docstring lists). The process runs while the caller goes on
    (px's side of a comparison, compiled meanwhile)."""

    def __init__(self, request: dict[str, np.ndarray]):
        self.folder = tempfile.TemporaryDirectory(prefix="px_tl_")
        request_path, self.result_path = Path(self.folder.name, "request.npz"), Path(self.folder.name, "result.npz")
        np.savez(request_path, **request)
        self.process = subprocess.Popen(
            [str(TL_PYTHON), str(REFERENCE), "compare", str(request_path), str(self.result_path)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
        )
        self._result: dict[str, np.ndarray] | None = None

    def result(self) -> dict[str, np.ndarray]:
        if self._result is None:
            try:
                _, stderr = self.process.communicate(timeout=600)
            except subprocess.TimeoutExpired:
                self.process.kill()
                raise
            if self.process.returncode != 0:
                raise RuntimeError(f"the TransformerLens reference failed:\n{stderr[-4000:]}")
            with np.load(self.result_path) as data:
                self._result = {k: data[k] for k in data.files}
            self.folder.cleanup()
        return self._result


def start_reference(
    config: dict[str, Any], weights: dict[str, np.ndarray], clean: Any, corrupted: Any, metric: dict[str, Any]
) -> Reference:
    """Start TransformerLens on `weights` (`gpt2_to_transformer_lens`), the sizes of
    `config` (`tl_config`), clean and corrupted tokens (batch, position) and a metric
    (`{"name": "logit_diff", "correct": a, "wrong": b}`)."""
    return Reference({
        "config": np.asarray(json.dumps(config)), "metric": np.asarray(json.dumps(metric)),
        "clean": np.asarray(clean), "corrupted": np.asarray(corrupted),
        **{f"state/{k}": v for k, v in weights.items()},
    })


class ReferenceServer:
    """TransformerLens in a persistent process (the reference's `serve` mode), for
    timings interleaved with px's: `with ReferenceServer() as tl: tl.build(...);
    tl.time("get_act_patch_resid_pre", repeats=3)`."""

    def __init__(self):
        self.process = subprocess.Popen(
            [str(TL_PYTHON), str(REFERENCE), "serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True, env=_env(),
        )

    def request(self, **request: Any) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError("the TransformerLens server ended")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"TransformerLens server: {answer['error']}")
        return answer

    def build(self, **sizes: Any) -> dict[str, Any]:
        """n_layers, d_model, n_heads, n_ctx, d_vocab (batch, seed, threads, d_mlp)."""
        return self.request(op="build", **sizes)

    def time(self, fn: str, repeats: int = 1) -> list[float]:
        """Seconds of each call of `transformer_lens.patching.<fn>` (the first cold)."""
        return self.request(op="time", fn=fn, repeats=repeats)["seconds"]

    def close(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(RuntimeError, BrokenPipeError, ValueError):
                self.request(op="quit")
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()

    def __enter__(self) -> "ReferenceServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# --- a tiny GPT-2, both sides -----------------------------------------------------------


def random_gpt2_params(params: Any, seed: int = 0) -> Any:
    """HF's params re-drawn so that nothing is trivial (HF starts biases at 0 and
    LayerNorms at 1, with 0.02-scale kernels): kernels at 0.2, biases at 0.1, LayerNorm
    scales around 1, embeddings at 1. numpy draws, independent of JAX's PRNG settings."""
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        name = jax.tree_util.keystr(path)
        shape = np.shape(leaf)
        if "scale" in name:
            value = 1.0 + 0.1 * rng.standard_normal(shape)
        elif "embedding" in name:
            value = rng.standard_normal(shape)
        elif "bias" in name:
            value = 0.1 * rng.standard_normal(shape)
        else:
            value = 0.2 * rng.standard_normal(shape)
        return jnp.asarray(value, jnp.float32)

    return jax.tree_util.tree_map_with_path(draw, params)


@dataclass
class GPT2Case:
    """A tiny Hugging Face Flax GPT-2 through `px.from_linen` (with `jax.nn.gelu` a
    function site: HF's `gelu_new` is its partial), and TransformerLens's results on the
    same weights. `model(*case.inputs(tokens))` runs it; `case.metric(output)` is the
    request's metric (the logit difference of `correct` and `wrong` at the last
    position, averaged over the batch)."""

    hf: Any
    model: Any
    config: Any
    clean: jax.Array
    corrupted: jax.Array
    correct: int
    wrong: int
    reference: Reference = field(repr=False)

    @property
    def tl(self) -> dict[str, np.ndarray]:
        """TransformerLens's results (waits for the reference on first use)."""
        return self.reference.result()

    @property
    def n_layers(self) -> int:
        return self.config.n_layer

    @property
    def n_heads(self) -> int:
        return self.config.n_head

    @property
    def d_head(self) -> int:
        return self.config.n_embd // self.config.n_head

    @staticmethod
    def inputs(tokens: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """HF GPT-2's arguments: ids, attention mask, positions."""
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        return tokens, jnp.ones_like(tokens), positions

    def metric(self, output: Any) -> jax.Array:
        return self.metric_of_logits(output.logits)

    def metric_of_logits(self, logits: jax.Array) -> jax.Array:
        return jnp.mean(logits[:, -1, self.correct] - logits[:, -1, self.wrong])

    def block(self, i: int) -> str:
        return f"transformer.h.{i}"


def tiny_gpt2_case(
    layers: int = 2, width: int = 32, heads: int = 4, vocab: int = 64, positions: int = 8, seed: int = 0
) -> GPT2Case:
    """The case, TransformerLens's side computed once (one subprocess, started here and
    running while px's side is computed: `case.tl` waits for it). Clean and
    corrupted tokens: a batch of 2 sequences of `positions - 1` tokens differing at
    two positions."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        from transformers import FlaxGPT2LMHeadModel, GPT2Config

    config = GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=width, n_layer=layers, n_head=heads)
    hf = FlaxGPT2LMHeadModel(config, seed=seed)
    params = random_gpt2_params(hf.params, seed)
    hf.params = params
    model = px.function_sites(px.from_linen(hf.module, {"params": params}), jax.nn.gelu)
    rng = np.random.default_rng(seed + 1)
    clean = rng.integers(0, vocab, (2, positions - 1))
    corrupted = clean.copy()
    corrupted[:, [1, 3]] = (clean[:, [1, 3]] + rng.integers(1, vocab, (2, 2))) % vocab
    correct, wrong = 1, 2
    reference = start_reference(
        tl_config(config), gpt2_to_transformer_lens(params, heads), clean, corrupted,
        {"name": "logit_diff", "correct": correct, "wrong": wrong},
    )
    return GPT2Case(hf, model, config, jnp.asarray(clean), jnp.asarray(corrupted), correct, wrong, reference)


# --- px's patching, one cell at a time ----------------------------------------------------

# TransformerLens's patching function -> (the px site patched in block {}, whether its
# inputs are patched, whether cells are positions, whether they are heads). What each
# patches, in HF GPT-2's layout (batch, position, features):
# - resid_pre: the block's input (`hook_resid_pre`), one position;
# - attn_head_out: the heads' outputs before the output projection (`hook_z`), which HF
#   merges (head-major) into `c_proj`'s input: head h is features h*d_head:(h+1)*d_head;
# - mlp_out, attn_out: the MLP's and the attention's outputs (the attention's a 1-tuple).
PATCH_SITES = {
    "get_act_patch_resid_pre": ("transformer.h.{}", True, True, False),
    "get_act_patch_attn_head_out_all_pos": ("transformer.h.{}.attn.c_proj", True, False, True),
    "get_act_patch_attn_head_out_by_pos": ("transformer.h.{}.attn.c_proj", True, True, True),
    "get_act_patch_mlp_out": ("transformer.h.{}.mlp", False, True, False),
    "get_act_patch_attn_out": ("transformer.h.{}.attn", False, True, False),
}


def clean_cache(case: "GPT2Case") -> dict[str, Any]:
    """The clean run's cache of every site `PATCH_SITES` names, inputs included."""
    where = sorted({site.format(i) for site, *_ in PATCH_SITES.values() for i in range(case.n_layers)})
    return px.cache(case.model, *case.inputs(case.clean), where=where, inputs=True)[1]
