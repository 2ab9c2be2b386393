"""Where the ranks are and how bytes move between them: devices, the topology, clocks, and the
collectives of `comm` (the Ulysses exchange, TAPA, halos, broadcasts, wire formats, counters).

Layer 2: imports `config` and `errors` only.
"""
