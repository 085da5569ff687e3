"""ldqa's cache directory: converted weights, assembled packaged models (`model_packages`), bias curves."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """Where ldqa caches what it derives from a model: $LDQA_CACHE_DIR or the platform's user cache dir."""
    env = os.environ.get("LDQA_CACHE_DIR")
    if env:
        return Path(env)
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("ldqa"))
