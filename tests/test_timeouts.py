"""No hang, no orphan: bounded waits on peers, one-line failures, ranks that die with their launcher.

A peer that never sends makes the exchange fail within `--timeout` with one line naming the
collective, the layer, the step and the missing peer; a rank killed mid-run is named with its
signal and step; a launcher that is terminated or killed takes its ranks with it (the emulated
cluster's version of both lives in test_cluster.py).
"""

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import RANK_TIMEOUT_S, patience
from rank_watch import alive, gone, ranks_at_step

from cocodiff.distributed.comm import FlatExchange, split_sizes
from cocodiff.errors import PeerTimeout, RunFailed
from cocodiff.run.launch import spawn
from cocodiff.run.lifetime import exit_message
from cocodiff.distributed.topology import Topology, peer_timeout_s, set_peer_timeout

TIMEOUT_S = 2


def _shorten_peer_timeout() -> None:
    """The launcher's timeout also bounds the rendezvous, which must not be short on busy machines;
    the waits the tests are about (the engine's, and the default group's own) are shortened here
    once it is up."""
    set_peer_timeout(TIMEOUT_S)
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=TIMEOUT_S))


def one_rank_never_sends(silent: int) -> None:
    """Every rank but `silent` runs an exchange; `silent` stays alive and never takes part."""
    _shorten_peer_timeout()
    topology = Topology.from_env(1)
    P = topology.world_size
    if topology.rank == silent:
        time.sleep(4 * TIMEOUT_S)  # alive (its links up) but silent: its peers must time out
        return
    seq = split_sizes(6, P)
    FlatExchange(topology).seq_to_head(torch.ones(1, seq[topology.rank], P, 2), seq).wait()  # (B, S_r, H, D)


def test_a_silent_peer_fails_the_exchange_within_the_timeout():
    start = time.monotonic()
    with pytest.raises(RunFailed) as failure:
        spawn(one_rank_never_sends, 3, 2, timeout_s=RANK_TIMEOUT_S)
    message = str(failure.value)
    # Ranks 0 and 1 exchange with each other; only rank 2's part is missing.
    assert message in (f"rank {r}: a2a_in timed out after {TIMEOUT_S} s waiting for rank 2" for r in (0, 1)), message
    assert "\n" not in message
    assert time.monotonic() - start < RANK_TIMEOUT_S / 2  # not the process group's own timeout (RANK_TIMEOUT_S)


def one_rank_skips_the_all_reduce(silent: int) -> None:
    """Every rank but `silent` all-reduces on the world group (as statistics and auto's trials do)."""
    from cocodiff.distributed.comm.ulysses import all_reduce

    _shorten_peer_timeout()
    if dist.get_rank() == silent:
        time.sleep(4 * TIMEOUT_S)
        return
    all_reduce(torch.ones(1), None, "statistics (all-reduce)")


def test_a_world_collective_is_bounded_and_named_too():
    start = time.monotonic()
    with pytest.raises(RunFailed) as failure:
        spawn(one_rank_skips_the_all_reduce, 3, 2, timeout_s=RANK_TIMEOUT_S)
    message = str(failure.value)
    assert message in (f"rank {r}: statistics (all-reduce) timed out after {TIMEOUT_S} s waiting for its peers" for r in (0, 1))
    assert time.monotonic() - start < RANK_TIMEOUT_S / 2


def launcher_timeout() -> float:
    dist.barrier()  # no rank tears its group down while another is still connecting to it
    return peer_timeout_s()


def test_the_launcher_timeout_bounds_every_wait():
    assert spawn(launcher_timeout, 2, timeout_s=77) == [77.0, 77.0]


def test_peer_timeout_message():
    error = PeerTimeout(rank=2, peers=[1, 0], timeout_s=30.0, kind="a2a_in")
    error.layer, error.step = "transformer_blocks.0.attn", (3, 4)
    assert str(error) == "rank 2: a2a_in of layer transformer_blocks.0.attn at step 3 of 4 timed out after 30 s waiting for ranks 0, 1"
    assert str(PeerTimeout(0, [], 1.5, "gather")) == "rank 0: gather timed out after 1.5 s waiting for its peers"


def stall_in_layer(layer: str, step: int) -> None:
    """A tiny FLUX pipeline on every rank; rank 1 stalls before `layer` at denoising `step`."""
    from cocodiff.config.parallel import ParallelConfig
    from cocodiff.engine.parallelize import parallelize
    from cocodiff.run.pipeline import run_pipeline
    from cocodiff.run.load import load
    from cocodiff.run.spec import GenerateSpec

    _shorten_peer_timeout()
    spec = GenerateSpec(model="tiny-flux", steps=3, height=32, width=32, parallel=ParallelConfig(ranks_per_node=1))
    pipe, encoder = load(spec)
    parallel = parallelize(pipe, spec.parallel)
    calls = []

    def stall(_module, _args):
        calls.append(1)
        if dist.get_rank() == 1 and len(calls) == step:
            time.sleep(4 * TIMEOUT_S)

    pipe.transformer.get_submodule(layer).register_forward_pre_hook(stall)
    run_pipeline(spec, pipe, encoder, parallel)


def test_the_timeout_names_the_layer_and_the_step():
    with pytest.raises(RunFailed) as failure:
        spawn(stall_in_layer, 2, "single_transformer_blocks.0.attn", 2, timeout_s=RANK_TIMEOUT_S)
    assert str(failure.value) == (
        f"rank 0: a2a_in of layer single_transformer_blocks.0.attn at step 2 of 3 timed out after {TIMEOUT_S} s "
        "waiting for rank 1"
    )


def killed_at_step_two() -> None:
    from cocodiff.run.lifetime import Progress

    progress = Progress(steps=4)
    progress.step_ended(0)
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()  # rank 0 fails here when rank 1 goes: its error must not hide rank 1's death


def test_a_killed_rank_is_named_with_its_signal_and_step():
    with pytest.raises(RunFailed, match=r"^rank 1 was killed by SIGKILL at step 2 of 4$"):
        spawn(killed_at_step_two, 2, timeout_s=RANK_TIMEOUT_S)


def test_exit_messages(tmp_path):
    (tmp_path / "3.step").write_text(json.dumps({"step": 5, "steps": 8, "pid": 1}))
    assert exit_message(3, -signal.SIGTERM, tmp_path) == "rank 3 was killed by SIGTERM at step 5 of 8"
    assert exit_message(0, 7, tmp_path) == "rank 0 exited with code 7"


# -- the command line: a long generation, watched through the steps its ranks publish ------------------

def _generate(tmp_path: Path) -> subprocess.Popen:
    """`cocodiff generate` on 2 local ranks, long enough to be interrupted; its ranks' step
    records land under tmp_path (the launcher's temporary folder)."""
    env = dict(os.environ, TMPDIR=str(tmp_path))
    return subprocess.Popen(
        [sys.executable, "-m", "cocodiff", "generate", "--model", "tiny-flux", "--nproc", "2", "--steps", "500",
         "--height", "32", "--width", "32", "--out", str(tmp_path / "img.png")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


@pytest.mark.slow
def test_no_rank_outlives_a_terminated_launcher(tmp_path):
    launcher = _generate(tmp_path)
    try:
        ranks = ranks_at_step(tmp_path, "cocodiff-*/*.step", launcher, 2, 2)
        launcher.terminate()
        launcher.wait(timeout=patience(30))
        assert gone(ranks.values(), patience(15)), f"ranks {ranks} outlived their launcher"
        assert launcher.returncode == 128 + signal.SIGTERM  # through the launcher's own clean-up
        assert "Traceback" not in launcher.stderr.read()
    finally:
        launcher.kill()
        launcher.communicate()


PARENT = """
import subprocess, sys, time
from functools import partial
from cocodiff.run.lifetime import die_with_parent
import os
child = subprocess.Popen(["sleep", "600"], preexec_fn=partial(die_with_parent, os.getpid()))
print(child.pid, flush=True)
time.sleep(600)
"""


def test_a_child_dies_with_its_killed_parent():
    """What `cluster run` gives its ranks (and `spawn` its own): the kernel kills them with their parent."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        assert alive(child)
        parent.kill()
        parent.wait()
        assert gone([child], patience(5)), "the child outlived its SIGKILLed parent"
    finally:
        parent.kill()
        parent.stdout.close()
        if alive(child):
            os.kill(child, signal.SIGKILL)


@pytest.mark.slow
def test_a_rank_killed_mid_run_is_one_line(tmp_path):
    launcher = _generate(tmp_path)
    try:
        ranks = ranks_at_step(tmp_path, "cocodiff-*/*.step", launcher, 2, 3)
        os.kill(ranks[1], signal.SIGKILL)
        _, stderr = launcher.communicate(timeout=patience(60))
    finally:
        launcher.kill()
    assert launcher.returncode == 1, stderr
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.replace("\r", "\n").splitlines() if line.startswith("cocodiff")]  # past progress bars
    assert len(lines) == 1 and lines[0].startswith("cocodiff: error: rank 1 was killed by SIGKILL at step "), stderr
    assert gone(ranks.values(), patience(15))
