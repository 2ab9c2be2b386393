"""What `parallelize` installs into a stock diffusers pipeline: the families' split plans and
processors, attention over the exchange, V-Major, CFG/batch groups, trials, step caches, VAE
bands, compile, sharded weights and the text encoders' placement.

Layer 3: imports `distributed`, `output`, `config` and `errors`; never a preset, a command or a run.
"""
