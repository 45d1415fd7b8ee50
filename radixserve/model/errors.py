"""The one exception the model package raises for anything a user can get wrong."""

from __future__ import annotations


class ModelLoadError(RuntimeError):
    """A model could not be loaded: missing package or file, unsupported architecture,
    bad config, missing or mis-shaped tensor. The message names the problem and, where
    there is one, the fix; callers print it instead of a stack trace."""
