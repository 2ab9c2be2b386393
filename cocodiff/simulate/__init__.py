"""`cocodiff simulate`: predict per-step latency of a real model on a real cluster.

workload.py  what a denoising step computes and sends (real model configs, as data)
system.py    clusters as data (systems/*.toml): link levels, network, device
network.py   collective phases as traffic matrices routed over the links (link-load model, incast)
incast.py    the incast term of Aurora's collective library, fitted to the paper's microbenchmark
placement.py a pipe x cfg x batch x ring x Ulysses plan laid over the ranks: its groups' collectives as traffic matrices
model.py     the cost model: compute + exposed communication per layer, per variant
stages.py    pipeline stages and displaced patches: each stage the model on its blocks, a flow shop between
calibrate.py fit link figures to `bench a2a`, check predictions against `bench e2e`
paper.py     the paper's settings on Aurora, beside the paper's reported speedups
cli.py       the command

No torch: the simulator is plain Python and numpy; only the block parameter counts of `+shard` and
pipeline stages come from a checkpoint's config built on `meta` (models/counts.py).
"""
