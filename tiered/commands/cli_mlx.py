"""``tiered generate`` and ``tiered cache-prompt``: mlx-lm's commands with a tiered cache.

The flags are mlx-lm's own (its ``setup_arg_parser``, so ``--prompt``/``-``, ``--max-tokens``,
``--temp``, ``--system-prompt``, ``--prompt-cache-file``... mean what they mean there) plus
``--gpu-budget`` and ``--options``; ``--model`` defaults to the embedded model. mlx-lm's cache
flags ``--kv-bits`` and ``--max-kv-size`` are answered with what tiered does instead.

- ``tiered cache-prompt --prompt-cache-file doc.safetensors --prompt - < doc.txt`` reads a
  document once into a tiered cache and saves it (a ``.safetensors`` file, or a directory for a
  cache with a disk tier: :mod:`tiered.persistence.save_file`), as ``mlx_lm.cache_prompt`` does;
- ``tiered generate --prompt-cache-file doc.safetensors --prompt "Who ...?"`` asks on top of it
  (the prompt is the suffix of the saved chat turn, as in ``mlx_lm.generate``); without
  ``--prompt-cache-file`` it reads the prompt into a new tiered cache and answers.
"""

from __future__ import annotations

import sys
import time

import mlx.core as mx

import tiered

from ..persistence import save_file
from .cli_common import UsageError, cache_options, check_model_path, load_model, mlx_cache_flag

QUERY = "<query>"


def _add_tiered_flags(p):
    p.add_argument("--gpu-budget", default=None,
                   help="tiered: accelerator budget, a fraction of the full cache or a size "
                        "like 2GB (default 0.125)")
    p.add_argument("--options", default=None,
                   help="tiered: extra TieredConfig options as JSON, e.g. '{\"tau\": 0.95}'")
    p.set_defaults(model=None)


def generate_parser():
    from mlx_lm.generate import setup_arg_parser

    p = setup_arg_parser()
    p.prog, p.description = "tiered generate", "mlx_lm.generate with a tiered KV cache."
    _add_tiered_flags(p)
    return p


def cache_prompt_parser():
    from mlx_lm.cache_prompt import setup_arg_parser

    p = setup_arg_parser()
    p.prog, p.description = "tiered cache-prompt", "mlx_lm.cache_prompt with a tiered KV cache."
    _add_tiered_flags(p)
    return p


def _refuse_mlx_cache_flags(args, unsupported=()):
    for flag, value in (("--kv-bits", args.kv_bits), ("--max-kv-size", args.max_kv_size)):
        if value is not None:
            raise mlx_cache_flag(flag)
    for flag, attr in unsupported:
        if getattr(args, attr, None):
            raise UsageError(f"{flag} is not supported with a tiered cache; use mlx_lm directly")


def _prompt_text(args) -> str:
    text = args.prompt.replace("\\n", "\n").replace("\\t", "\t")
    return sys.stdin.read() if text == "-" else text


def cmd_generate(args) -> int:
    from mlx_lm.generate import generate
    from mlx_lm.sample_utils import make_sampler

    _refuse_mlx_cache_flags(args, (("--draft-model", "draft_model"), ("--image", "image")))
    if args.prompt_cache_file:
        try:
            save_file.check(args.prompt_cache_file)
        except (ValueError, OSError) as e:
            raise UsageError(str(e)) from None
    opts = cache_options(args.options, args.gpu_budget)
    check_model_path(args.model)
    if args.seed is not None:
        mx.random.seed(args.seed)
    model, tokenizer = load_model(args.model)
    prompt = _prompt_text(args)
    using_cache = args.prompt_cache_file is not None
    if not args.ignore_chat_template and getattr(tokenizer, "chat_template", None):
        messages = [] if args.system_prompt is None else [
            {"role": "system", "content": args.system_prompt}]
        messages.append({"role": "user", "content": prompt})
        prompt = tokenizer.apply_chat_template(messages, tokenize=False,
                                               add_generation_prompt=True)
        if using_cache:  # the saved turn holds the prefix: ask with its suffix (as mlx-lm)
            messages[-1]["content"] = QUERY
            test = tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=True)
            prompt = prompt[test.index(QUERY):]
        ids = tokenizer.encode(prompt, add_special_tokens=False)
    else:
        ids = tokenizer.encode(prompt)
    if using_cache:
        try:
            cache = tiered.TieredCacheList.load(args.prompt_cache_file, model, **{
                k: v for k, v in opts.items() if k != "gpu_budget"})
        except ValueError as e:
            raise UsageError(str(e)) from None
    else:
        cache = tiered.TieredCache.for_model(model, tokenizer=tokenizer,
                                             **opts)
    sampler = make_sampler(args.temp, args.top_p, args.min_p, args.min_tokens_to_keep,
                           top_k=args.top_k)
    try:
        text = generate(model, tokenizer, ids, max_tokens=args.max_tokens, verbose=args.verbose,
                        sampler=sampler, prompt_cache=cache,
                        prefill_step_size=args.prefill_step_size)
    finally:
        cache.close()
    if not args.verbose:
        print(text)
    return 0


def cmd_cache_prompt(args) -> int:
    from mlx_lm.generate import generate_step

    _refuse_mlx_cache_flags(args)
    opts = cache_options(args.options, args.gpu_budget)
    check_model_path(args.model)
    try:
        save_file.check_save(args.prompt_cache_file)
    except (ValueError, OSError) as e:
        raise UsageError(str(e)) from None
    model, tokenizer = load_model(args.model)
    text = _prompt_text(args)
    if getattr(tokenizer, "chat_template", None):  # a user turn left open, as mlx-lm's
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=False,
                                            continue_final_message=True)
    else:
        ids = tokenizer.encode(text)
    cache = tiered.TieredCache.for_model(model, tokenizer=tokenizer,
                                         **opts)
    start = time.time()

    def progress(done, total):
        rate = done / max(time.time() - start, 1e-9)
        print(f"\rProcessed {done:6d} of {total} tokens ({rate:6.1f} tok/s)", end="",
              file=sys.stderr, flush=True)

    try:
        for _ in generate_step(mx.array(ids), model, max_tokens=0, prompt_cache=cache,
                               prompt_progress_callback=progress):
            pass
        print(file=sys.stderr)
        path = cache.save(args.prompt_cache_file, model)
    except ValueError as e:
        raise UsageError(str(e)) from None
    finally:
        cache.close()
    print(f"saved {len(ids)} tokens to {path}", file=sys.stderr)
    return 0
