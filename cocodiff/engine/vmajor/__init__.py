"""V-Major (lossy): on inter-node links, send only the tokens whose projections changed most.

    config/vmajor.py  `Schedule`, `parse_schedule`: how many tokens are reused at each step (no torch)
    state.py     `VMajor`: the step, the ratio in force, mirrors and caches; `select_tokens`
                 (one top-k for all the pieces of an exchange call)
    codec.py     `VMajorCodec`: the index+rows codec the flat and TAPA exchanges call for their
                 inter-node pieces (the `comm.codec.SlowPhaseCodec` of V-Major)

`parallelize` builds one `VMajor` per transformer and hands its codec to the exchange; `comm/`
knows only that an exchange may have a codec for its slow phase. The schedule names are imported
eagerly (`ParallelConfig` parses its schedule without loading torch); the rest on first use.
"""

from typing import Any

from cocodiff.config.vmajor import Schedule, parse_schedule

__all__ = ["Schedule", "VMajor", "VMajorCodec", "parse_schedule", "select_tokens"]


def __getattr__(name: str) -> Any:
    if name in ("VMajor", "select_tokens"):
        from . import state

        return getattr(state, name)
    if name == "VMajorCodec":
        from .codec import VMajorCodec

        return VMajorCodec
    raise AttributeError(f"module 'cocodiff.engine.vmajor' has no attribute {name!r}")
