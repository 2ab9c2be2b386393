"""What commands write and print: checked output paths, atomic writes, images, videos, tables.

Layer 2: imports `config` and `errors` only.
"""
