"""Text encoders once: rank 0 encodes the prompt, the other ranks receive the embeddings.

On 2 ranks a preset's run counts its text encoder's calls per rank (1 on rank 0, none on rank
1) and gives the same latents bit for bit as the same run with every rank encoding for itself:
the broadcast moves the very tensors rank 0 computed, and every rank would compute the same.
Many prompts split across the ranks are encoded on every rank at once, and an encoder that raises
on one rank makes every rank raise at once, naming it, instead of leaving its peers in a broadcast.
"""

import contextlib
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import RANK_TIMEOUT_S, patience

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


QUICK_S = patience(2.5)
"""How long a rank waits for its peer to start encoding, and the most a failure may take to reach
every rank: a few seconds on a quiet machine, far below `GROUP_TIMEOUT_S`."""

GROUP_TIMEOUT_S = patience(7.5)
"""The process group's timeout in the failure tests: a rank left in a broadcast waits this long."""


def lengths(prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """A stand-in encoder, batched by prompt: (n, 1) characters and (n, 2) characters and spaces."""
    return (torch.tensor([[float(len(p))] for p in prompts]),
            torch.tensor([[len(p), p.count(" ")] for p in prompts]))


def meet(folder: str, mark: str) -> bool:
    """This rank of 2 leaves `mark` in `folder` and waits (`QUICK_S` at most) for the other's:
    whether it came, outside any collective."""
    import torch.distributed as dist

    rank = dist.get_rank()
    (Path(folder) / f"{mark}-{rank}").touch()
    peer, deadline = Path(folder) / f"{mark}-{1 - rank}", time.monotonic() + QUICK_S
    while not peer.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return peer.exists()


def meeting_encodings(folder: str) -> dict:
    """`PROMPTS` split over 2 ranks, each rank's encoder meeting the other's (`meet`) before it
    returns: whether they met, and the embeddings."""
    import torch.distributed as dist

    from cocodiff.engine.encode_once import encode_once

    met = []

    def encoder(prompts):
        met.append(meet(folder, "encoding"))
        return lengths(prompts)

    pipe = SimpleNamespace(prompt_encoder=encoder)
    dist.barrier()  # both ranks reach the encoder together: only the split's order can keep one away
    with encode_once(pipe, None, torch.device("cpu"), split=True):
        embeds = pipe.prompt_encoder(PROMPTS)
    return {"met": met, "embeds": embeds}


def test_split_shares_are_encoded_on_every_rank_at_once(tmp_path):
    ranks = spawn(meeting_encodings, 2, str(tmp_path), timeout_s=RANK_TIMEOUT_S)
    assert [r["met"] for r in ranks] == [[True], [True]]  # each rank's encoder ran while the other's did
    for r in ranks:
        assert all(torch.equal(got, want) for got, want in zip(r["embeds"], lengths(PROMPTS), strict=True))


def failing_encodings(folder: str, split: bool, failing: int) -> dict:
    """Prompts encoded inside `encode_once` (`PROMPTS` split over the ranks, or a prompt and its
    negative on rank 0) with the encoder raising on rank `failing`: what this rank raised, how soon.

    Each rank then stays until the other is done too (`meet`), as a serving rank would: a peer must
    learn of the failure from the failing rank, not from its sockets closing as it exits."""
    import torch.distributed as dist

    from cocodiff.engine.encode_once import encode_once

    def encoder(prompts):
        if dist.get_rank() == failing:
            raise ValueError(f"no room for {len(prompts)} prompts\n(a second line)")
        return lengths(prompts)

    pipe = SimpleNamespace(prompt_encoder=encoder)
    dist.barrier()
    start = time.monotonic()
    with encode_once(pipe, None, torch.device("cpu"), split=split):
        try:
            pipe.prompt_encoder(PROMPTS if split else PROMPTS[:2])
        except Exception as error:  # noqa: BLE001 - recorded, then asserted by the test
            raised = {"error": type(error).__name__, "message": str(error), "s": time.monotonic() - start,
                      "cause": type(error.__cause__).__name__}
        else:
            raised = {"error": None}
    meet(folder, "done")
    return raised


@pytest.mark.parametrize("split, failing, prompts", [(True, 1, 3), (False, 0, 2)], ids=["split", "one-rank"])
def test_an_encoder_failing_on_one_rank_fails_every_rank_at_once(tmp_path, split, failing, prompts):
    ranks = spawn(failing_encodings, 2, str(tmp_path), split, failing, timeout_s=GROUP_TIMEOUT_S)
    for rank, r in enumerate(ranks):
        assert r["error"] == "RunFailed", r
        assert r["message"] == f"encoding prompts failed on rank {failing} (ValueError: no room for {prompts} prompts)"
        assert r["s"] < QUICK_S, r  # not left in a broadcast until the group's timeout
        assert r["cause"] == ("ValueError" if rank == failing else "NoneType")  # the failing rank chains its own
