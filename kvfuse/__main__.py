"""``python -m kvfuse``: explain | demo | info | bench | generate.

- ``explain``: which cache mode each layer gets for a dtype request, and which rule decided;
- ``demo``: the random-weight demo model with a mixed per-layer cache, its logit error against
  an all-model-dtype cache, and the same model compiled with kvfuse's backend;
- ``info``: versions, the CUDA device, and which kernel backend runs each op family and mode;
- ``bench NAME [args...]``: runs ``benchmarks/NAME.py`` of the source checkout;
- ``generate``: a transformers model (local directory or tiny random config) generating on
  kvfuse caches, see :mod:`kvfuse.cli_generate`.

The only module of kvfuse that prints. Heavy imports (the model, torch.compile, Triton)
happen inside the command that needs them, so ``--help`` and ``explain`` start fast.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

from .kv_cache import KVCacheConfig, KVQuantMode, _parse_dtype_name

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
    # The one dtype parser decides what a name means; "auto" and quantized names make no
    # sense for a model's own dtype.
    mode, native = _parse_dtype_name(name, "--model-dtype")
    if mode is not KVQuantMode.NONE or native is None:
        raise CLIError(f"--model-dtype={name!r} must name a native dtype: bfloat16, float16/half or float32/float")
    return native


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _spec_rows(specs) -> list:
    return [
        (
            i,
            spec.layer_name,
            spec.sliding_window if spec.sliding_window is not None else "-",
            spec.kv_quant_mode.name,
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
    )


def _add_cache_flags(p: argparse.ArgumentParser, *, dtype_default: str, skip_default: Optional[str]) -> None:
    p.add_argument("--kv-cache-dtype", "--dtype", default=dtype_default,
                   help="KV-cache dtype request: auto, bfloat16, float16, half, float32, float, fp8, fp8_e4m3, "
                        f"fp8_e5m2, nvfp4 (default: {dtype_default})")
    p.add_argument("--skip-layers", default=skip_default,
                   help="comma-separated skip rules kept in the model dtype: layer indices, 'sliding_window', or "
                        f"full layer names (default: {skip_default or 'none'})")
    p.add_argument("--checkpoint-kv-cache-dtype", default=None,
                   help="the KV-cache dtype a quantized checkpoint declares (default: none)")
    p.add_argument("--model-dtype", default="bfloat16", help="model dtype (default: bfloat16)")


# ----------------------------------------------------------------------------- explain


def cmd_explain(args) -> int:
    if args.layers <= 0:
        raise CLIError(f"--layers={args.layers} must be positive")
    config = _config_from_args(args)
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
    print(f"kv_cache_dtype={config.kv_cache_dtype!r} skip_layers={list(config.skip_layers)} "
          f"checkpoint_kv_cache_dtype={config.checkpoint_kv_cache_dtype!r}")
    print(f"model dtype {_dtype_name(model_dtype)}, {args.kv_heads} KV heads x head size {args.head_size}; "
          f"sliding-window layers: {', '.join(map(str, sorted(windowed))) or 'none'}")
    print()
    print(_table(_SPEC_HEADERS, _spec_rows(specs)))
    print()
    print(_totals_line(specs))
    return 0


# ----------------------------------------------------------------------------- demo


def cmd_demo(args) -> int:
    from .models.demo import compare_logits, make_batch, run_steps
    from .models.llama import LlamaConfig, LlamaForCausalLM

    model_dtype = _model_dtype(args.model_dtype)
    if args.layers <= 0:
        raise CLIError(f"--layers={args.layers} must be positive")
    if args.steps < 0:
        raise CLIError(f"--steps={args.steps} must be >= 0")
    if args.sliding_window_layers is None:
        windowed = (args.layers // 2,)
    else:
        windowed = _int_list(args.sliding_window_layers, "--sliding-window-layers")
    prompt_lens = _int_list(args.prompt_lens, "--prompt-lens")
    if not prompt_lens or min(prompt_lens) <= 0:
        raise CLIError(f"--prompt-lens={args.prompt_lens!r} must list positive lengths")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CLIError("--device cuda was requested but torch sees no CUDA device")
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
    print()

    model = LlamaForCausalLM(model_config, config, device=device)
    baseline = LlamaForCausalLM(model_config, baseline_config, device=device)
    logits, _ = run_steps(model, batch, block_size=args.block_size, pad_to=pad_to)
    reference, _ = run_steps(baseline, batch, block_size=args.block_size, pad_to=pad_to)
    steps_text = (f"prefill of {len(prompt_lens)} sequences (lengths {', '.join(map(str, prompt_lens))}) + "
                  f"{args.steps} decode steps, every step padded to {pad_to} tokens (slot -1)")
    print(f"eager: {steps_text}")
    print(f"logits vs an all-{_dtype_name(model_dtype)} cache: {compare_logits(logits, reference)}")

    if args.no_compile:
        return 0
    import contextlib

    from . import make_backend

    print()
    be = make_backend()
    compiled = torch.compile(model, backend=be)
    context = dump.dump(args.dump) if dump is not None else contextlib.nullcontext()
    with context:
        compiled_logits, _ = run_steps(model, batch, block_size=args.block_size, pad_to=pad_to, forward=compiled)
    report = list(getattr(be, "report", None) or [])
    print("compiled: torch.compile(model, backend=kvfuse.make_backend())")
    if report:
        rows = [
            (getattr(r, "layer_name", "?"),
             getattr(getattr(r, "kv_quant_mode", None), "name", getattr(r, "kv_quant_mode", "?")),
             "yes" if getattr(r, "fused", False) else "no",
             getattr(r, "reason", ""))
            for r in report
        ]
        print(_table(("layer", "mode", "fused", "reason"), rows))
    else:
        print("(the backend recorded no fusion report: no kvfuse pass ran on the compiled graph)")
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
    from . import __version__
    from .ops import backends

    print(f"kvfuse {__version__} ({Path(__file__).resolve().parent})")
    print(f"python {platform.python_version()} ({sys.executable})")
    print(f"torch {torch.__version__} (built with CUDA {torch.version.cuda or 'none'})")
    for dist in ("triton", "depyf", "flashinfer-python"):
        print(f"{dist} {_version(dist)}")
    device_types = ["cpu"]
    if torch.cuda.is_available():
        device_types.append("cuda")
        for i in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(i)
            print(f"cuda:{i} {torch.cuda.get_device_name(i)} (sm{major}{minor})")
    else:
        print("cuda: no device visible to torch")
    overrides = {v: os.environ[v] for v in ("KVFUSE_BACKEND", "KVFUSE_CACHE_WRITE_BACKEND",
                                            "KVFUSE_ATTENTION_BACKEND", "TRITON_INTERPRET") if v in os.environ}
    if overrides:
        print("overrides: " + ", ".join(f"{k}={v}" for k, v in overrides.items()))

    families = {"cache": backends.CACHE_OPS, "attention": backends.ATTENTION_OPS}
    for device_type in device_types:
        rows, why_not = [], {}
        for family, ops in families.items():
            for mode in KVQuantMode:
                available = []
                for name in backends.BACKEND_MODULES:
                    reasons = [backends.unavailable_reason(name, op, device_type, mode) for op in ops]
                    missing = [f"{op}: {r}" for op, r in zip(ops, reasons) if r is not None]
                    if not missing:
                        available.append(name)
                    else:
                        why_not.setdefault((name, family), set()).update(r for r in reasons if r is not None)
                selected = []
                for op in ops:
                    try:
                        selected.append(backends.select(op, device_type, mode)[0])
                    except (RuntimeError, ValueError) as e:
                        selected.append(f"none ({e})")
                chosen = selected[0] if len(set(selected)) == 1 else ", ".join(
                    f"{op}: {s}" for op, s in zip(ops, selected))
                rows.append((family, mode.name, chosen, ", ".join(available) or "-"))
        print()
        print(f"kernel backends on {device_type}:")
        print(_table(("ops", "mode", "selected", "available"), rows))
        unavailable = [(n, f, "; ".join(sorted(r))) for (n, f), r in sorted(why_not.items())]
        if unavailable:
            print()
            print("not available:")
            for name, family, reason in unavailable:
                print(f"  {name} ({family}): {reason}")

    print()
    try:
        from .ops import native
    except ImportError as e:
        print(f"native extension: unavailable ({e})")
    else:
        build_info = getattr(native, "build_info", None)
        if build_info is None:
            print("native extension: present (no build_info())")
        else:
            try:
                info = build_info()
            except Exception as e:  # the report must not die on a broken toolchain
                print(f"native extension: build_info() failed: {type(e).__name__}: {e}")
            else:
                if isinstance(info, dict):
                    print("native extension:")
                    for key, value in info.items():
                        print(f"  {key}: {value}")
                else:
                    print(f"native extension: {info}")
    return 0


# ----------------------------------------------------------------------------- bench


def cmd_bench(args) -> int:
    root = Path(__file__).resolve().parent.parent
    bench_dir = root / "benchmarks"
    if not bench_dir.is_dir():
        raise CLIError(f"kvfuse bench runs the benchmarks of a source checkout, but {root} has no benchmarks/ "
                       f"directory (kvfuse is installed from a wheel?); clone the repository and "
                       f"pip install -e it")
    script = bench_dir / f"{args.name.replace('-', '_')}.py"
    if not script.is_file():
        known = sorted(p.stem.replace("_", "-") for p in bench_dir.glob("*.py")
                       if not p.stem.startswith("_") and p.stem != "common")
        raise CLIError(f"no benchmark {args.name!r} ({script} does not exist); available: "
                       f"{', '.join(known) or 'none'}")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    return subprocess.call([sys.executable, str(script), *args.args], cwd=str(root), env=env)


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

    p = sub.add_parser("bench", help="run benchmarks/NAME.py of the source checkout",
                       description="Runs benchmarks/<NAME with - replaced by _>.py; ARGS are passed through.")
    p.add_argument("name", metavar="NAME")
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
