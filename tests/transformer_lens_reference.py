"""TransformerLens's numbers for a GPT-2 whose weights px holds (issue 48): the reference
that tests/test_transformer_lens.py and the benchmark compare px with.

Run by the Python of build/tl-venv (`make tl-venv`: torch and transformer-lens, Python
3.11), never by the test suite's own: it imports neither peex_interop nor JAX. The px
side (tests/transformer_lens_harness.py) writes the weights in TransformerLens's layout.

    python transformer_lens_reference.py compare REQUEST.npz RESULT.npz
    python transformer_lens_reference.py serve     # JSON lines: stdin -> stdout

`compare` reads `config` (JSON: n_layers, d_model, n_heads, d_head, d_mlp, d_vocab,
n_ctx, eps), `metric` (JSON: `{"name": "logit_diff", "correct": a, "wrong": b}`), the
token arrays `clean` and `corrupted` (batch, pos) and the weights `state/<TL state dict
key>`. It builds `HookedTransformer(HookedTransformerConfig(...))` as Hugging Face's GPT-2
computes (gelu_new, LayerNorm, learned positions, no BOS prepended), loads the weights
unprocessed (no folding, centring or refactoring), and writes `cache/<hook name>` (every
hook of `run_with_cache` on the clean tokens, batch axis kept), `logits/clean`,
`logits/corrupted`, `metric/clean`, `metric/corrupted`, and `patching/<function name>`
(each of `transformer_lens.patching`'s functions below that the release has, clean
activations patched into the corrupted run, the metric per cell), with `versions`.

`serve` answers one JSON request per line, for timings:
`{"op": "build", "n_layers": 12, "d_model": 768, "n_heads": 12, "n_ctx": 64,
"d_vocab": 50257, "batch": 1, "seed": 0}` builds a GPT-2-shaped model with random
weights and random clean/corrupted tokens of n_ctx positions (or, given `"weights"`: an
.npz of `state/`-less state dict arrays, `"clean"`, `"corrupted"`: token lists, those;
`"correct"`, `"wrong"`: the metric's tokens, 0 and 1 otherwise), answering the versions;
`{"op": "time", "fn": "get_act_patch_resid_pre", "repeats": 3}` times that patching
function (the logit difference of the two tokens at the last position as metric), each
call on its own: `{"seconds": [first, warm, ...], "shape": [...]}` (and `"table"`, the
last call's result as a list, given `"table": true`);
`{"op": "quit"}` ends. Every answer is one line of JSON (`{"error": ...}` on failure).
"""

import json
import sys
import time

import numpy as np
import torch
import transformer_lens
from transformer_lens import HookedTransformer, HookedTransformerConfig, patching

# The patching functions compared, those this release has (the first two: 2.x and up).
PATCHING = (
    "get_act_patch_resid_pre",
    "get_act_patch_attn_head_out_all_pos",
    "get_act_patch_attn_head_out_by_pos",
    "get_act_patch_mlp_out",
    "get_act_patch_attn_out",
    "get_act_patch_resid_mid",
    "get_act_patch_attn_head_pattern_all_pos",
    "get_act_patch_attn_head_q_all_pos",
    "get_act_patch_attn_head_k_all_pos",
    "get_act_patch_attn_head_v_all_pos",
)


def build(config: dict, seed: int = 0) -> HookedTransformer:
    """A HookedTransformer computing as Hugging Face's GPT-2 does."""
    torch.manual_seed(seed)
    cfg = HookedTransformerConfig(
        n_layers=config["n_layers"],
        d_model=config["d_model"],
        n_heads=config["n_heads"],
        d_head=config["d_head"],
        d_mlp=config["d_mlp"],
        d_vocab=config["d_vocab"],
        n_ctx=config["n_ctx"],
        eps=config.get("eps", 1e-5),
        act_fn="gelu_new",
        normalization_type="LN",
        positional_embedding_type="standard",
        attention_dir="causal",
        default_prepend_bos=False,
        tokenizer_name=None,
        seed=seed,
        device="cpu",
        dtype=torch.float32,
    )
    model = HookedTransformer(cfg)
    model.eval()
    return model


def load(model: HookedTransformer, weights: dict[str, np.ndarray]) -> None:
    """The weights as given, every parameter of the model among them (its buffers, the
    causal mask and IGNORE, kept), nothing folded or centred."""
    state = model.state_dict()
    unknown = set(weights) - set(state)
    missing = {k for k, v in model.named_parameters()} - set(weights)
    if unknown or missing:
        raise KeyError(f"state dict mismatch: unknown {sorted(unknown)}, missing {sorted(missing)}")
    for key, value in weights.items():
        if tuple(state[key].shape) != value.shape:
            raise ValueError(f"{key}: TransformerLens has shape {tuple(state[key].shape)}, given {value.shape}")
        state[key] = torch.from_numpy(np.ascontiguousarray(value)).to(state[key].dtype)
    model.load_state_dict(state, strict=True)


def metric_fn(spec: dict):
    """The patching metric named in the request, as a function of the logits."""
    if spec["name"] == "logit_diff":  # at the last position, averaged over the batch
        correct, wrong = int(spec["correct"]), int(spec["wrong"])
        return lambda logits: (logits[:, -1, correct] - logits[:, -1, wrong]).mean()
    raise ValueError(f"unknown metric {spec['name']!r}")


def compare(request_path: str, result_path: str) -> None:
    request = np.load(request_path)
    config = json.loads(str(request["config"]))
    metric = metric_fn(json.loads(str(request["metric"])))
    weights = {key.removeprefix("state/"): request[key] for key in request.files if key.startswith("state/")}
    clean = torch.from_numpy(request["clean"].astype(np.int64))
    corrupted = torch.from_numpy(request["corrupted"].astype(np.int64))

    model = build(config)
    load(model, weights)
    out: dict[str, np.ndarray] = {}
    with torch.no_grad():
        clean_logits, clean_cache = model.run_with_cache(clean)
        corrupted_logits = model(corrupted)
    for name, value in clean_cache.items():
        out[f"cache/{name}"] = value.numpy()
    out["logits/clean"], out["logits/corrupted"] = clean_logits.numpy(), corrupted_logits.numpy()
    out["metric/clean"] = np.asarray(metric(clean_logits).item())
    out["metric/corrupted"] = np.asarray(metric(corrupted_logits).item())
    for name in PATCHING:
        if hasattr(patching, name):
            out[f"patching/{name}"] = getattr(patching, name)(model, corrupted, clean_cache, metric).numpy()
    out["versions"] = np.asarray(f"transformer_lens {transformer_lens_version()}, torch {torch.__version__}")
    np.savez(result_path, **out)


def transformer_lens_version() -> str:
    from importlib.metadata import version

    return getattr(transformer_lens, "__version__", None) or version("transformer-lens")


def serve() -> None:
    """JSON requests on stdin, one JSON answer per line on stdout (whatever the libraries
    print goes to stderr)."""
    answers, sys.stdout = sys.stdout, sys.stderr
    model = clean = corrupted = cache = metric = None
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            request = json.loads(line)
            op = request["op"]
            if op == "quit":
                break
            if op == "build":
                n_layers, d_model, n_heads = request["n_layers"], request["d_model"], request["n_heads"]
                config = dict(
                    n_layers=n_layers, d_model=d_model, n_heads=n_heads, d_head=d_model // n_heads,
                    d_mlp=request.get("d_mlp", 4 * d_model), d_vocab=request["d_vocab"], n_ctx=request["n_ctx"],
                )
                if "threads" in request:
                    torch.set_num_threads(int(request["threads"]))
                model = build(config, seed=request.get("seed", 0))
                if "weights" in request:
                    with np.load(request["weights"]) as weights:
                        load(model, {key: weights[key] for key in weights.files})
                generator = torch.Generator().manual_seed(request.get("seed", 0))
                shape = (request.get("batch", 1), request["n_ctx"])
                clean = torch.randint(0, config["d_vocab"], shape, generator=generator)
                corrupted = torch.randint(0, config["d_vocab"], shape, generator=generator)
                if "clean" in request:
                    clean, corrupted = torch.tensor(request["clean"]), torch.tensor(request["corrupted"])
                metric = metric_fn({"name": "logit_diff", "correct": request.get("correct", 0),
                                    "wrong": request.get("wrong", 1)})
                with torch.no_grad():
                    _, cache = model.run_with_cache(clean)
                answer = {"threads": torch.get_num_threads(),
                          "versions": f"transformer_lens {transformer_lens_version()}, torch {torch.__version__}"}
            elif op == "time":
                if model is None:
                    raise RuntimeError("no model: send a build request first")
                function = getattr(patching, request["fn"])
                seconds, result = [], None
                for _ in range(request.get("repeats", 1)):
                    start = time.perf_counter()
                    with torch.no_grad():  # as TransformerLens's demos run (torch.set_grad_enabled(False))
                        result = function(model, corrupted, cache, metric)
                    seconds.append(time.perf_counter() - start)
                answer = {"seconds": seconds, "shape": list(result.shape)}
                if request.get("table"):
                    answer["table"] = result.tolist()
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as error:  # the caller decides; the server goes on
            answer = {"error": f"{type(error).__name__}: {error}"}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


if __name__ == "__main__":
    if sys.argv[1:2] == ["compare"] and len(sys.argv) == 4:
        compare(sys.argv[2], sys.argv[3])
    elif sys.argv[1:] == ["serve"]:
        serve()
    else:
        sys.exit(__doc__)
