"""Memory before anything is allocated: the per-rank estimate, its policy (`--shard-weights auto`,
`--offload-text-encoders auto`, refusals) and `cocodiff footprint`.

Layer 5: imports `models` and below.
"""
