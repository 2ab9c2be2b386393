"""Where a `--model` comes from, settled before any rank starts.

A preset, a local folder (with model_index.json), or a hub id. A hub id is fetched once here
with diffusers' own `DiffusionPipeline.download` - the files `from_pretrained` reads, nothing
more - which takes them from the Hugging Face cache when they are there, and downloads them
otherwise unless `HF_HUB_OFFLINE` is set. The ranks then load from the cache. A hub id that is
in neither place is one line (`UsageError`), not a traceback from every rank.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from ..errors import UsageError

__all__ = ["check_folder", "resolve_model"]


def _root_cause(error: BaseException) -> str:
    """The first line of the innermost error behind `error` (diffusers wraps the hub's)."""
    while (error.__cause__ or error.__context__) is not None:
        error = error.__cause__ or error.__context__  # type: ignore[assignment]
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def check_folder(path: Path) -> None:
    """A pipeline folder's model_index.json and the configs it names are whole, as `footprint`
    reads them: the index a JSON object naming its pipeline class and a transformer, each
    component it lists a subfolder whose JSON files parse. One line (`UsageError`) otherwise,
    before any rank tries `from_pretrained` on it."""
    index_path = path / "model_index.json"
    try:
        index = json.loads(index_path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise UsageError(f"--model {path}: its model_index.json could not be read ({error})") from None
    if not isinstance(index, dict) or not isinstance(index.get("_class_name"), str):
        raise UsageError(f"--model {path}: its model_index.json names no pipeline class (_class_name)")
    if "transformer" not in index:
        raise UsageError(f"--model {path}: its model_index.json lists no transformer (CoCoDiff runs DiT pipelines)")
    for name, entry in index.items():
        if name.startswith("_") or not isinstance(entry, list) or entry[:1] == [None]:
            continue  # settings, and components left out ([null, null])
        if len(entry) != 2 or not all(isinstance(part, str) for part in entry):
            raise UsageError(f"--model {path}: model_index.json's {name!r} is {entry!r}, not [library, class]")
        folder = path / name
        if not folder.is_dir():
            raise UsageError(f"--model {path}: model_index.json lists {name} ({entry[1]}), but the folder has no {name}/")
        for config in sorted(folder.glob("*.json")):
            try:
                json.loads(config.read_text())
            except (OSError, UnicodeDecodeError, ValueError) as error:
                raise UsageError(f"--model {path}: {name}/{config.name} could not be read ({error})") from None


def resolve_model(model: str) -> None:
    """Check that `model` can be loaded by every rank; fetch a hub id into the local cache."""
    from .presets import PRESETS, check_model

    check_model(model)  # a preset, a folder with model_index.json, or shaped like a hub id
    if model in PRESETS:
        return
    if Path(model).is_dir():
        check_folder(Path(model))
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


