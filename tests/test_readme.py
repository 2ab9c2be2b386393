"""The README's Python API example runs as written: extracted from README.md, launched by torchrun."""

import os
import re
import subprocess
import sys
from pathlib import Path

from conftest import RANK_TIMEOUT_S
from PIL import Image

README = Path(__file__).resolve().parent.parent / "README.md"


def api_example() -> str:
    """The first Python block of the README's "Python API" section, exactly as written."""
    section = README.read_text().split("\n## Python API\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert blocks, "the README's Python API section has no python block"
    return blocks[0]


def test_readme_is_short_and_shows_the_launch_line():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    assert "torchrun --nproc-per-node 2 example.py" in text
    assert "docs/results/README.md" in text


def test_readme_api_example_runs_under_torchrun(tmp_path):
    (tmp_path / "example.py").write_text(api_example())
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}  # CPU and gloo, as in CI
    # --standalone: torchrun picks a free rendezvous port (two test runs on one machine must not collide).
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "example.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=RANK_TIMEOUT_S,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    with Image.open(tmp_path / "example.png") as image:
        assert image.size == (64, 64)  # the preset's own size: the pipeline filled in its defaults
    assert "same_node_bytes" in run.stdout  # rank 0 printed the traffic counters
