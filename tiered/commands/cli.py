"""Command line: ``tiered run`` (read a long document and answer) and ``tiered info``."""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import tiered
import tiered.prefill as prefill

from ..layerwise_prefill import layerwise_prefill
from ..options.config import TieredConfig
from ..persistence import persist, save_file
from ..planning import tasks
from .cli_common import (
    UsageError,
    check_model_path,
    json_options,
    load_model,
    mlx_cache_flag,
)
from .cli_info import cmd_info
from .cli_prefill import PREFILLS, prefill_choice
from .cli_shard import distributed_group, run_sharded

DESCRIPTION = """\
Read a long document with an MLX language model through a tiered KV cache and answer a
question about it (tiered run), or show the backend, BLAS and versions in use (tiered info).
tiered generate and tiered cache-prompt take mlx-lm's flags (tiered generate -h).
Without --document, tiered run reads a generated document with a hidden pass key."""

MAX_DOCUMENT_BYTES = 1 << 31  # documents are read whole


class Progress:
    """A one-line progress bar on stderr: tokens (or layers) done, their rate, ETA."""

    def __init__(self, label: str, stream=sys.stderr, width: int = 30, unit: str = "tokens"):
        self.label, self.stream, self.width, self.unit = label, stream, width, unit
        self.start = time.perf_counter()
        self.tty = stream.isatty()
        self._last_printed = -1.0

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        frac = done / total if total else 1.0
        rate = done / max(now - self.start, 1e-9)
        eta = f"{(total - done) / rate:,.0f}s" if rate > 0 else "--"  # nothing done yet
        per = "tok/s" if self.unit == "tokens" else f"{self.unit}/s"
        speed = f"{rate:,.{0 if self.unit == 'tokens' else 2}f} {per}" if done else f"-- {per}"
        bar = "#" * int(frac * self.width)
        line = f"{self.label} [{bar:<{self.width}}] {done}/{total} {self.unit} {speed} ETA {eta}"
        if self.tty:
            self.stream.write("\r" + line + ("\n" if done >= total else ""))
            self.stream.flush()
        elif frac - self._last_printed >= 0.1 or done >= total:
            self._last_printed = frac
            self.stream.write(line + "\n")
            self.stream.flush()


def _demo_document(tokenizer, n_tokens: int, seed: int | None):
    rng = random.Random(seed)
    depth = round(rng.uniform(0.05, 0.95), 2)
    sample = tasks.passkey(tokenizer, n_tokens, depth, seed=rng.randrange(1 << 30))
    return sample


MARKER = "\u2063TIERED-CONTENT\u2063"


def split_prompt(tokenizer, document: str, question: str, *, chat: bool):
    """Token ids of (document prefix, question suffix). The prefix is what a saved cache holds;
    the suffix is asked on top of it, now or later (``--load-cache``): both runs tokenize the
    same way."""
    if chat and getattr(tokenizer, "chat_template", None):
        full = tokenizer.apply_chat_template([{"role": "user", "content": MARKER}],
                                             add_generation_prompt=True, tokenize=False)
        head, tail = full.split(MARKER)
        prefix, suffix = head + document, f"\n\nQuestion: {question}" + tail
        enc = tokenizer._tokenizer if hasattr(tokenizer, "_tokenizer") else tokenizer
        pre = enc.encode(prefix, add_special_tokens=False)
        return pre, enc.encode(suffix, add_special_tokens=False)
    return tokenizer.encode(document), tokenizer.encode(question, add_special_tokens=False)


def read_document(path: str) -> str:
    """The document's text; UsageError for a missing, unreadable, empty, binary or non-UTF-8
    file (checked before the model loads)."""
    if os.path.isdir(path):
        raise UsageError(f"the document {path} is a directory; give one text file (join the "
                         "files first, e.g. cat DIR/*.txt > document.txt)")
    if not os.path.isfile(path):
        raise UsageError(f"document not found: {path}")
    size = os.path.getsize(path)
    if size > MAX_DOCUMENT_BYTES:
        raise UsageError(f"document too large: {path} ({size} bytes, at most "
                         f"{MAX_DOCUMENT_BYTES})")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise UsageError(f"cannot read the document {path}: {e.strerror}") from None
    if b"\0" in raw:
        raise UsageError(f"the document {path} is a binary file (it contains NUL bytes); give "
                         "a UTF-8 text file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"the document {path} is not UTF-8 text (invalid byte at offset "
                         f"{e.start}); convert it to UTF-8") from None
    if not text.strip():
        raise UsageError(f"the document {path} is empty")
    return text


def _options(args) -> dict:
    opts = json_options(args.options)
    if args.gpu_budget is not None:
        opts["gpu_budget"] = args.gpu_budget
    if args.method is not None:
        opts["method"] = args.method
    if args.host_budget is not None:
        opts["host_budget"] = args.host_budget
    if args.memory_budget is not None:
        opts["memory_budget"] = args.memory_budget
    if args.disk_dir is not None:
        opts["disk_dir"] = args.disk_dir
    return opts


def _check_inputs(args):
    """Everything that can be checked before the model loads (seconds saved on a typo).
    Returns the document's text (or None) and the options."""
    if (args.document is not None or args.load_cache) and not args.question:
        raise UsageError("--question is required with --document or --load-cache")
    if args.question and args.document is None and not args.load_cache:
        raise UsageError("--question needs --document FILE (or --load-cache DIR); without "
                         "them tiered run reads its pass-key demo, which asks its own question")
    if args.kv_bits is not None or args.max_kv_size is not None:
        raise mlx_cache_flag("--kv-bits" if args.kv_bits is not None else "--max-kv-size")
    check_model_path(args.model)
    if args.load_cache and args.document:
        raise UsageError("--load-cache answers from a saved cache; drop --document")
    if args.load_cache and args.save_cache:
        raise UsageError("--save-cache saves after reading a document; drop it with --load-cache")
    document = read_document(args.document) if args.document is not None else None
    options = _options(args)
    try:
        TieredConfig.from_kwargs(**{"gpu_budget": 0.125, **options})
        if args.load_cache:
            save_file.check(args.load_cache)
        if args.save_cache:
            save_file.check_save(args.save_cache)
    except (ValueError, OSError) as e:
        raise UsageError(str(e)) from None
    return document, options


def cmd_run(args) -> int:
    document, options = _check_inputs(args)
    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model)
    args.model_rss = prefill.current_rss_bytes()  # the process with its model, before the cache
    print(f"model: {getattr(model, 'tiered_name', args.model)} loaded in "
          f"{time.perf_counter() - t0:.1f}s", file=sys.stderr)
    expected = None
    prefill_stats = None
    cache = None
    try:
        if args.load_cache:
            if distributed_group() is not None:
                raise ValueError("--load-cache is not supported with a sharded cache "
                                 "(mlx.launch with several ranks)")
            cache = tiered.TieredCacheList.load(args.load_cache, model, **options)
            _, suffix = split_prompt(tokenizer, "", args.question, chat=not args.no_chat)
            print(f"cache: {cache[cache.tiered_layers[0]].offset} tokens loaded from "
                  f"{args.load_cache}", file=sys.stderr)
        else:
            if document is None:
                sample = _demo_document(tokenizer, args.demo_tokens, args.seed)
                expected = sample.answer
                print(f"demo: a {sample.n_tokens}-token document with a 5-digit pass key hidden "
                      f"at {100 * sample.depth:.0f}% depth", file=sys.stderr)
                prefix = tokenizer.encode(sample.document)
                suffix = tokenizer.encode(sample.question, add_special_tokens=False)
            else:
                prefix, suffix = split_prompt(tokenizer, document, args.question,
                                              chat=not args.no_chat)
            options.setdefault("gpu_budget", 0.125)
            group = distributed_group()
            if group is not None:  # one rank of several (mlx.launch): the cache is sharded
                return run_sharded(args, group, model, tokenizer, prefix, suffix, expected,
                                   options)
            if args.save_cache:  # the room for the save, before the prefill it would save
                save_file.check_save(args.save_cache, persist.estimate_save_bytes(
                    model, len(prefix), tiered.TieredConfig.from_kwargs(**options)))
            how, why = prefill_choice(args.prefill, model, len(prefix), options)
            print(f"prefill: {PREFILLS[how]} ({why})", file=sys.stderr)
            if how == "layers":  # each layer stays exact during its own pass
                options["prefill_window"] = max(len(prefix), options.get(
                    "prefill_window", TieredConfig.prefill_window))
            cache = tiered.TieredCache.for_model(model, tokenizer=tokenizer, **options)
            if how == "layers":
                prefill_stats = layerwise_prefill(model, cache, prefix, chunk=args.prefill_step,
                                                  progress=Progress("prefill", unit="layers"))
            else:
                prefill_stats = prefill.prefill(model, cache, prefix, chunk=args.prefill_step,
                                                progress=Progress("prefill"))
            prefill_stats["how"] = how
            if args.save_cache:
                cache.save(args.save_cache, model)
                print(f"cache saved to {args.save_cache}", file=sys.stderr)
    except (ValueError, OSError) as e:
        if cache is not None:
            cache.close()
        print(f"tiered run: error: {e}", file=sys.stderr)
        return 2
    try:
        return _answer(args, model, tokenizer, cache, suffix, expected, prefill_stats)
    finally:
        cache.close()


def _answer(args, model, tokenizer, cache, suffix, expected, prefill_stats) -> int:
    import mlx_lm

    if args.max_tokens is None:
        args.max_tokens = 10 if expected is not None else 32
    text, last = [], None
    for response in mlx_lm.stream_generate(model, tokenizer, suffix, max_tokens=args.max_tokens,
                                           prompt_cache=cache):
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
    doc_tokens = (prefill_stats["tokens"] if prefill_stats
                  else rep["tokens"] - last.generation_tokens - len(suffix))
    print(f"tokens: {doc_tokens} document + {len(suffix)} question, "
          f"{last.generation_tokens} generated")
    if prefill_stats:
        print(f"prefill: {prefill_stats['tokens_per_s']:,.1f} tok/s "
              f"({prefill_stats['seconds']:.1f}s)", end=" | ")
    peak_rss = prefill.peak_rss_bytes()
    above = peak_rss - getattr(args, "model_rss", 0)
    print(f"decode: {last.generation_tps:,.2f} tok/s | peak host RSS "
          f"{peak_rss / 2**30:.2f} GiB ({above / 2**20:,.0f} MiB above the process with its "
          f"model) | peak MLX memory {last.peak_memory:.2f} GB")
    print(tiered.report(cache))
    if expected is not None:
        ok = tasks.is_correct(expected, answer)
        print(f"pass key {expected}: {'found' if ok else 'NOT found'}")
    if args.json:
        rep.update(peak_rss_bytes=peak_rss, peak_rss_above_model_bytes=above)
        rep.update(answer=answer, generation_tokens=last.generation_tokens,
                   generation_tps=last.generation_tps, expected=expected, prefill=prefill_stats)
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=2, default=str)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tiered", description=DESCRIPTION)
    p.add_argument("--version", action="version", version=f"tiered {tiered.__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="read a long document and answer a question (or run the demo)")
    r.add_argument("--document", help="text file to read; without it a pass-key demo runs")
    r.add_argument("--question", help="question about the document")
    r.add_argument("--model", default=None, help="mlx-lm model path or repo (default: embedded)")
    r.add_argument("--gpu-budget", default=None,
                   help="accelerator budget: fraction of the full cache or a size like 2GB "
                        "(default 0.125)")
    r.add_argument("--method", default=None, choices=["tiered", "hcattention", "h2o"],
                   help="default: tiered")
    r.add_argument("--host-budget", default=None,
                   help="host RAM for pages (e.g. 4GB); beyond it pages go to --disk-dir")
    r.add_argument("--memory-budget", default=None,
                   help="the cache's accelerator tier and host RAM together (e.g. 1GB; one "
                        "memory on Apple silicon and the CPU backend); the rest on --disk-dir")
    r.add_argument("--disk-dir", default=None, help="directory of the disk tier's page files")
    r.add_argument("--save-cache", metavar="DIR",
                   help="after reading the document, save the cache to DIR (ask again later)")
    r.add_argument("--load-cache", metavar="DIR",
                   help="answer --question from a cache saved with --save-cache")
    r.add_argument("--options", help="extra TieredConfig options as JSON, e.g. '{\"tau\": 0.95}'")
    r.add_argument("--max-tokens", type=int, default=None,
                   help="tokens to generate (default: 32, or 10 for the demo)")
    r.add_argument("--prefill-step", type=int, default=2048)
    r.add_argument("--prefill", default="auto", choices=["auto", "layers", "chunks"],
                   help="how the document is read: layer by layer (exact, one layer's full "
                        "K/V at a time), chunk by chunk (exact within prefill_window, block-wise "
                        "past it), or auto: layers where the document is longer than "
                        "prefill_window and the model allows it")
    r.add_argument("--demo-tokens", type=int, default=3000)
    r.add_argument("--seed", type=int, default=None, help="demo seed (default: random)")
    r.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    r.add_argument("--json", help="also write the summary as JSON to this file")
    for flag in ("--kv-bits", "--max-kv-size"):  # mlx-lm's: answered with what tiered does
        r.add_argument(flag, type=int, default=None, help=argparse.SUPPRESS)
    r.set_defaults(func=cmd_run)
    i = sub.add_parser("info", help="backend, device, BLAS, versions, matmul speed")
    i.add_argument("--json", action="store_true")
    i.add_argument("--preload", action="store_true",
                   help="print only the jemalloc library to preload (LD_PRELOAD=$(tiered info "
                        "--preload) python app.py); exit 1 where there is none")
    i.set_defaults(func=cmd_info)
    for name, what in MLX_COMMANDS.items():  # parsed by their own parsers (tiered.commands.cli_mlx)
        sub.add_parser(name, help=what, add_help=False)
    return p


MLX_COMMANDS = {"generate": "mlx_lm.generate's flags with a tiered cache",
                "cache-prompt": "mlx_lm.cache_prompt's flags: read a document once, save it",
                "serve": "mlx_lm.server's OpenAI-compatible server, a tiered cache per sequence "
                         "(its flags, and --gpu-budget, --options)"}


def _mlx_command(argv):
    from . import cli_mlx

    name = argv[0]
    parser = {"generate": cli_mlx.generate_parser,
              "cache-prompt": cli_mlx.cache_prompt_parser}[name]()
    args = parser.parse_args(argv[1:])
    args.command = name
    args.func = cli_mlx.cmd_generate if name == "generate" else cli_mlx.cmd_cache_prompt
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "serve":
        from . import serve

        try:
            return serve.main(argv[1:])
        except UsageError as e:
            print(f"tiered serve: error: {e}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            return 130
    if argv and argv[0] in MLX_COMMANDS:
        args = _mlx_command(argv)
    else:
        args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UsageError as e:
        print(f"tiered {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"tiered {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
