"""The VAE decoded (and encoded) in bands of latent rows across the ranks, one module per VAE."""
