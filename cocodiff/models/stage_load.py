"""A pipeline stage's share of a checkpoint's transformer, read from its safetensors by name.

Under a plan with pipeline stages (`--plan p2u4`) each rank runs only its stage's blocks
(engine/stages.py), yet `from_pretrained` reads the whole transformer into every rank's host
memory first: 8 ranks of a node each holding FLUX.1-dev's 23.8 GB before the cut. Here the
transformer is built without weights (its parameters on `meta`, its buffers real: accelerate's
`init_empty_weights(include_buffers=False)`, as diffusers builds it), the stage's blocks are found
as the cut finds them (`cache_blocks`, cut by `stage_ranges` over `token_params`), and only the
tensors the stage keeps are read from the checkpoint's files (the parts outside the blocks, which
every stage keeps, and its own blocks), cast as `from_pretrained` casts them. The other stages'
blocks stay on `meta` until the cut takes them out (`engine/parallelize.py` checks that nothing on
`meta` is left).

Only what this reading can do alike `from_pretrained` is read this way: a diffusers transformer in
safetensors (one file or an index of shards) with one transformer (no second expert) and no
quantization config; anything else loads whole, as before (`None`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..engine.cache.steps import cache_blocks
from ..engine.stages import stage_ranges, token_params
from ..errors import UsageError

__all__ = ["load_stage_transformer", "pipeline_folder"]

WEIGHTS = "diffusion_pytorch_model.safetensors"
INDEX = "diffusion_pytorch_model.safetensors.index.json"


def pipeline_folder(model: str) -> Path | None:
    """The local folder of `model` (a folder, or a hub id in the Hugging Face cache); None where
    it is neither (then nothing is read by name)."""
    if Path(model).is_dir():
        return Path(model)
    try:
        from diffusers import DiffusionPipeline

        return Path(DiffusionPipeline.download(model, local_files_only=True))
    except Exception:  # not cached, or not a hub id: the whole load reports it
        return None


def _weight_files(folder: Path) -> dict[str, list[str]] | None:
    """File name -> the tensor names in it, of the transformer's safetensors; None: not that layout."""
    if (folder / INDEX).is_file():
        weight_map = json.loads((folder / INDEX).read_text()).get("weight_map", {})
        files: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            files.setdefault(file, []).append(name)
        return files
    if (folder / WEIGHTS).is_file():
        from safetensors import safe_open

        with safe_open(str(folder / WEIGHTS), framework="pt") as weights:
            return {WEIGHTS: list(weights.keys())}
    return None


def load_stage_transformer(folder: Path, dtype: torch.dtype, stages: int, stage: int) -> tuple[Any, dict[str, Any]] | None:
    """The transformer of the pipeline in `folder` with the tensors stage `stage` of `stages` keeps
    read (in `dtype`, as `from_pretrained(torch_dtype=dtype)` gives them), the rest on `meta`, and
    the record of what was read ({stages, stage, blocks: [start, end), read_bytes: of the files,
    checkpoint_bytes: the transformer's in them}); None where the checkpoint is not one this reads
    by name (it loads whole)."""
    import diffusers
    from accelerate import init_empty_weights
    from safetensors import safe_open

    index = json.loads((folder / "model_index.json").read_text())
    entry = index.get("transformer")
    if not (isinstance(entry, list) and entry[:1] == ["diffusers"]) or "transformer_2" in index:
        return None
    cls = getattr(diffusers, entry[1], None)
    sub = folder / "transformer"
    files = _weight_files(sub)
    config = cls.load_config(sub) if cls is not None else {}
    if cls is None or files is None or config.get("quantization_config") is not None:
        return None
    with init_empty_weights(include_buffers=False):
        model = cls.from_config(config)
    try:
        blocks = cache_blocks(model)
    except UsageError:
        return None  # not cut into stages: the cut refuses it in its own words
    start, end = stage_ranges([token_params(b) for b in blocks], stages)[stage]
    others = {id(p) for i, b in enumerate(blocks) if not start <= i < end for p in b.parameters()}
    wanted = {name for name, p in model.named_parameters() if id(p) not in others}
    wanted |= {name for name, b in model.named_buffers() if name in model.state_dict()}  # persistent buffers
    present = {name for names in files.values() for name in names}
    if not wanted <= present:
        return None  # names that need from_pretrained's conversions
    keep_fp32 = tuple(getattr(cls, "_keep_in_fp32_modules", None) or ())
    tensors: dict[str, torch.Tensor] = {}
    read = total = 0
    for file, names in files.items():
        with safe_open(str(sub / file), framework="pt") as weights:
            for name in names:
                if name not in wanted:  # its size from the header alone
                    piece = weights.get_slice(name)
                    total += torch.Size(piece.get_shape()).numel() * _item_bytes(piece.get_dtype())
                    continue
                tensor = weights.get_tensor(name)
                total += tensor.numel() * tensor.element_size()
                read += tensor.numel() * tensor.element_size()
                if tensor.is_floating_point() and not any(part in keep_fp32 for part in name.split(".")):
                    tensor = tensor.to(dtype)
                tensors[name] = tensor
    model.load_state_dict(tensors, strict=False, assign=True)
    model.register_to_config(_name_or_path=str(folder))
    model.eval()
    record = {"stages": stages, "stage": stage, "blocks": [start, end], "read_bytes": read, "checkpoint_bytes": total}
    return model, record


def _item_bytes(dtype: str) -> int:
    """Bytes per value of a safetensors dtype name ('BF16', 'F32', 'F8_E4M3', ...)."""
    bits = "".join(c for c in dtype.split("_")[0] if c.isdigit())
    return max(1, int(bits or 8) // 8)
