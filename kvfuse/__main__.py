"""``python -m kvfuse``: explain | demo | info | bench | generate.

- ``explain``: which cache mode each layer gets for a dtype request, and which rule decided;
- ``demo``: the random-weight demo model with a mixed per-layer cache, its logit error against
  an all-model-dtype cache, and the same model compiled with kvfuse's backend;
- ``info``: versions, the CUDA device, and which kernel backend runs each op family and mode;
- ``bench NAME [args...]``: runs ``python -m benchmarks.NAME`` in the source checkout;
- ``generate``: a transformers model (local directory or tiny random config) generating on
  kvfuse caches, see :mod:`kvfuse.cli_generate`.

The only module of kvfuse that prints. Heavy imports (the model, torch.compile, Triton)
happen inside the command that needs them, so ``--help`` and ``explain`` start fast.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

from .kv_cache import KVCacheConfig, describe_unmatched_skip_rules, parse_model_dtype

LAYER_NAME_FORMAT = "model.layers.{}.self_attn.attn"


class CLIError(Exception):
    """A user error: printed as one line, exit status 2."""


# ----------------------------------------------------------------------------- helpers


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _int_list(text: str, flag: str) -> tuple:
    if text is None or not text.strip():
        return ()
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise CLIError(f"{flag}={text!r} must be a comma-separated list of integers") from None


def _skip_rules(text: Optional[str]) -> tuple:
    if text is None or not text.strip():
        return ()
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _model_dtype(name: str) -> torch.dtype:
    # "auto" and quantized names make no sense for a model's own dtype: only native names are offered.
    return parse_model_dtype(name, "--model-dtype")


def _positive(args, *flags: str) -> None:
    for flag in flags:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is None or value <= 0:
            raise CLIError(f"{flag}={value} must be a positive integer")


def _device(text: Optional[str]) -> torch.device:
    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise CLIError(f"--device={text!r} is not a device kvfuse runs on; allowed: 'cpu', 'cuda' or 'cuda:N'")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CLIError(f"--device {text} was requested but torch sees no CUDA device "
                       f"(torch {torch.__version__}, built with CUDA {torch.version.cuda or 'none'})")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise CLIError(f"--device {text}: torch sees {torch.cuda.device_count()} CUDA device(s)")
    return device


@contextlib.contextmanager
def _status(text: str):
    """A one-line status on stderr during long first-use work; silent unless stderr is a terminal.

    The line is erased when the work ends, so it never mixes with the command's output.
    """
    stream = sys.stderr
    live = bool(getattr(stream, "isatty", lambda: False)())
    if live:
        stream.write(f"{text}...")
        stream.flush()
    try:
        yield
    finally:
        if live:
            stream.write("\r\033[K")
            stream.flush()


def _skip_rule_warning(config: KVCacheConfig, specs) -> Optional[str]:
    """The warning line for skip rules that match no layer (raises with --strict-skip-layers)."""
    unmatched = config.unmatched_skip_rules(specs)
    if not unmatched:
        return None
    message = describe_unmatched_skip_rules(unmatched, specs)
    if config.strict_skip_layers:
        raise CLIError(message)
    return f"warning: {message} (--strict-skip-layers makes this an error)"


def _side_request(config: KVCacheConfig) -> str:
    """`` k_cache_dtype=... v_cache_dtype=...`` for the per-side requests that were given."""
    return "".join(f" {name}={getattr(config, name)!r}" for name in ("k_cache_dtype", "v_cache_dtype")
                   if getattr(config, name) is not None)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _spec_rows(specs) -> list:
    return [
        (
            i,
            spec.layer_name,
            spec.sliding_window if spec.sliding_window is not None else "-",
            spec.kv_format.name,
            _dtype_name(spec.kv_cache_torch_dtype),
            spec.bytes_per_token,
            spec.reason,
        )
        for i, spec in enumerate(specs)
    ]


_SPEC_HEADERS = ("layer", "name", "window", "mode", "storage", "bytes/token", "why")


def _totals_line(specs) -> str:
    total = sum(s.bytes_per_token for s in specs)
    baseline = sum(2 * s.num_kv_heads * s.head_size * s.model_dtype.itemsize for s in specs)
    model_dtype = _dtype_name(specs[0].model_dtype)
    return (f"cache: {total} bytes/token over {len(specs)} layers, {100 * total / baseline:.1f}% of an "
            f"all-{model_dtype} cache ({baseline} bytes/token)")


def _config_from_args(args) -> KVCacheConfig:
    return KVCacheConfig(
        kv_cache_dtype=args.kv_cache_dtype,
        skip_layers=_skip_rules(args.skip_layers),
        checkpoint_kv_cache_dtype=args.checkpoint_kv_cache_dtype,
        strict_skip_layers=args.strict_skip_layers,
        k_cache_dtype=args.k_cache_dtype,
        v_cache_dtype=args.v_cache_dtype,
    )


def _add_cache_flags(p: argparse.ArgumentParser, *, dtype_default: str, skip_default: Optional[str]) -> None:
    p.add_argument("--kv-cache-dtype", "--dtype", default=dtype_default,
                   help="KV-cache dtype request: auto, bfloat16, float16, half, float32, float, fp8, fp8_e4m3, "
                        f"fp8_inc, fp8_e5m2, nvfp4 (default: {dtype_default})")
    for side in ("k", "v"):
        p.add_argument(f"--{side}-cache-dtype", default=None,
                       help=f"the {side.upper()} side's dtype where it differs from --kv-cache-dtype (any of its "
                            f"names; e.g. --k-cache-dtype fp8 --v-cache-dtype nvfp4)")
    p.add_argument("--skip-layers", default=skip_default,
                   help="comma-separated skip rules kept in the model dtype: layer indices, 'sliding_window', or "
                        f"full layer names (default: {skip_default or 'none'})")
    p.add_argument("--checkpoint-kv-cache-dtype", default=None,
                   help="the KV-cache dtype a quantized checkpoint declares (default: none)")
    p.add_argument("--strict-skip-layers", action="store_true",
                   help="fail (instead of warning) when a skip rule matches no layer")
    p.add_argument("--model-dtype", default="bfloat16",
                   help="model dtype: bfloat16, float16, half, float32 or float (default: bfloat16)")


# ----------------------------------------------------------------------------- explain


def cmd_explain(args) -> int:
    _positive(args, "--layers", "--kv-heads", "--head-size", "--sliding-window")
    config = _config_from_args(args)
    if args.tp_size < 1:
        raise CLIError(f"--tp-size={args.tp_size} must be >= 1")
    if args.tp_rank is not None and not 0 <= args.tp_rank < args.tp_size:
        raise CLIError(f"--tp-rank={args.tp_rank} must be in 0..{args.tp_size - 1} (--tp-size={args.tp_size})")
    config = dataclasses.replace(config, tp_size=args.tp_size, tp_rank=args.tp_rank or 0)
    model_dtype = _model_dtype(args.model_dtype)
    windowed = set(_int_list(args.sliding_window_layers, "--sliding-window-layers"))
    out_of_range = sorted(i for i in windowed if not 0 <= i < args.layers)
    if out_of_range:
        raise CLIError(f"--sliding-window-layers holds {out_of_range}, outside 0..{args.layers - 1}")
    specs = [
        config.layer_spec(args.layer_name_format.format(i), num_kv_heads=args.kv_heads, head_size=args.head_size,
                          model_dtype=model_dtype, sliding_window=args.sliding_window if i in windowed else None,
                          layer_index=i)
        for i in range(args.layers)
    ]
    warning = _skip_rule_warning(config, specs)
    print(f"kv_cache_dtype={config.kv_cache_dtype!r}{_side_request(config)} skip_layers={list(config.skip_layers)} "
          f"checkpoint_kv_cache_dtype={config.checkpoint_kv_cache_dtype!r}")
    print(f"model dtype {_dtype_name(model_dtype)}, {args.kv_heads} KV heads x head size {args.head_size}; "
          f"sliding-window layers: {', '.join(map(str, sorted(windowed))) or 'none'}")
    if config.tp_size > 1:
        print(_tp_lines(config, args.kv_heads))
    print()
    print(_table(_SPEC_HEADERS, _spec_rows(specs)))
    print()
    print(_totals_line(specs))
    if warning:
        print(warning)
    if config.tp_size > 1:
        per_rank = sum(s.bytes_per_token for s in specs)
        replicated = (" (replicated heads counted on every rank that stores them)"
                      if config.tp_size > args.kv_heads else "")
        print(f"tensor parallel: {per_rank} bytes/token on each of {config.tp_size} ranks, "
              f"{per_rank * config.tp_size} bytes/token over all ranks{replicated}")
    return 0


def _heads_text(heads: range) -> str:
    return str(heads.start) if len(heads) == 1 else f"{heads.start}-{heads.stop - 1}"


def _tp_lines(config: KVCacheConfig, num_kv_heads: int) -> str:
    from .distributed import kv_head_shard

    # Every layer splits the same way (one KV-head count), so one line per rank says it all.
    shards = [kv_head_shard(num_kv_heads, config.tp_size, r) for r in range(config.tp_size)]
    replicas = max(1, config.tp_size // num_kv_heads)
    how = (f"each KV head replicated on {replicas} ranks" if replicas > 1
           else f"{len(shards[0])} KV heads per rank")
    ranks = ", ".join(f"rank {r}: {_heads_text(h)}" for r, h in enumerate(shards))
    return (f"tensor parallel: tp_size {config.tp_size}, {how} ({ranks}); the table is rank {config.tp_rank}'s "
            f"(KV heads {_heads_text(shards[config.tp_rank])} of {num_kv_heads}), bytes per rank")


# ----------------------------------------------------------------------------- demo


def cmd_demo(args) -> int:
    from .models.demo import compare_logits, make_batch, run_steps
    from .models.llama import LlamaConfig, LlamaForCausalLM

    model_dtype = _model_dtype(args.model_dtype)
    _positive(args, "--layers", "--hidden", "--heads", "--kv-heads", "--head-size", "--vocab", "--block-size",
              "--sliding-window")
    if args.steps < 0:
        raise CLIError(f"--steps={args.steps} must be >= 0")
    if args.sliding_window_layers is None:
        windowed = (args.layers // 2,)
    else:
        windowed = _int_list(args.sliding_window_layers, "--sliding-window-layers")
    prompt_lens = _int_list(args.prompt_lens, "--prompt-lens")
    if not prompt_lens or min(prompt_lens) <= 0:
        raise CLIError(f"--prompt-lens={args.prompt_lens!r} must list positive lengths")
    device = _device(args.device)
    dump = None
    if args.dump is not None:
        try:
            from . import debug as dump
        except ImportError as e:
            raise CLIError(f"--dump needs kvfuse.debug, which cannot be imported: {e}") from None

    config = _config_from_args(args)
    model_config = LlamaConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_heads=args.heads, num_kv_heads=args.kv_heads,
        head_size=args.head_size, intermediate_size=2 * args.hidden, vocab_size=args.vocab,
        sliding_window=args.sliding_window, sliding_window_layers=windowed, dtype=model_dtype, seed=args.seed,
    )
    baseline_config = KVCacheConfig(kv_cache_dtype="auto")
    specs = model_config.layer_specs(config)  # fails here, before any work, on a bad request
    warning = _skip_rule_warning(config, specs)
    batch = make_batch(model_config.vocab_size, prompt_lens, args.steps, seed=args.seed)
    pad_to = -(-max(sum(prompt_lens), len(prompt_lens)) // 8) * 8

    print(f"kvfuse demo: {args.layers} layers, hidden {args.hidden}, heads {args.heads}/{args.kv_heads} "
          f"(q/kv), head size {args.head_size}, vocab {args.vocab}, model dtype {_dtype_name(model_dtype)}, "
          f"device {device}, seed {args.seed}")
    print(f"cache request: kv_cache_dtype={config.kv_cache_dtype!r} skip_layers={list(config.skip_layers)} "
          f"checkpoint_kv_cache_dtype={config.checkpoint_kv_cache_dtype!r}")
    print()
    print(_table(_SPEC_HEADERS, _spec_rows(specs)))
    print()
    print(_totals_line(specs))
    if warning:
        print(warning)
    print()

    model = LlamaForCausalLM(model_config, config, device=device)
    baseline = LlamaForCausalLM(model_config, baseline_config, device=device)
    with _status("running the model eagerly (the first call may build kvfuse's native kernels, ~20 s)"):
        logits, _ = run_steps(model, batch, block_size=args.block_size, pad_to=pad_to)
        reference, _ = run_steps(baseline, batch, block_size=args.block_size, pad_to=pad_to)
    steps_text = (f"prefill of {len(prompt_lens)} sequences (lengths {', '.join(map(str, prompt_lens))}) + "
                  f"{args.steps} decode steps, every step padded to {pad_to} tokens (slot -1)")
    print(f"eager: {steps_text}")
    print(f"logits vs an all-{_dtype_name(model_dtype)} cache: {compare_logits(logits, reference)}")

    if args.no_compile:
        return 0
    from . import make_backend

    print()
    be = make_backend()
    compiled = torch.compile(model, backend=be)
    context = dump.dump(args.dump) if dump is not None else contextlib.nullcontext()
    with context, _status("compiling the model with torch.compile(backend=kvfuse) (first run: ~20 s on CPU)"):
        compiled_logits, _ = run_steps(model, batch, block_size=args.block_size, pad_to=pad_to, forward=compiled)
    print("compiled: torch.compile(model, backend=kvfuse.make_backend())")
    if be.report:
        rows = [(r.layer_name, getattr(r.kv_quant_mode, "name", r.kv_quant_mode), "yes" if r.fused else "no", r.reason)
                for r in be.report]
        print(_table(("layer", "mode", "fused", "reason"), rows))
    for note in be.notes or ([] if be.report else ["no compiled graph reached kvfuse's passes"]):
        print(f"note: {note}")
    print(f"compiled vs eager logits: {compare_logits(compiled_logits, logits)}")
    if model_dtype != torch.float32:
        print(f"  (in {_dtype_name(model_dtype)}, Inductor rounds the model's intermediate results differently from "
              f"eager; --model-dtype float32 isolates the cache path)")
    if args.dump is not None:
        print(f"dumps written to {args.dump}")
    return 0


# ----------------------------------------------------------------------------- info


def _version(dist: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def cmd_info(args) -> int:
    from . import __version__, envs
    from .ops import native, registry

    print(f"kvfuse {__version__} ({Path(__file__).resolve().parent})")
    print(f"python {platform.python_version()} ({sys.executable})")
    print(f"torch {torch.__version__} (built with CUDA {torch.version.cuda or 'none'})")
    for dist in ("triton", "depyf", "flashinfer-python", "transformers"):
        print(f"{dist} {_version(dist)}")
    device_types = ["cpu"]
    if torch.cuda.is_available():
        device_types.append("cuda")
        for i in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(i)
            print(f"cuda:{i} {torch.cuda.get_device_name(i)} (sm{major}{minor})")
    else:
        print("cuda: no device visible to torch")
    settings = envs.settings()
    overrides = {name: value for name, value in vars(settings).items()
                 if name in ("backend", "cache_write_backend", "attention_backend", "native_max_tokens")
                 and value is not None}
    if overrides or settings.triton_interpret:
        print("settings: " + ", ".join([f"{k}={v}" for k, v in overrides.items()]
                                       + (["triton_interpret=True"] if settings.triton_interpret else [])))

    for device_type in device_types:
        rows, passed_over = [], {}
        for row in registry.decisions(device_type):
            situation = row["size_class"] + (", captured" if row["captured"] else "")
            rows.append((row["op"], row["mode"], situation, row["chosen"] or f"none: {row['error']}"))
            for name, why in row["passed_over"]:
                passed_over.setdefault(name, set()).add(why)
        print()
        print(f"kernel registry on {device_type} (what each op runs; size class and capture only where the "
              f"policy depends on them):")
        print(_table(("op", "mode", "situation", "runs"), rows))
        if passed_over:
            print("passed over:")
            for name, whys in sorted(passed_over.items()):
                print(f"  {name}: {'; '.join(sorted(whys))}")

    print()
    try:
        with _status("checking kvfuse's native kernels (the first use builds them, ~20 s)"):
            info = native.build_info()
    except Exception as e:  # the report must not die on a broken toolchain
        print(f"native extension: build_info() failed: {type(e).__name__}: {e}")
    else:
        print("native extension:")
        for key, value in info.items():
            print(f"  {key}: {value}")
    return 0


# ----------------------------------------------------------------------------- bench


_REQUIRES_CUDA = re.compile(r"^REQUIRES_CUDA = True$", re.MULTILINE)


def _benchmarks(bench_dir: Path) -> list:
    return sorted(p.stem.replace("_", "-") for p in bench_dir.glob("*.py")
                  if not p.stem.startswith("_") and p.stem != "common")


def cmd_bench(args) -> int:
    root = Path(__file__).resolve().parent.parent
    bench_dir = root / "benchmarks"
    if not bench_dir.is_dir():
        raise CLIError(f"kvfuse bench runs the benchmarks of a source checkout, but {root} has no benchmarks/ "
                       f"directory (kvfuse is installed from a wheel?); clone the repository and "
                       f"pip install -e it")
    if args.name is None:
        raise CLIError(f"name a benchmark: {', '.join(_benchmarks(bench_dir)) or 'none found'} "
                       f"(python -m kvfuse bench NAME --help shows its options)")
    script = bench_dir / f"{args.name.replace('-', '_')}.py"
    if not script.is_file():
        raise CLIError(f"no benchmark {args.name!r} ({script} does not exist); available: "
                       f"{', '.join(_benchmarks(bench_dir)) or 'none'}")
    wants_help = any(a in ("-h", "--help") for a in args.args)
    if not wants_help and _REQUIRES_CUDA.search(script.read_text()) and not torch.cuda.is_available():
        on_cpu = [n for n in _benchmarks(bench_dir)
                  if not _REQUIRES_CUDA.search((bench_dir / f"{n.replace('-', '_')}.py").read_text())]
        raise CLIError(f"benchmark {args.name!r} needs a CUDA device, and torch {torch.__version__} sees none "
                       f"(built with CUDA {torch.version.cuda or 'none'}); on this machine: "
                       f"{', '.join(on_cpu) or 'none'}")
    # A package run from the checkout's root: `benchmarks.common` and `kvfuse` import from there.
    return subprocess.call([sys.executable, "-m", f"benchmarks.{script.stem}", *args.args], cwd=str(root))


# ----------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvfuse", description="Per-layer paged KV caches for torch.compile.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="{explain,demo,info,bench,generate}")
    sub.required = True

    p = sub.add_parser("explain", help="which cache mode each layer gets, and why")
    _add_cache_flags(p, dtype_default="auto", skip_default=None)
    p.add_argument("--layers", type=int, default=4, help="number of layers (default: 4)")
    p.add_argument("--sliding-window-layers", default="", help="comma-separated indices of sliding-window layers")
    p.add_argument("--sliding-window", type=int, default=4096, help="window of those layers (default: 4096)")
    p.add_argument("--kv-heads", type=int, default=8, help="KV heads per layer (default: 8)")
    p.add_argument("--head-size", type=int, default=128, help="head size (default: 128)")
    p.add_argument("--tp-size", type=int, default=1,
                   help="tensor-parallel ranks: each holds its share of the KV heads (default: 1)")
    p.add_argument("--tp-rank", type=int, default=None, help="the rank whose plan is printed (default: 0)")
    p.add_argument("--layer-name-format", default=LAYER_NAME_FORMAT,
                   help=f"layer names, '{{}}' = index (default: {LAYER_NAME_FORMAT})")
    p.set_defaults(func=cmd_explain)

    p = sub.add_parser("demo", help="run the demo model with a mixed per-layer cache")
    _add_cache_flags(p, dtype_default="fp8", skip_default="0,sliding_window")
    p.add_argument("--layers", type=int, default=4, help="number of layers (default: 4)")
    p.add_argument("--sliding-window-layers", default=None,
                   help="comma-separated indices of sliding-window layers (default: layers // 2)")
    p.add_argument("--sliding-window", type=int, default=8, help="window of those layers (default: 8)")
    p.add_argument("--hidden", type=int, default=256, help="hidden size (default: 256)")
    p.add_argument("--heads", type=int, default=8, help="query heads (default: 8)")
    p.add_argument("--kv-heads", type=int, default=2, help="KV heads (default: 2)")
    p.add_argument("--head-size", type=int, default=64, help="head size (default: 64)")
    p.add_argument("--vocab", type=int, default=1024, help="vocabulary size (default: 1024)")
    p.add_argument("--prompt-lens", default="13,7,29", help="prompt lengths of the batch (default: 13,7,29)")
    p.add_argument("--steps", type=int, default=4, help="decode steps after the prefill (default: 4)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per cache page (default: 16)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available, else cpu)")
    p.add_argument("--seed", type=int, default=0, help="weight and token seed (default: 0)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile run")
    p.add_argument("--dump", metavar="DIR", default=None,
                   help="write depyf dumps and kvfuse pass graphs of the compiled run to DIR")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("info", help="versions and available kernel backends")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("bench", help="run python -m benchmarks.NAME in the source checkout",
                       description="Runs python -m benchmarks.<NAME with - replaced by _> from the checkout's root; "
                                   "ARGS are passed through.")
    p.add_argument("name", metavar="NAME", nargs="?", default=None,
                   help="a benchmark: attention, cache-write, compile-pass, decode-step, ...")
    p.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS")
    p.set_defaults(func=cmd_bench)

    from .cli_generate import add_generate_parser  # its heavy imports happen when it runs

    add_generate_parser(sub, emit=print)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (CLIError, ValueError) as e:
        print(f"kvfuse {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
