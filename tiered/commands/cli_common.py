"""What every tiered command shares: its one-line usage error and the model's checks."""

from __future__ import annotations

import json
import os

import tiered


class UsageError(Exception):
    """A problem with the command line or its inputs: one line, exit code 2."""


def check_model_path(model: str | None) -> None:
    """A --model that names a local path (absolute, ./, ../ or ~) must be a directory."""
    if model is None:
        return
    local = os.path.isabs(model) or model.startswith((".", "~"))
    if local and not os.path.isdir(os.path.expanduser(model)):
        raise UsageError(f"model not found: {model}; give an mlx-lm model directory, a Hugging "
                         "Face repo id (org/name), or leave --model out for the embedded model")


def load_model(name: str | None):
    """tiered.load with its failures as one line naming the fix."""
    try:
        return tiered.load(name)
    except (OSError, ValueError) as e:  # huggingface_hub's errors are both
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"cannot load the model {name!r}: {first} (give an mlx-lm model "
                         "directory, a repo id already in the Hugging Face cache, or leave "
                         "--model out for the embedded model)") from None


def json_options(text: str | None) -> dict:
    """``--options``: a JSON object of TieredConfig options (empty when not given)."""
    try:
        opts = json.loads(text) if text else {}
    except json.JSONDecodeError as e:
        raise UsageError(f"--options is not valid JSON ({e.msg} at character {e.pos}): "
                         f"{text!r}") from None
    if not isinstance(opts, dict):
        raise UsageError(f"--options must be a JSON object, e.g. '{{\"tau\": 0.95}}'; got "
                         f"{text!r}")
    return opts


def cache_options(text: str | None, gpu_budget: str | None) -> dict:
    """``--options`` and ``--gpu-budget`` as checked TieredConfig options (gpu_budget 0.125
    unless given)."""
    opts = {"gpu_budget": 0.125, **json_options(text)}
    if gpu_budget is not None:
        opts["gpu_budget"] = gpu_budget
    try:
        tiered.TieredConfig.from_kwargs(**opts)
    except (TypeError, ValueError) as e:
        raise UsageError(str(e)) from None
    return opts


def mlx_cache_flag(flag: str) -> UsageError:
    """The answer to mlx-lm's ``--kv-bits`` / ``--max-kv-size``: what tiered does instead."""
    return UsageError(f"{flag} is mlx-lm's; tiered keeps every token and compresses the keys "
                      "itself: set how much stays on the accelerator with --gpu-budget (e.g. "
                      f"0.125) and drop {flag}")
