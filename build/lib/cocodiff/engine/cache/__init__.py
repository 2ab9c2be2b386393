"""Step caches (LOSSY): `--cache SPEC` (spec.py, no torch) and the cache on a transformer's blocks
(steps.py: what is skipped, and how every rank agrees on it), with each kind's signal beside it:
TaylorSeer's extrapolation (taylor.py), TeaCache's modulated input (teacache.py), MagCache's
calibrated curve (magcache.py)."""

from cocodiff.config.cache import CacheSpec, parse_cache, should_skip

__all__ = ["CacheSpec", "parse_cache", "should_skip"]
