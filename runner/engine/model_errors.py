"""The error of a model that cannot be loaded, shared by the loader and the builtin registry."""


class ModelLoadError(RuntimeError):
    """A model that cannot be loaded; the message names it and says what to do."""
