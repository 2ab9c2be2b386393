"""Shared test set-up: quiet libraries, one thread per process (ranks share 2 cores)."""

import os

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")

import torch  # noqa: E402

torch.set_num_threads(1)

# Every multi-process test runs under this limit: a hung collective fails the test instead of CI.
RANK_TIMEOUT_S = 120
