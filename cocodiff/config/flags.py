"""Command-line flags that more than one command declares (generate, verify, serve, bench e2e),
defined once so that their choices and help texts cannot drift apart."""

from __future__ import annotations

import argparse
import re

from .choices import CHOICES

__all__ = ["SEED_LIMIT", "STEPS_LIMIT", "add_offload_argument", "add_parallel_vae_argument", "add_shard_weights_argument", "ascii_int"]

SEED_LIMIT = 2**63
"""Seeds are 0 <= seed < SEED_LIMIT: what `torch.manual_seed` and a `torch.Generator` take as a
signed 64-bit number, and what `serve` accepts in a request's `seed`."""

STEPS_LIMIT = 1000
"""The most denoising steps a run takes: the schedulers' 1000 training timesteps (a billion steps
was accepted, warned about and ended by the kernel's OOM killer)."""

_INTEGER = re.compile(r"[+-]?[0-9]+")


def ascii_int(text: str) -> int:
    """An integer flag's value: ASCII digits with an optional sign, nothing else. Python's `int()`
    also takes other scripts' digits ('\uff16\uff14'), underscores ('1_0') and surrounding blanks,
    which a request to `serve` may not use; a flag is held to the same."""
    if not _INTEGER.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer (ASCII digits 0-9, optionally signed)")
    return int(text)



def add_shard_weights_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shard-weights", default="auto", choices=list(CHOICES),
                        help="transformer weights sharded over each node's ranks (FSDP2): 1/N per rank, each block "
                             "gathered just before it runs (exact; not with --compile); auto: on when the activations "
                             "fit only beside sharded weights")


def add_offload_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--offload-text-encoders", default="auto", choices=list(CHOICES),
                        help="text encoders on the host: the rank that encodes streams them to the device layer by "
                             "layer, the other ranks free them (exact); auto: on when the pipeline does not fit "
                             "the device otherwise")


def add_parallel_vae_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--parallel-vae", default="auto", choices=list(CHOICES),
                        help="decode the image (or every frame), and encode an --image input, in bands, one per rank, each "
                             "convolution borrowing a row of the neighbouring bands (exact); auto: for 2D VAEs and the Wan, "
                             "LTX-Video and HunyuanVideo 1.5 VAEs where each band owns at least 2 latent rows")
