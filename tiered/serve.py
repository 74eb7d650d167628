"""``tiered serve``: mlx-lm's OpenAI-compatible server (``mlx_lm.server``) with a tiered cache
for every sequence.

Every flag of ``mlx_lm.server`` means what it means there (``--host``, ``--port``,
``--max-tokens``, ``--prompt-cache-size``...), plus ``--gpu-budget`` and ``--options`` for the
caches; ``--model`` defaults to the embedded model. Chat and text completions, streaming and
the server's prompt-cache reuse across requests of the same document work as in mlx-lm: a
request that starts with a document the server has read continues from a copy of its cache
(``usage.prompt_tokens_details.cached_tokens`` says how many tokens it did not read again).

Requests are served one sequence at a time, each with its own tiered cache (mlx-lm batches
requests only over caches that merge, and a compressed layer does not). ``--kv-bits`` is
answered with ``--gpu-budget``. What this changes in mlx-lm is local to the command: its model
provider loads through :func:`tiered.load` and its ``make_prompt_cache`` makes tiered caches.
"""

from __future__ import annotations

import argparse
import sys

import tiered

from .cli_common import cache_options, mlx_cache_flag


def provider_class(base):
    """mlx-lm's ModelProvider loading through tiered.load, one sequence at a time."""

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
            self.is_batchable = False  # each sequence its own tiered cache

    return TieredModelProvider


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

    saved = server.ModelProvider, server.make_prompt_cache, sys.argv
    server.ModelProvider = provider_class(server.ModelProvider)
    server.make_prompt_cache = make_prompt_cache
    sys.argv = ["tiered serve", *rest]
    try:
        server.main()
    finally:
        server.ModelProvider, server.make_prompt_cache, sys.argv = saved
    return 0
