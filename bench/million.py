"""A million-token document: bounded-memory prefill, the disk tier, decode at 1M tokens.

The document is real text: ``pydoc_data.topics`` split into paragraphs, shuffled (seeded) and
repeated until it holds ``--tokens`` tokens, with a pass key planted at 10% depth. The prefill
runs chunk by chunk: exact while the prompt fits the prefill window, block-wise (anchor +
local block) beyond; key codes, host pages (spilling to the disk tier beyond ``--host-budget``)
and the calibration are made as the chunks go. Every chunk samples the process's own memory:
host RSS (``/proc/self/statm``), the accelerator tier (measured from the arrays; on a GPU also
the device memory in use, from NVML) and the disk tier's bytes.

    python bench/million.py --model embedded --layers 10 --host-budget 2GB     # CPU
    python bench/million.py --model llama3-8b --host-budget 40GB --no-host-keys  # GPU
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "probes"))  # helpers and probes

import common  # noqa: F401  (tiered before mlx)
from common import RESULTS, machine, md_table, open_files, write_results
from million_report import DeviceMemory, plot, print_disk_steps
from step_timers import StepTimers
from streaming_cache import host_copy_rate

import mlx.core as mx
import numpy as np

import tiered
from tiered.commands.cli import Progress
from tiered.prefill import current_rss_bytes, peak_rss_bytes, prefill
from tiered.runtime import memory_limit
from tiered.step import disk_stage


def document_tokens(tok, n_tokens: int, seed: int = 0):
    """(token ids, pass key) of a shuffled-pydoc document of n_tokens with a key at 10%."""
    from tiered.planning.tasks import topics_text

    paras = [p for p in topics_text().split("\n\n") if p.strip()]
    rng = random.Random(seed)
    key = str(rng.randrange(10000, 100000))
    needle = tok.encode(f"\n\nThe pass key is {key}. Remember it. {key} is the pass key.\n\n")
    ids: list[int] = []
    while len(ids) < n_tokens:
        rng.shuffle(paras)
        ids += tok.encode("\n\n".join(paras))
    ids = ids[:n_tokens]
    at = n_tokens // 10
    question = tok.encode("\n\nWhat is the pass key? The pass key is")
    ids = ids[:at] + needle + ids[at : n_tokens - len(needle) - len(question)] + question
    return ids, key


def build_model(name: str, layers: int | None, tokenizer: bool = True):
    if name == "embedded":
        model, tok = tiered.load()
        if layers:
            model.model.layers = model.model.layers[:layers]
            model.args.num_hidden_layers = layers
        return model, tok
    from decode_setup import build_model as random_model

    model, _ = random_model(name, mx.float16)
    if not tokenizer:
        return model, None
    from tiered.model import load_default

    _, tok = load_default()  # token ids from the embedded tokenizer (all < its 49152 vocab)
    return model, tok


def decode_step(model, cache, y, times, queue, out):
    """One greedy step; its wall time and its graph building's (Python, MLX dispatch)."""
    t = time.perf_counter()
    logits = model(y, cache=cache)
    y = mx.argmax(logits[:, -1], axis=-1)[:, None]
    queue.append(time.perf_counter() - t)
    mx.eval(y)
    times.append(time.perf_counter() - t)
    out.append(int(y.item()))
    return y


def _pooled() -> int:
    """Bytes of host blocks allocated ahead for the prompt and not taken yet (0 on a tree
    without the pool: bench/probes/gpu_rounds.sh TREE= times older commits with this script)."""
    try:
        from tiered.cpu.block_maker import POOL
    except ImportError:
        return 0
    return POOL.held_bytes()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="embedded", choices=["embedded", "llama3-8b", "llama3-8b-2l"])
    p.add_argument("--layers", type=int, default=None, help="keep the first N layers (embedded)")
    p.add_argument("--tokens", type=int, default=1_000_000)
    p.add_argument("--budget", type=float, default=0.125)
    p.add_argument("--host-budget", default="2GB")
    p.add_argument("--host-dtype", default="float16")
    p.add_argument("--no-host-keys", action="store_true")
    p.add_argument("--disk-dir", default=None)
    p.add_argument("--chunk", type=int, default=None, help="default: 512 on the CPU, 2048 on GPUs")
    p.add_argument("--prefill-window", type=int, default=16384)
    p.add_argument("--anchor", type=int, default=None, help="default: the chunk size")
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--cache-limit-gb", type=float, default=None,
                   help="cap MLX's cache of freed buffers (mx.set_cache_limit)")
    p.add_argument("--tokens-file", help="read the document's token ids (.npz) instead of "
                   "tokenizing (machines without the embedded model's tokenizer)")
    p.add_argument("--write-tokens", help="only write the document's token ids to this .npz")
    p.add_argument("--set", action="append", default=[], metavar="MODULE.ATTR=VALUE",
                   help="set a module attribute first, e.g. a switch under test")
    p.add_argument("--name", default=None)
    p.add_argument("--marks", default=None,
                   help="a folder: touch compress.go before the chunk that compresses, "
                        "prefill.go at 40%% of the prefill and decode.go after --mark-step "
                        "decode steps, for a profiler attached from outside")
    p.add_argument("--mark-step", type=int, default=3)
    p.add_argument("--step-timers", action="store_true",
                   help="time every call site per decode step and print the slow steps' "
                        "(slows every step: a diagnosis, not a timing)")
    p.add_argument("--kernel-steps", type=int, default=0,
                   help="after decoding, this many steps under the CUDA kernel profiler")
    args = p.parse_args(argv)
    for s_ in args.set:
        print(f"set {common.set_attribute(s_)}", flush=True)
    if args.cache_limit_gb is not None:
        mx.set_cache_limit(int(args.cache_limit_gb * 2**30))
    on_cpu = mx.default_device() == mx.cpu
    args.name = args.name or f"million_{'cpu' if on_cpu else 'gpu'}_{args.model}"
    args.chunk = args.chunk or (512 if on_cpu else 2048)
    args.anchor = args.anchor if args.anchor is not None else args.chunk
    if args.write_tokens:
        _, tok = tiered.load()
        ids, key = document_tokens(tok, args.tokens)
        q = len(tok.encode("\n\nWhat is the pass key? The pass key is"))
        np.savez_compressed(args.write_tokens, ids=np.array(ids, np.int32), key=key,
                            question_len=q)
        print(f"wrote {len(ids)} token ids to {args.write_tokens}")
        return 0
    info = machine()
    dev = DeviceMemory()
    t = time.perf_counter()
    if args.tokens_file:
        z = np.load(args.tokens_file)
        ids, key, tok = z["ids"].tolist(), str(z["key"]), None
        q = int(z["question_len"]) if "question_len" in z else 12
        if args.tokens < len(ids):  # a shorter run: keep the head and the closing question
            ids = ids[: args.tokens - q] + ids[-q:]
        elif args.tokens > len(ids):  # a longer one: the document repeated, then the question
            body = ids[:-q]
            ids = (body * -(-(args.tokens - q) // len(body)))[: args.tokens - q] + ids[-q:]
            print(f"document: the {len(body)}-token file repeated to {args.tokens} tokens",
                  flush=True)
        model, _ = build_model(args.model, args.layers, tokenizer=False)
    else:
        model, tok = build_model(args.model, args.layers)
        ids, key = document_tokens(tok, args.tokens)
    vocab = model.args.vocab_size
    if max(ids) >= vocab:  # the 2-layer slice's 4096: an id past it crashed MLX's CPU gather
        print(f"token ids folded into the model's vocabulary of {vocab} (random weights: the "
              "text means nothing to it; the pass key check does not apply)", flush=True)
        ids = [i % vocab for i in ids]
    from tiered.planning.geometry import model_geometry

    geo = model_geometry(model, len(model.layers))
    print(f"document: {len(ids)} tokens ({time.perf_counter() - t:.0f}s to build); model "
          f"{args.model} {geo}", flush=True)
    host_bw = host_copy_rate()  # the streaming-offload baseline's rate (computed, not run)
    disk_dir = args.disk_dir or os.path.join(RESULTS, "..", ".pages")
    cache = tiered.TieredCache.for_model(
        model, gpu_budget=args.budget, host_budget=args.host_budget, disk_dir=disk_dir,
        host_dtype=args.host_dtype, host_keys=not args.no_host_keys,
        prefill_window=args.prefill_window, anchor_tokens=args.anchor)
    budget_bytes = lambda n: int(args.budget * geo.full_bytes(n))  # noqa: E731
    samples = []
    rss0 = current_rss_bytes()
    t_start = time.perf_counter()

    def mark(name):
        if args.marks:
            os.makedirs(args.marks, exist_ok=True)
            open(os.path.join(args.marks, name), "w").close()

    def sample(done):
        if done >= 0.4 * len(ids) > done - args.chunk:
            mark("prefill.go")
        if done + args.chunk >= args.prefill_window > done:  # the next chunk compresses
            mark("compress.go")
        tb = cache.tier_bytes()
        samples.append({"tokens": done, "s": time.perf_counter() - t_start,
                        "rss": current_rss_bytes(), "transient": tb["transient"],
                        "fds": open_files(),
                        "accelerator": tb["accelerator"] - tb["transient"],
                        # the blocks allocated ahead for the prompt count as the tier's
                        "host": tb["host"] + _pooled(), "disk": tb["disk"],
                        "device": dev.used(),
                        "budget": budget_bytes(done), "mlx_active": mx.get_active_memory(),
                        "mlx_cache": mx.get_cache_memory()})

    body = ids[:-1]
    stats = prefill(model, cache, body, chunk=args.chunk, progress=Progress("prefill"),
                    on_chunk=sample)
    print(f"prefill: {stats['tokens']} tokens in {stats['seconds']:.0f}s = "
          f"{stats['tokens_per_s']:.1f} tok/s", flush=True)
    base = memory_limit.base()  # above the limit MLX serializes each eval (runtime.memory_limit)
    print(f"MLX memory after the prefill: active {mx.get_active_memory() / 2**30:.2f} GiB, "
          f"limit {mx.get_memory_limit() / 2**30:.2f} GiB"
          + (f" (base {base / 2**30:.2f} + host pages)" if base is not None else ""), flush=True)
    # decode at 1M: the last prompt token, then greedy steps
    times, queue, out = [], [], []
    disk0 = disk_stage.counts()
    y = mx.array([[ids[-1]]])
    st = StepTimers() if args.step_timers else None
    disk_steps = []  # per step: the disk rows' counts and the process's minor page faults
    with st or contextlib.nullcontext():
        for i in range(args.decode_steps):
            if i == args.mark_step:
                mark("decode.go")
            y = decode_step(model, cache, y, times, queue, out)
            if st:
                st.step()
            ru = resource.getrusage(resource.RUSAGE_SELF)
            disk_steps.append((disk_stage.counts(), (ru.ru_minflt, ru.ru_majflt)))
    print_disk_steps(disk0, disk_steps, times)
    slow = st.print_slow(times) if st else None
    print("first decode steps (compiles included):",
          ", ".join(f"{1e3 * t:.0f}" for t in times[:3]), "ms", flush=True)
    if len(times) > 3:
        q = 1e3 * np.median(queue[3:])
        print(f"decode after the first 3 steps: median {1e3 * np.median(times[3:]):.1f} ms/token"
              f", of which building the graph {q:.1f} ms", flush=True)
    if args.kernel_steps:
        from device_kernel_profile import busy, profile

        spans = []
        kern = profile(model, cache, args.kernel_steps, spans)
        n = args.kernel_steps
        print(f"kernels: {sum(c for c, _ in kern.values()) / n:.0f} per token, "
              f"{sum(us for _, us in kern.values()) / n / 1e3:.2f} ms summed, "
              f"{busy(spans) / n / 1e3:.2f} ms with the GPU busy", flush=True)
        for k, (c, us) in sorted(kern.items(), key=lambda kv: -kv[1][1])[:30]:
            print(f"  {us / n / 1e3:8.3f} ms {c / n:6.1f}x  {k}")
    disk_read = {k: v - disk0[k] for k, v in disk_stage.counts().items()}
    sample(len(ids) + args.decode_steps)
    dev.stop()
    answer = tok.decode(out) if tok is not None else str(out)
    rep = tiered.report_dict(cache)
    decode_ms = 1e3 * float(np.median(times[1:])) if len(times) > 1 else 1e3 * times[0]
    peaks = {
        "accelerator_tier_bytes": max(s["accelerator"] for s in samples),
        "prefill_transient_accelerator_bytes": max(
            [rep["peak_transient_accelerator_bytes"]] + [s["transient"] for s in samples]),
        "device_memory_bytes": (dev.peak - dev.base) if dev.base is not None else None,
        "host_rss_bytes": peak_rss_bytes(),
        "host_rss_at_start": rss0,
        "host_tier_bytes": max(s["host"] for s in samples),
        "disk_bytes": max(s["disk"] for s in samples),
    }
    host_budget = tiered.options.config.parse_bytes(args.host_budget, "host_budget")
    full = geo.full_bytes(len(ids))  # the model-dtype cache a streaming offload moves per step
    streaming_ms = 1e3 * full / (host_bw * 1e9)
    checks = {
        "accelerator tier <= gpu budget (every chunk after the exact window)": all(
            s["accelerator"] <= s["budget"] for s in samples if s["tokens"] > args.prefill_window),
        "block-wise working set <= anchor + 2 chunks of full K/V": all(
            s["transient"] <= geo.layers * geo.kv_heads * geo.full_token_head_bytes
            * (args.anchor + 2 * args.chunk) for s in samples if s["tokens"] > args.prefill_window),
        "host tier <= host budget": peaks["host_tier_bytes"] <= host_budget,
    }
    rows = [["prefill", f"{stats['tokens_per_s']:.1f} tok/s", f"{stats['seconds'] / 60:.1f} min",
             f"host blocks made ahead: {stats.get('blocks_ahead', 0)} of "
             f"{stats.get('blocks_planned', 0)} planned"],
            [f"decode at {len(ids):,} tokens", f"{decode_ms:.0f} ms/token",
             f"first step {times[0]:.1f}s", ""],
            ["accelerator tier (peak, measured from arrays)",
             f"{peaks['accelerator_tier_bytes'] / 2**30:.2f} GiB",
             f"budget {rep.get('budget_bytes', budget_bytes(len(ids))) / 2**30:.2f} GiB at the end",
             checks["accelerator tier <= gpu budget (every chunk after the exact window)"]],
            ["prefill working set (accelerator, apart from the tier)",
             f"{peaks['prefill_transient_accelerator_bytes'] / 2**30:.2f} GiB",
             "exact window, then anchor + local blocks",
             checks["block-wise working set <= anchor + 2 chunks of full K/V"]],
            ["host tier (peak; blocks allocated ahead included)",
             f"{peaks['host_tier_bytes'] / 2**30:.2f} GiB",
             f"budget {host_budget / 2**30:.2f} GiB", checks["host tier <= host budget"]],
            ["host RSS (peak, process)", f"{peaks['host_rss_bytes'] / 2**30:.2f} GiB",
             f"{rss0 / 2**30:.2f} GiB before prefill", ""],
            ["disk tier", f"{peaks['disk_bytes'] / 2**30:.2f} GiB", "", ""],
            ["open files (peak, process)", str(max((s["fds"] or 0) for s in samples)),
             f"limit {resource.getrlimit(resource.RLIMIT_NOFILE)[0]}", ""],
            ["disk chunks read by the CPU (device path, per decode step)",
             f"{disk_read['bytes'] / max(1, args.decode_steps) / 2**20:.1f} MiB",
             f"{disk_read['chunks'] / max(1, args.decode_steps):.0f} chunk-heads in "
             f"{disk_read['layer_steps'] / max(1, args.decode_steps):.0f} layers; the worker "
             f"copying {1e3 * disk_read.get('copy_s', 0) / max(1, args.decode_steps):.1f} "
             f"ms/step, the device waiting for it "
             f"{1e3 * disk_read.get('device_wait_s', 0) / max(1, args.decode_steps):.1f} ms/step"
             f"; rows copied {disk_read.get('copied_rows', 0)} of {disk_read.get('rows', 0)} "
             f"(the rest from the worker's chunk cache); the layers' mailboxes "
             f"{disk_stage.counts()['mailbox_bytes'] / 2**20:.1f} MiB page-locked", ""],
            ["streaming-offload baseline at this length (computed, not run)",
             f"{streaming_ms:.0f} ms/token", f"the whole cache, {full / 1e9:.1f} GB, uploaded every "
             f"step at the measured {host_bw:.1f} GB/s host-to-device", ""]]
    if peaks["device_memory_bytes"] is not None:
        rows.append(["device memory in use (peak, NVML)",
                     f"{peaks['device_memory_bytes'] / 2**30:.2f} GiB", "model weights included", ""])
    md = (f"# One million tokens\n\n`{info['command']}` on {info['platform']} ({info['backend']}, "
          f"{info['device']}, {info['cpu_count']} cores), {info['date']}.\n\nModel {args.model}"
          + (f" (first {args.layers} layers)" if args.layers else "")
          + f": {geo.layers} layers, {geo.q_heads} q / {geo.kv_heads} kv heads, head_dim "
          f"{geo.k_dim}. Document: {len(ids)} tokens of shuffled pydoc_data.topics paragraphs with "
          f"a pass key at 10% depth. gpu_budget {args.budget}, host_budget {args.host_budget} "
          f"({args.host_dtype}{', no host keys' if args.no_host_keys else ''}), chunk {args.chunk}, "
          f"exact window {args.prefill_window}, anchor {args.anchor}.\n\n"
          + md_table(["what", "measured", "against", "within"], rows)
          + f"\nGenerated after the document: {answer!r} (pass key {key}).\n\n"
          + f"![memory over the prefill]({args.name}.png)\n")
    data = {"machine": info, "args": vars(args), "prefill": stats, "decode_ms": decode_ms,
            "host_to_device_gbs": host_bw, "streaming_ms_computed": streaming_ms,
            "decode_step_s": times, "decode_queue_s": queue, "slow_steps": slow, "peaks": peaks,
            "checks": checks, "disk_rows": disk_read,
            "samples": samples, "answer": answer, "key": key, "report": rep}
    paths = write_results(args.name, data, md)
    plot(samples, args, os.path.join(RESULTS, f"{args.name}.png"))
    print(md)
    print("wrote", *paths)
    cache.close()
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
