"""One generation on the ranks, in data-path order: the spec, the launch, loading, the timed call
and the result record (`generate`, `verify`).

Layer 6: imports `footprint` and below; the tools (`serve`, `bench`, `simulate`, `cluster`) and
the CLI sit on top.
"""
