"""Command line: ``tiered run`` (read a long document and answer) and ``tiered info``."""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import tiered


class Progress:
    """A one-line progress bar on stderr: tokens done, tokens/s, ETA."""

    def __init__(self, label: str, stream=sys.stderr, width: int = 30):
        self.label, self.stream, self.width = label, stream, width
        self.start = time.perf_counter()
        self.tty = stream.isatty()
        self._last_printed = -1.0

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        frac = done / total if total else 1.0
        rate = done / max(now - self.start, 1e-9)
        eta = (total - done) / rate if rate > 0 else float("inf")
        bar = "#" * int(frac * self.width)
        line = (f"{self.label} [{bar:<{self.width}}] {done}/{total} tokens "
                f"{rate:,.0f} tok/s ETA {eta:,.0f}s")
        if self.tty:
            self.stream.write("\r" + line + ("\n" if done >= total else ""))
            self.stream.flush()
        elif frac - self._last_printed >= 0.1 or done >= total:
            self._last_printed = frac
            self.stream.write(line + "\n")
            self.stream.flush()


def _demo_document(tokenizer, n_tokens: int, seed: int | None):
    from .tasks import passkey

    rng = random.Random(seed)
    depth = round(rng.uniform(0.05, 0.95), 2)
    sample = passkey(tokenizer, n_tokens, depth, seed=rng.randrange(1 << 30))
    return sample


def cmd_run(args) -> int:
    if args.document is not None and not os.path.isfile(args.document):
        print(f"tiered run: error: document not found: {args.document}", file=sys.stderr)
        return 2
    if args.document is not None and not args.question:
        print("tiered run: error: --question is required with --document", file=sys.stderr)
        return 2
    import mlx_lm

    t0 = time.perf_counter()
    model, tokenizer = tiered.load(args.model)
    print(f"model: {getattr(model, 'tiered_name', args.model)} loaded in "
          f"{time.perf_counter() - t0:.1f}s", file=sys.stderr)

    expected = None
    if args.document is None:
        sample = _demo_document(tokenizer, args.demo_tokens, args.seed)
        prompt = sample.prompt
        expected = sample.answer
        print(f"demo: a {sample.n_tokens}-token document with a 5-digit pass key hidden at "
              f"{100 * sample.depth:.0f}% depth", file=sys.stderr)
        prompt_tokens = tokenizer.encode(prompt)
    else:
        with open(args.document, encoding="utf-8", errors="replace") as f:
            document = f.read()
        content = f"{document}\n\nQuestion: {args.question}"
        if getattr(tokenizer, "chat_template", None) and not args.no_chat:
            prompt_tokens = tokenizer.apply_chat_template(
                [{"role": "user", "content": content}], add_generation_prompt=True
            )
        else:
            prompt_tokens = tokenizer.encode(content + "\nAnswer:")

    try:
        options = json.loads(args.options) if args.options else {}
        cache = tiered.TieredCache.for_model(model, gpu_budget=args.gpu_budget,
                                             method=args.method, **options)
    except ValueError as e:
        print(f"tiered run: error: {e}", file=sys.stderr)
        return 2

    if args.max_tokens is None:
        args.max_tokens = 10 if expected is not None else 32
    progress = Progress("prefill")
    text, last = [], None
    for response in mlx_lm.stream_generate(
        model, tokenizer, prompt_tokens, max_tokens=args.max_tokens, prompt_cache=cache,
        prefill_step_size=args.prefill_step, prompt_progress_callback=progress,
    ):
        if last is None:
            sys.stdout.write("answer: ")
        sys.stdout.write(response.text)
        sys.stdout.flush()
        text.append(response.text)
        last = response
    sys.stdout.write("\n")
    answer = "".join(text)

    rep = tiered.report_dict(cache)
    print("\n--- summary ---")
    print(f"tokens: {last.prompt_tokens} prompt, {last.generation_tokens} generated")
    print(f"prefill: {last.prompt_tps:,.1f} tok/s | decode: {last.generation_tps:,.2f} tok/s "
          f"| peak MLX memory {last.peak_memory:.2f} GB")
    print(tiered.report(cache))
    if expected is not None:
        from .tasks import is_correct

        ok = is_correct(expected, answer)
        print(f"pass key {expected}: {'found' if ok else 'NOT found'}")
    if args.json:
        rep.update(answer=answer, prompt_tokens=last.prompt_tokens,
                   generation_tokens=last.generation_tokens, prompt_tps=last.prompt_tps,
                   generation_tps=last.generation_tps, expected=expected)
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=2)
    return 0


def _matmul_gflops(n: int = 1024, reps: int = 5) -> float:
    import mlx.core as mx

    a = mx.random.normal((n, n))
    b = mx.random.normal((n, n))
    mx.eval(a, b, a @ b)
    t = time.perf_counter()
    for _ in range(reps):
        mx.eval(a @ b)
    return 2 * n**3 * reps / (time.perf_counter() - t) / 1e9


def info_dict() -> dict:
    import platform

    import mlx.core as mx

    versions = {}
    for pkg in ("mlx", "mlx-lm", "numpy", "numba", "faiss-cpu"):
        try:
            from importlib.metadata import version

            versions[pkg] = version(pkg)
        except Exception:
            versions[pkg] = "not installed"
    backend = "cpu"
    if mx.default_device() != mx.cpu:
        backend = "metal" if mx.metal.is_available() else "cuda"
    return {
        "tiered": tiered.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "backend": backend,
        "device": str(mx.default_device()),
        "blas": {"status": tiered.BLAS.status, "path": tiered.BLAS.path,
                 "detail": tiered.BLAS.detail},
        "versions": versions,
        "cpu_count": os.cpu_count(),
        "matmul_gflops": round(_matmul_gflops(), 1),
    }


def cmd_info(args) -> int:
    d = info_dict()
    if args.json:
        print(json.dumps(d, indent=2))
        return 0
    blas = d["blas"]
    print(f"tiered {d['tiered']} | python {d['python']} | {d['platform']}")
    print(f"backend: {d['backend']} ({d['device']}), {d['cpu_count']} CPU cores")
    print(f"BLAS: {blas['status']}" + (f" {blas['path']}" if blas["path"] else "")
          + (f" ({blas['detail']})" if blas["detail"] else ""))
    print("versions: " + ", ".join(f"{k} {v}" for k, v in d["versions"].items()))
    print(f"matmul: {d['matmul_gflops']} GFLOP/s (fp32 1024x1024)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tiered", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="read a long document and answer a question (or run the demo)")
    r.add_argument("--document", help="text file to read; without it a pass-key demo runs")
    r.add_argument("--question", help="question about the document")
    r.add_argument("--model", default=None, help="mlx-lm model path or repo (default: embedded)")
    r.add_argument("--gpu-budget", default="0.125",
                   help="accelerator budget: fraction of the full cache or a size like 2GB")
    r.add_argument("--method", default="tiered", choices=["tiered", "hcattention", "h2o"])
    r.add_argument("--options", help="extra TieredConfig options as JSON, e.g. '{\"tau\": 0.95}'")
    r.add_argument("--max-tokens", type=int, default=None,
                   help="tokens to generate (default: 32, or 10 for the demo)")
    r.add_argument("--prefill-step", type=int, default=2048)
    r.add_argument("--demo-tokens", type=int, default=3000)
    r.add_argument("--seed", type=int, default=None, help="demo seed (default: random)")
    r.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    r.add_argument("--json", help="also write the summary as JSON to this file")
    r.set_defaults(func=cmd_run)
    i = sub.add_parser("info", help="backend, device, BLAS, versions, matmul speed")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=cmd_info)
    return p


def _budget(value: str):
    try:
        f = float(value)
    except ValueError:
        return value
    return f


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if hasattr(args, "gpu_budget"):
        args.gpu_budget = _budget(args.gpu_budget)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
