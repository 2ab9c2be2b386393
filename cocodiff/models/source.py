"""Where a `--model` comes from, settled before any rank starts.

A preset, a local folder (with model_index.json), or a hub id. A hub id is fetched once here
with diffusers' own `DiffusionPipeline.download` - the files `from_pretrained` reads, nothing
more - which takes them from the Hugging Face cache when they are there, and downloads them
otherwise unless `HF_HUB_OFFLINE` is set. The ranks then load from the cache. A hub id that is
in neither place is one line (`UsageError`), not a traceback from every rank.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from ..errors import UsageError

__all__ = ["resolve_model"]


def _root_cause(error: BaseException) -> str:
    """The first line of the innermost error behind `error` (diffusers wraps the hub's)."""
    while (error.__cause__ or error.__context__) is not None:
        error = error.__cause__ or error.__context__  # type: ignore[assignment]
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def resolve_model(model: str) -> None:
    """Check that `model` can be loaded by every rank; fetch a hub id into the local cache."""
    from .presets import PRESETS, check_model

    check_model(model)  # a preset, a folder with model_index.json, or shaped like a hub id
    if model in PRESETS or Path(model).is_dir():
        return
    from diffusers import DiffusionPipeline
    from huggingface_hub import constants

    offline = constants.HF_HUB_OFFLINE
    hub_log = logging.getLogger("huggingface_hub")
    level = hub_log.level
    if offline:  # "could not reach the Hub" is no news when it was asked not to
        hub_log.setLevel(logging.ERROR)
    try:
        DiffusionPipeline.download(model)
    except Exception as error:  # what the hub raises varies: OSError, HfHubHTTPError, ValueError, ...
        setting = f"HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE', '')}" if offline else "online"
        where = f"{setting}, cache {constants.HF_HUB_CACHE}"
        if offline:
            raise UsageError(f"--model {model}: not a preset, not a local folder, and not in the Hugging Face cache "
                             f"({where})") from None
        raise UsageError(f"--model {model}: not a preset, not a local folder, not in the Hugging Face cache, and "
                         f"not downloadable ({_root_cause(error)}; {where})") from None
    finally:
        hub_log.setLevel(level)


