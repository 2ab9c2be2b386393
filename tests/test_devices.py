"""One device per process from the launcher, nodes from host names, `--dtype auto`, the clocks."""

import pytest
import torch
import torch.distributed as dist

from cocodiff import UsageError
from cocodiff.distributed.clock import Clock, clock_name
from cocodiff.distributed.devices import (
    local_rank_from_env,
    process_device,
    ranks_per_node_from_hosts,
)
from cocodiff.models.presets import resolve_dtype
from cocodiff.distributed.topology import Topology


@pytest.mark.parametrize(
    "env, device",
    [
        ({"LOCAL_RANK": "3"}, ("cuda", 3)),  # torchrun
        ({"SLURM_LOCALID": "2"}, ("cuda", 2)),  # srun
        ({"OMPI_COMM_WORLD_LOCAL_RANK": "1"}, ("cuda", 1)),  # Open MPI
        ({"PALS_LOCAL_RANKID": "5", "LOCAL_RANK": ""}, ("cuda", 5)),  # Aurora's mpiexec
        ({"LOCAL_RANK": "1", "SLURM_LOCALID": "7"}, ("cuda", 1)),  # torchrun's wins
        ({"SLURM_LOCALID": "6"}, ("cuda", 0)),  # one visible device: the launcher bound it
    ],
)
def test_the_device_comes_from_the_launchers_local_rank(env, device):
    count = 1 if device == ("cuda", 0) else 8
    assert process_device(env, kind="cuda", count=count) == torch.device(*device)


def test_no_local_rank_with_several_devices_is_one_clear_error():
    with pytest.raises(UsageError, match="no local rank: none of LOCAL_RANK, SLURM_LOCALID.* 4 cuda devices"):
        process_device({"RANK": "3"}, kind="cuda", count=4)
    with pytest.raises(UsageError, match="LOCAL_RANK=4 but only 4 xpu devices"):
        process_device({"LOCAL_RANK": "4"}, kind="xpu", count=4)
    with pytest.raises(UsageError, match="SLURM_LOCALID='x' is not a local rank"):
        local_rank_from_env({"SLURM_LOCALID": "x"})


def test_emulated_clusters_and_cpu_machines_run_on_the_cpu():
    assert process_device({"COCODIFF_DEVICE": "cpu", "LOCAL_RANK": "1"}) == torch.device("cpu")
    assert process_device({"LOCAL_RANK": "1"}) == torch.device("cpu")  # this machine has no accelerator


def test_nodes_come_from_host_names():
    assert ranks_per_node_from_hosts(["a", "a", "b", "b"]) == 2
    assert ranks_per_node_from_hosts(["a"] * 8) == 8
    with pytest.raises(UsageError, match=r"nodes of unequal size \(a: 3, b: 1 ranks\)"):
        ranks_per_node_from_hosts(["a", "a", "a", "b"])
    with pytest.raises(UsageError, match=r"not numbered node by node: host a has ranks \[0, 2\]"):
        ranks_per_node_from_hosts(["a", "b", "a", "b"])


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_one_rank_group_never_stands_for_the_world(fake_world):
    """`group=None` means the whole world to torch: a plan's one-rank Ulysses group has no group."""
    from cocodiff.config.plan import parse_plan

    groups = Topology.from_env(ranks_per_node=4, device=torch.device("cpu")).split(parse_plan("u1r8"))
    assert groups.ulysses.world_size == 1
    with pytest.raises(RuntimeError, match="one-rank group has no process group"):
        groups.ulysses.world_group
    # The whole run's topology of one process keeps the default group.
    assert Topology.single(torch.device("cpu")).world_group is None


@pytest.mark.parametrize(
    "name, model, device, ran",
    [
        ("auto", "black-forest-labs/FLUX.1-dev", "cuda", "bfloat16"),  # a checkpoint on a GPU: bf16, no flag
        ("auto", "Qwen/Qwen-Image", "xpu", "bfloat16"),
        ("auto", "black-forest-labs/FLUX.1-dev", "cpu", "float32"),
        ("auto", "tiny-shapes", "cuda", "float32"),  # the presets are trained and checked in fp32
        ("float16", "tiny-flux", "cpu", "float16"),
    ],
)
def test_dtype_auto(name, model, device, ran):
    assert resolve_dtype(name, model, torch.device(device)) == ran


def test_clocks_name_themselves():
    assert clock_name(torch.device("cpu")) == "host perf_counter"
    assert clock_name(torch.device("cuda", 0)) == "cuda events and synchronized host clock"
    clock = Clock()
    start = clock.mark()
    assert not clock.on_device and clock.seconds(start, clock.mark()) >= 0


def test_bench_host_times_each_exchange_with_and_without_counting():
    from cocodiff.bench.host import host_cost

    rows = host_cost(4, calls=5)
    assert [(r["exchange"], r["counting"]) for r in rows] == [("flat", False), ("flat", True), ("tapa", False), ("tapa", True)]
    assert all(r["us_per_call"] > 0 for r in rows)


def test_bench_host_times_v_majors_selective_exchange():
    from cocodiff.bench.host import v_major_cost

    rows = v_major_cost(4, calls=2)
    assert [(r["exchange"], r["v_major"], r["device"]) for r in rows] == [("flat", "constant:0.5", "meta"), ("tapa", "constant:0.5", "meta")]
    assert all(r["us_per_call"] > 0 for r in rows)
