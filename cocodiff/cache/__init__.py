"""Step caches (LOSSY): `--cache SPEC` (spec.py, no torch) and the cache on a transformer's blocks
(steps.py: what is skipped, and how every rank agrees on it)."""

from .spec import CacheSpec, parse_cache, should_skip

__all__ = ["CacheSpec", "parse_cache", "should_skip"]
