"""What every tiered command shares: its one-line usage error and the model's checks."""

from __future__ import annotations

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
