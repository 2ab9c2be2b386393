"""`--lossy-budget`: which wire format `--comm auto` may try, from measured PSNR; never lossy without."""


import command
import pytest
import torch

from cocodiff.distributed.comm.auto import candidates
from cocodiff.config.parallel import ParallelConfig
from cocodiff.errors import UsageError
from cocodiff.config.lossy_budget import lossy_budget
from cocodiff.distributed.topology import Topology


def test_budget_allows_only_formats_that_meet_it():
    assert lossy_budget("tiny-shapes", None) is None
    assert lossy_budget("tiny-shapes", "40dB").fmt == "int8"  # both meet it; int8 measured closer
    assert lossy_budget("tiny-shapes", "55").fmt == "int8"
    assert lossy_budget("tiny-shapes", "70dB").fmt is None and lossy_budget("tiny-shapes", "70dB").wire is None
    with pytest.raises(UsageError, match="no measured PSNR"):
        lossy_budget("some/checkpoint", "40dB")
    with pytest.raises(UsageError, match="not a PSNR"):
        lossy_budget("tiny-shapes", "loud")


def test_auto_adds_lossy_candidates_only_with_a_budget():
    topology = Topology(rank=0, world_size=4, ranks_per_node=2, device=torch.device("cpu"))
    assert not any(c.lossy for c in candidates(topology))
    lossy = [c for c in candidates(topology, lossy=True) if c.lossy]
    assert [c.name for c in lossy] == ["flat+lossy", "flat+vfirst+lossy", "tapa+lossy", "tapa+vfirst+lossy"]
    budget = lossy_budget("tiny-shapes", "40dB")
    assert ParallelConfig(comm="auto", lossy_budget=budget).lossy
    assert not ParallelConfig(comm="auto", lossy_budget=lossy_budget("tiny-shapes", "90dB")).lossy
    with pytest.raises(UsageError, match="--comm auto"):
        ParallelConfig(comm="tapa", lossy_budget=budget)


def test_budget_without_a_figure_is_a_one_line_error():
    run = command.cocodiff("generate", "--model", "tiny-sd3", "--comm", "auto", "--lossy-budget", "40dB", "--nproc", "2",
                           timeout=120)
    assert run.returncode == 2 and run.stderr.strip().count("\n") == 0, run.stderr
    assert "no measured PSNR" in run.stderr and "tiny-sd3" in run.stderr
