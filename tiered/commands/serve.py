"""``tiered serve``: mlx-lm's OpenAI-compatible server (``mlx_lm.server``) with a tiered cache
for every sequence.

Every flag of ``mlx_lm.server`` means what it means there (``--host``, ``--port``,
``--max-tokens``, ``--prompt-cache-size``...), plus ``--gpu-budget`` and ``--options`` for the
caches; ``--model`` defaults to the embedded model. Chat and text completions, streaming and
the server's prompt-cache reuse across requests of the same document work as in mlx-lm: a
request that starts with a document the server has read continues from a copy of its cache
(``usage.prompt_tokens_details.cached_tokens`` says how many tokens it did not read again).

A request whose prompt and ``max_tokens`` stay below the length at which the caches would
compress (:meth:`tiered.planning.context.SharedContext.first_compressed_length`) is batched as
mlx-lm's server batches it, in mlx-lm's own exact caches; a longer one (or one mlx-lm serves
alone: a seed, images) is served alone with a tiered cache (mlx-lm batches only caches that
merge, and a compressed layer does not). The server's prompt-cache reuse keeps the two kinds
apart: a batched request continues only from an exact cache, a tiered one only from a tiered
cache.
Each request's route is logged. ``--kv-bits`` is answered with ``--gpu-budget``. What this
changes in mlx-lm is local to the command: its model provider loads through
:func:`tiered.load`, its response generator routes requests as above and its
``make_prompt_cache`` makes tiered caches.
"""

from __future__ import annotations

import argparse
import logging
import sys

import tiered

from .cli_common import cache_options, mlx_cache_flag

log = logging.getLogger("tiered.commands.serve")


def provider_class(base, opts: dict):
    """mlx-lm's ModelProvider loading through tiered.load; ``exact_below``: the length from
    which a sequence gets a tiered cache (None: never), from the caches ``opts`` make."""

    class TieredModelProvider(base):
        def _load(self, model_path, adapter_path=None, draft_model_path=None):
            if adapter_path is not None or draft_model_path is not None:
                raise ValueError("tiered serve: adapters and draft models are not supported")
            self.reset()
            model, tokenizer = tiered.load(model_path)
            if self.cli_args.use_default_chat_template and tokenizer.chat_template is None:
                tokenizer.chat_template = tokenizer.default_chat_template
            self.model_key = (model_path, adapter_path, draft_model_path)
            self.model, self.tokenizer = model, tokenizer
            self.processor, self.draft_model = None, None
            from mlx_lm.models.cache import make_prompt_cache

            # what mlx-lm's batches hold: its own caches, where they merge
            self.is_batchable = all(hasattr(c, "merge") for c in make_prompt_cache(model))
            caches = tiered.TieredCache.for_model(model, **opts)  # asked, then closed
            try:
                self.exact_below = caches[0].context.first_compressed_length() if caches else None
            finally:
                caches.close()

    return TieredModelProvider


def generator_class(base):
    """mlx-lm's ResponseGenerator batching the requests that stay exact (module docstring)."""

    class TieredResponseGenerator(base):
        def _next_request(self, timeout=None):
            got = super()._next_request(timeout)
            if got is not None:
                self._route(*got)
            return got

        def _route(self, rqueue, request, args):
            """Note on ``args`` whether the request may compress (prompt + max_tokens)."""
            provider = self.model_provider
            limit, n = None, None
            try:  # before the first request: its model (mlx-lm loads it next anyway)
                if provider.model is None:
                    provider.load(args.model.model, args.model.adapter, args.model.draft)
                limit = provider.exact_below
                if limit is not None:
                    n = len(self._tokenize(provider.tokenizer, request, args)[0])
            except Exception:  # noqa: BLE001 (the server answers it when it loads, tokenizes)
                limit = limit or 1  # served alone, where the error is reported
            long = limit is not None and (n is None or n + args.max_tokens >= limit)
            args.tiered_long = long
            log.info("tiered serve: a request of %s prompt tokens, max_tokens %d: %s", n,
                     args.max_tokens, "a tiered cache, served alone" if long
                     else f"stays exact (below {limit} tokens): batched as mlx-lm batches")

        def _is_batchable(self, args):
            ok = super()._is_batchable(args) and not getattr(args, "tiered_long", True)
            self.prompt_cache.tiered_wanted = not ok  # the fetch that follows this choice
            return ok

    return TieredResponseGenerator


def prompt_cache_class(base):
    """mlx-lm's LRUPromptCache that hands out only caches of the kind the request runs on."""

    class KindPromptCache(base):
        tiered_wanted = True

        def fetch_nearest_cache(self, model, tokens):
            cache, rest = super().fetch_nearest_cache(model, tokens)
            if cache is not None:
                tiered_cache = any(isinstance(c, tiered.TieredCache) for c in cache)
                if tiered_cache != self.tiered_wanted:
                    return None, tokens
            return cache, rest

    return KindPromptCache


def main(argv: list[str]) -> int:
    import mlx_lm.server as server

    p = argparse.ArgumentParser(prog="tiered serve", add_help=False)
    p.add_argument("--gpu-budget", default=None)
    p.add_argument("--options", default=None)
    ours, rest = p.parse_known_args(argv)
    if any(a == "--kv-bits" or a.startswith("--kv-bits=") for a in rest):
        raise mlx_cache_flag("--kv-bits")
    opts = cache_options(ours.options, ours.gpu_budget)

    def make_prompt_cache(model, max_kv_size=None):
        return tiered.TieredCache.for_model(model, **opts)

    names = ("ModelProvider", "ResponseGenerator", "LRUPromptCache", "make_prompt_cache")
    saved = [getattr(server, k) for k in names] + [sys.argv]
    server.ModelProvider = provider_class(server.ModelProvider, opts)
    server.ResponseGenerator = generator_class(server.ResponseGenerator)
    server.LRUPromptCache = prompt_cache_class(server.LRUPromptCache)
    server.make_prompt_cache = make_prompt_cache
    sys.argv = ["tiered serve", *rest]
    try:
        server.main()
    finally:
        for k, v in zip(names, saved):
            setattr(server, k, v)
        sys.argv = saved[-1]
    return 0
