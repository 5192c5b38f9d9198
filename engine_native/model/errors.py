"""Why a model path could not be loaded: what every loader, `inspect` and the drivers raise and catch.

No torch here: the gateway, which never loads weights, refuses a bad model path with these too.
"""

from __future__ import annotations


class ModelLoadError(Exception):
    """A model file is missing, malformed or of an unsupported kind; the message names what was found."""


class ModelNotFoundError(ModelLoadError):
    """Nothing exists at the model path."""


class UnsupportedArchitectureError(ModelLoadError):
    """The file is a model, but of an architecture no loader here implements."""
