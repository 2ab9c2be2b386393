"""Where a pipeline comes from and what it weighs: presets (the tiny ones and tiny-shapes), the
`--model` source, the checkpoint catalog and parameter counts.

Layer 4: imports `engine` and below.
"""
