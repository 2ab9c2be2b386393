"""Text encoders once: rank 0 encodes the prompt, the other ranks receive the embeddings.

On 2 ranks a preset's run counts its text encoder's calls per rank (1 on rank 0, none on rank
1) and gives the same latents bit for bit as the same run with every rank encoding for itself:
the broadcast moves the very tensors rank 0 computed, and every rank would compute the same.
"""

import contextlib

import pytest
import torch
from conftest import RANK_TIMEOUT_S

from cocodiff import ParallelConfig
from cocodiff.run.launch import spawn


def counted_runs(model: str) -> dict:
    """One run with the prompt encoded once, one with each rank encoding: calls and latents."""
    from cocodiff import parallelize
    from cocodiff.run import load, pipeline
    from cocodiff.run.spec import GenerateSpec

    spec = GenerateSpec(model=model, steps=2, height=32, width=32, parallel=ParallelConfig())
    pipe, encoder = load.load(spec)
    parallel = parallelize(pipe, spec.parallel)
    calls = []

    def counting(*args, **kwargs):
        calls.append(1)
        return encoder(*args, **kwargs)

    pipe.prompt_encoder = counting
    once = pipeline.run_pipeline(spec, pipe, encoder, parallel, decode=False)
    counted = len(calls)
    pipeline.encode_once = lambda *args, **kwargs: contextlib.nullcontext()  # every rank encodes
    each = pipeline.run_pipeline(spec, pipe, encoder, parallel, decode=False)
    return {"calls": counted, "once": once["latents"], "each": each["latents"]}


def test_prompt_encoded_on_rank_0_only():
    ranks = spawn(counted_runs, 2, "tiny-flux", timeout_s=RANK_TIMEOUT_S)
    assert [r["calls"] for r in ranks] == [1, 0]
    for r in ranks:
        assert torch.equal(r["once"], r["each"])


class CheckpointLike:
    """A pipeline as diffusers' DiT pipelines are: `encode_prompt` a method of the class."""

    def __init__(self):
        self.calls = 0

    def encode_prompt(self, prompt, device=None):
        self.calls += 1
        return torch.full((1, 3, 4), float(len(prompt))), None, torch.arange(3)


def checkpoint_encodings() -> dict:
    import torch.distributed as dist

    from cocodiff.engine.encode_once import encode_once

    pipe = CheckpointLike()
    with encode_once(pipe, None, torch.device("cpu")):
        embeds, pooled, ids = pipe.encode_prompt("a cat" if dist.get_rank() == 0 else "ignored")
    return {"calls": pipe.calls, "embeds": embeds, "pooled": pooled, "ids": ids,
            "restored": "encode_prompt" not in vars(pipe)}


def test_checkpoint_encode_prompt_runs_on_rank_0_only():
    ranks = spawn(checkpoint_encodings, 2, timeout_s=RANK_TIMEOUT_S)
    assert [r["calls"] for r in ranks] == [1, 0]
    for r in ranks:  # rank 0's result everywhere, the class's method back after the block
        assert torch.equal(r["embeds"], torch.full((1, 3, 4), 5.0)) and r["pooled"] is None
        assert torch.equal(r["ids"], torch.arange(3)) and r["restored"]


PROMPTS = ["a red circle", "a blue square", "", "two green stars on grey", "a cat"]  # 5: shares of 2 and 3


def split_encodings(model: str) -> dict:
    """A preset's encoder over `PROMPTS` inside `encode_once(split=True)`: prompts per call on this
    rank, the embeddings every rank ends with, and what this rank computes alone for them all."""
    from cocodiff.engine.encode_once import encode_once
    from cocodiff.models.presets import load_pipeline

    pipe, encoder = load_pipeline(model, seed=0)
    seen = []

    def counting(prompts):
        seen.append(len(prompts))
        return encoder(prompts)

    pipe.prompt_encoder = counting
    with torch.no_grad():
        with encode_once(pipe, None, torch.device("cpu"), split=True):
            split = pipe.prompt_encoder(PROMPTS)
            few = pipe.prompt_encoder(PROMPTS[:2])  # a prompt and its negative: rank 0 alone
        alone = encoder(PROMPTS)
    return {"seen": seen, "split": split, "alone": alone, "few": few}


@pytest.mark.slow
def test_many_prompts_split_across_ranks():
    ranks = spawn(split_encodings, 2, "tiny-flux", timeout_s=RANK_TIMEOUT_S)
    assert [r["seen"] for r in ranks] == [[2, 2], [3]]  # rank 0: its share of 2, then both of the pair
    for r in ranks:
        assert len(r["split"]) == len(r["alone"]) == 3
        for got, want, rank0 in zip(r["split"], r["alone"], ranks[0]["split"]):
            assert torch.equal(got, rank0)  # every rank holds the same bits
            # One rank encoding all five: the same within fp32 rounding, not bit for bit (a matmul
            # over 2 or 3 rows rounds differently from one over 5); a wrong or shifted share
            # would differ by the embeddings' own scale (~1).
            assert torch.allclose(got.double(), want.double(), rtol=0, atol=1e-6), (got - want).abs().max()
        assert all(torch.equal(a, b) for a, b in zip(r["few"], ranks[0]["few"]))
