"""Every `COCODIFF_*` variable, in one table: who sets it and who reads it.

A launcher (`cocodiff generate`'s spawner, `cluster run`, the tests) hands a rank its setting
through these variables; the names live here so that setter and reader cannot drift apart.
Torch-free: `cluster` reads it without loading torch.

| variable | set by | read by |
|---|---|---|
| `COCODIFF_DEVICE` | the user, `cluster run`, the spawner | `distributed.devices` |
| `COCODIFF_HOST` | `cluster run` | `distributed.devices` |
| `COCODIFF_LEVELS` | `cluster run`, the spawner (`--levels`) | `distributed.topology` |
| `COCODIFF_PROGRESS_DIR` | the launchers | `run.lifetime` (each rank's step) |
| `COCODIFF_FABRIC` | `cluster run` | every report (`bench`, `generate --json`) |
| `COCODIFF_COMPILE_BACKEND` | the user, the tests | `engine.compile` |
| `COCODIFF_CACHE_DIR` | the user | `engine.cache.magcache` (calibrated curves) |
| `COCODIFF_PLUGINS` | the user, the tests | `models.presets` (modules adding presets and families) |
| `COCODIFF_CLUSTER_PREFIX` | the user, the tests | `cluster.fabric` (namespace names) |
| `COCODIFF_CLUSTER_STATE` | the user, the tests | `cluster.netns` (the state file) |
"""

from __future__ import annotations

__all__ = [
    "CACHE_DIR_ENV", "CLUSTER_PREFIX_ENV", "CLUSTER_STATE_ENV", "COMPILE_BACKEND_ENV", "DEVICE_ENV", "FABRIC_ENV",
    "HOST_ENV", "LEVELS_ENV", "LOCAL_RANK_ENVS", "PLUGINS_ENV", "PROGRESS_ENV",
]

DEVICE_ENV = "COCODIFF_DEVICE"
"""`cpu` runs this process on the CPU (gloo) whatever accelerators the machine has."""
HOST_ENV = "COCODIFF_HOST"
"""The node this process counts as on (an emulated cluster's node); unset: the host name."""
LOCAL_RANK_ENVS = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "PALS_LOCAL_RANKID",
                   "MPI_LOCALRANKID", "PMI_LOCAL_RANK")
"""Where launchers put the rank's index on its node, tried in this order (not ours: the launchers')."""
LEVELS_ENV = "COCODIFF_LEVELS"
"""The launcher's levels, in `--levels` form (config.levels)."""
PROGRESS_ENV = "COCODIFF_PROGRESS_DIR"
"""Folder in which each rank records its denoising step as `RANK.step` (set by the launcher)."""
FABRIC_ENV = "COCODIFF_FABRIC"
"""Names the fabric in every report of a command run inside the cluster."""
COMPILE_BACKEND_ENV = "COCODIFF_COMPILE_BACKEND"
"""torch.compile's backend for `compile` (default inductor; `eager` or `aot_eager` trace only)."""
CACHE_DIR_ENV = "COCODIFF_CACHE_DIR"
"""Where MagCache keeps the curves it calibrated (default: the user's cache folder)."""
PLUGINS_ENV = "COCODIFF_PLUGINS"
"""Modules (comma-separated) imported with the presets, in every process: each may add presets
(`models.presets.PRESETS`) and the families of their transformers (`engine.families.FAMILIES`)."""
CLUSTER_PREFIX_ENV = "COCODIFF_CLUSTER_PREFIX"
"""The prefix of an emulated cluster's namespaces and links (default `cdf-`)."""
CLUSTER_STATE_ENV = "COCODIFF_CLUSTER_STATE"
"""The file that records an emulated cluster while it is up."""
