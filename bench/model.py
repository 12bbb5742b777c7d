"""The reference model: training throughput against plain matmuls, and checkpoint time against pickle.

    python -m bench model                     # recipe-1 model, batch 16 x 64; checkpoints: recipe-1 and a 21M model
    python -m bench model -- --big            # adds a ~100M-parameter checkpoint
    python -m bench model -- --batch 32 --repeat 7

Throughput: achieved FLOP/s of the model's forward + backward (matmul FLOPs, counted from the shapes: 3x the
forward's, the usual convention) over the FLOP/s of a plain numpy float32 matmul of the FFN's shape
(batch*seq, dim) @ (dim, ffn_dim) and of a large square matmul, all timed round-robin in this run.

Checkpoints: Transformer.save_checkpoint (SNPX: CRC32C of every byte, temp file, fsync, rename, directory fsync)
and load_checkpoint (CRC-verified, copied into the model) against pickle.dump / pickle.load of the same dict of
arrays, with and without an fsync; the file is in the page cache for every load. Pickle appears here only as the
yardstick users know: nothing in SneppX ever loads one.

On CPUs where the environment sets OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE (a guard for old OpenBLAS builds that
slows a current one), this benchmark re-runs itself once with both unset and reports the kernel threadpoolctl
sees. Tests and CI never change them.
"""

from __future__ import annotations

import argparse
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np

from bench import common
from SneppX_ALG.model import data, training
from SneppX_ALG.model import transformer as model_lib

OPENBLAS_VARS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
SETTLE_S = 0.3  # before each timed candidate: the last one's BLAS threads stop spinning
RECIPE = {"vocab_size": 1000, "dim": 128, "num_heads": 4, "num_layers": 2, "ffn_dim": 512, "max_seq_len": 64}
MEDIUM = {"vocab_size": 8192, "dim": 512, "num_heads": 8, "num_layers": 4, "ffn_dim": 2048, "max_seq_len": 256}
LARGE = {"vocab_size": 32000, "dim": 1024, "num_heads": 16, "num_layers": 6, "ffn_dim": 4096, "max_seq_len": 512}

def blas_description() -> str:
    try:
        import threadpoolctl
    except ImportError:
        return "BLAS kernel unknown (threadpoolctl not installed)"
    infos = [i for i in threadpoolctl.threadpool_info() if i.get("user_api") == "blas"]
    return "; ".join(f"{i.get('internal_api')} {i.get('version')}, kernel {i.get('architecture')}, "
                     f"{i.get('num_threads')} threads" for i in infos) or "no BLAS found by threadpoolctl"


def blas_threads() -> str:
    try:
        import threadpoolctl
    except ImportError:
        return "default"
    return ",".join(str(i["num_threads"]) for i in threadpoolctl.threadpool_info() if i.get("user_api") == "blas")


def train_flops(config: model_lib.ModelConfig, batch: int, seq: int) -> int:
    """Matmul FLOPs of one forward + backward: 3x the forward (each matmul has two in the backward pass)."""
    n, d, f = batch * seq, config.dim, config.ffn_dim
    per_layer = 2 * n * (d * 3 * d + d * d + 2 * d * f) + 2 * 2 * batch * config.num_heads * seq * seq * config.head_dim
    forward = config.num_layers * per_layer + 2 * n * d * config.vocab_size
    return 3 * forward


def fastest(candidates: dict[str, Callable[[], object]], repeat: int) -> dict[str, float]:
    """Seconds per call, fastest of `repeat` round-robin rounds (load elsewhere hits every candidate alike).

    In each round a candidate starts after a pause, runs once untimed, then timed: each is measured as it runs
    in a loop of its own (a training loop), not in the wake of the one before. OpenBLAS's worker threads spin
    on a core for a while after a multi-threaded call; a model step right after the 2048^3 matmul used to
    share its cores with that spin (measured 32-35 ms instead of 20 ms for the recipe-1 step, two threads)."""
    for _ in range(2):
        for fn in candidates.values():
            fn()  # warm-up: allocations, BLAS threads, page faults
    best = {name: float("inf") for name in candidates}
    for _ in range(repeat):
        for name, fn in candidates.items():
            time.sleep(SETTLE_S)
            fn()
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def model_matmul_operands(config: model_lib.ModelConfig, batch: int, seq: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Random operands for every matmul one forward + backward of the model runs, with the same shapes and
    the same transposed views (so BLAS sees the same calls), and nothing else."""
    rng = np.random.default_rng(0)
    n, d, f, v, h, hd = batch * seq, config.dim, config.ffn_dim, config.vocab_size, config.num_heads, config.head_dim

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32)

    pairs = []
    linears = [(d, 3 * d), (d, d), (d, f), (f, d)] * config.num_layers + [(d, v)]
    for fan_in, fan_out in linears:
        x, w, dy = rand(n, fan_in), rand(fan_in, fan_out), rand(n, fan_out)
        pairs += [(x, w), (x.T, dy), (dy, w.T)]  # forward, weight gradient, input gradient
    for _ in range(config.num_layers):
        q, k, probs, dout = rand(batch, h, seq, hd), rand(batch, h, seq, hd), rand(batch, h, seq, seq), rand(
            batch, h, seq, hd)
        kt = k.transpose(0, 1, 3, 2)
        pt = probs.transpose(0, 1, 3, 2)
        pairs += [(q, kt), (probs, q), (pt, dout), (dout, kt), (probs, k), (pt, q)]
    return pairs


def bench_throughput(batch: int, repeat: int, threads: int | None) -> None:
    """One table; threads=None leaves BLAS at its default (all cores), else limits it (needs threadpoolctl)."""
    if threads is not None:
        import threadpoolctl

        with threadpoolctl.threadpool_limits(threads, user_api="blas"):
            return bench_throughput(batch, repeat, None)
    model = model_lib.Transformer(**RECIPE)
    config = model.config
    seq = config.max_seq_len
    flops = train_flops(config, batch, seq)
    language = data.SyntheticLanguage(vocab_size=config.vocab_size, seq_len=seq, num_sequences=max(256, batch))
    trainer = training.Trainer(model, language, batch_size=batch)
    tokens = language.generate()[:batch]
    rng = np.random.default_rng(0)
    ffn_a = rng.standard_normal((batch * seq, config.dim), dtype=np.float32)
    ffn_b = rng.standard_normal((config.dim, config.ffn_dim), dtype=np.float32)
    square = rng.standard_normal((2048, 2048), dtype=np.float32)
    operands = model_matmul_operands(config, batch, seq)
    assert sum(2 * a.size // a.shape[-1] * a.shape[-1] * b.shape[-1] for a, b in operands) == flops
    # Repeat the small matmul so one sample is as long as a model step: timer and call overhead don't count.
    ffn_matmul_flops = 2 * batch * seq * config.dim * config.ffn_dim
    inner = max(1, flops // ffn_matmul_flops)

    def ffn_matmuls() -> None:
        for _ in range(inner):
            np.matmul(ffn_a, ffn_b)

    def model_matmuls() -> None:
        for a, b in operands:
            np.matmul(a, b)

    seconds = fastest({
        "fwd+bwd": lambda: model.loss_and_grads(tokens),
        "train step": trainer.train_step,
        "model matmuls": model_matmuls,
        "ffn matmul": ffn_matmuls,
        "square matmul": lambda: np.matmul(square, square),
    }, repeat)
    model_rate = flops / seconds["fwd+bwd"]
    rates = {
        f"numpy matmul ({batch * seq}x{config.dim}) @ ({config.dim}x{config.ffn_dim}), the FFN's shape":
            (seconds["ffn matmul"] / inner, inner * ffn_matmul_flops / seconds["ffn matmul"]),
        "the model's own matmuls alone (same shapes and views, nothing else)":
            (seconds["model matmuls"], flops / seconds["model matmuls"]),
        "numpy matmul 2048^3": (seconds["square matmul"], 2 * 2048 ** 3 / seconds["square matmul"]),
    }
    print(f"\n### Training throughput: recipe-1 model ({model.num_params:,} parameters), batch {batch} x {seq} "
          f"tokens, float32, {blas_threads()} BLAS thread(s)\n")
    print("| what | time | GFLOP/s | model's FLOP/s over this |")
    print("|---|---:|---:|---:|")
    print(f"| model forward + backward ({flops / 1e9:.2f} GFLOP of matmuls) "
          f"| {seconds['fwd+bwd'] * 1e3:.1f} ms | {model_rate / 1e9:.1f} | 1.00x |")
    for what, (time_s, rate) in rates.items():
        print(f"| {what} | {time_s * 1e3:.2f} ms | {rate / 1e9:.1f} | {model_rate / rate:.2f}x |")
    ffn_rate = next(iter(rates.values()))[1]
    print(f"\nFull train step (+ clipping, AdamW): {seconds['train step'] * 1e3:.1f} ms = "
          f"{batch * seq / seconds['train step']:,.0f} tokens/s. Model FLOP/s vs a plain matmul of the FFN's "
          f"shape: **{model_rate / ffn_rate:.2f}x** (target >= 0.5x).", flush=True)

def bench_checkpoint(name: str, sizes: dict[str, int], directory: str, repeat: int) -> None:
    model = model_lib.Transformer(**sizes, seed=1)
    target = model_lib.Transformer(**sizes, seed=2)
    arrays = {k: v for k, v in model.state_dict().items()}
    nbytes = sum(v.nbytes for v in arrays.values())
    snpx_path = os.path.join(directory, f"{name}.snpx")
    pickle_path = os.path.join(directory, f"{name}.pkl")

    def pickle_dump(sync: bool) -> None:
        with open(pickle_path, "wb") as f:
            pickle.dump({"param_data": arrays, "config": model.config.to_json()}, f, protocol=pickle.HIGHEST_PROTOCOL)
            if sync:
                f.flush()
                os.fsync(f.fileno())

    def pickle_dump_atomic() -> None:
        tmp = pickle_path + ".tmp"
        with open(tmp, "wb") as f:
            pickle.dump({"param_data": arrays, "config": model.config.to_json()}, f, protocol=pickle.HIGHEST_PROTOCOL)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, pickle_path)
        common.fsync_path(directory)

    def pickle_load() -> None:
        with open(pickle_path, "rb") as f:
            pickle.load(f)  # the benchmark's own file, just written: the yardstick, never a load path of ours

    saves = fastest({
        "save_checkpoint": lambda: model.save_checkpoint(snpx_path),
        "pickle.dump, atomic like SneppX (temp, fsync, rename, dir fsync)": pickle_dump_atomic,
        "pickle.dump + fsync": lambda: pickle_dump(True),
        "pickle.dump, no fsync": lambda: pickle_dump(False),
    }, repeat)
    loads = fastest({
        "load_checkpoint": lambda: target.load_checkpoint(snpx_path),
        "pickle.load": pickle_load,
    }, repeat)
    assert all(np.array_equal(model.params[k], target.params[k]) for k in model.params)
    mib = nbytes / 2 ** 20
    print(f"\n### Checkpoint save/load: {name} model ({model.num_params:,} parameters, {mib:.1f} MiB)\n")
    print("| operation | time | MiB/s | SneppX speed-up (its time / SneppX time) |")
    print("|---|---:|---:|---:|")
    for label, table, ours in (("save", saves, "save_checkpoint"), ("load", loads, "load_checkpoint")):
        for what, seconds in table.items():
            ratio = seconds / table[ours]
            print(f"| {label}: {what} | {seconds * 1e3:.2f} ms | {mib / seconds:,.0f} | {ratio:.2f}x |")
    print(flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench model", description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16, help="sequences per step (default 16)")
    parser.add_argument("--repeat", type=int, default=7, help="round-robin rounds; the fastest of each counts")
    parser.add_argument("--big", action="store_true", help="also a ~100M-parameter checkpoint")
    parser.add_argument("--threads", type=int, nargs="+", default=[0, 1],
                        help="BLAS thread counts for the throughput tables; 0 = the default (all cores)")
    parser.add_argument("--dir", default=None, help="where checkpoint files go (default: a temporary directory)")
    parser.add_argument("--keep-openblas-env", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if not args.keep_openblas_env and any(v in os.environ for v in OPENBLAS_VARS):
        # OpenBLAS reads these when numpy loads it, so only a new process can run without them.
        was = ", ".join(f"{v}={os.environ[v]}" for v in OPENBLAS_VARS if v in os.environ)
        print(f"(re-running with {' and '.join(OPENBLAS_VARS)} unset for this benchmark only; they were {was})",
              flush=True)
        env = {k: v for k, v in os.environ.items() if k not in OPENBLAS_VARS}
        child = [sys.executable, "-m", "bench", "model", "--", *(argv if argv is not None else sys.argv[1:]),
                 "--keep-openblas-env"]
        raise SystemExit(subprocess.run(child, env=env, check=False).returncode)

    env_note = ", ".join(f"{v}={os.environ[v]}" for v in OPENBLAS_VARS if v in os.environ) or "not set"
    print(f"CPU: {common.cpu_model()}, {os.cpu_count()} logical CPUs; numpy {np.__version__}; {blas_description()}; "
          f"OPENBLAS_CORETYPE/L2_SIZE: {env_note}; fastest of {args.repeat} rounds")
    for threads in args.threads:
        bench_throughput(args.batch, args.repeat, None if threads == 0 else threads)
    directory = args.dir or tempfile.mkdtemp(prefix="sneppx-bench-model-")
    os.makedirs(directory, exist_ok=True)
    try:
        models = [("recipe-1", RECIPE), ("medium", MEDIUM)] + ([("large", LARGE)] if args.big else [])
        for name, sizes in models:
            bench_checkpoint(name, sizes, directory, args.repeat)
    finally:
        if args.dir is None:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
