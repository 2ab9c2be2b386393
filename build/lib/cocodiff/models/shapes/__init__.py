"""tiny-shapes: a small text-to-image FLUX model, trained here on procedural coloured shapes.

- data.py: the captioned images, drawn by code from a seed (no download), and the held-out captions
- text.py: the word-level tokenizer and text encoder, trained with the denoiser
- model.py: the parts of the `FluxPipeline` and how they load (`from_pretrained`, one folder each)
- train.py: `cocodiff train-tiny`, which produced the shipped weights in weights/
- check.py: an automatic colour / shape / relation checker
- evaluate.py: the checker on held-out captions, and the sample grid of the README

This module holds only the constants the presets need, so listing presets imports nothing heavy.
"""

__all__ = ["CFG_SCALE", "DEFAULT_STEPS", "SIZE"]

SIZE = 64
"""Native image height and width in pixels."""
DEFAULT_STEPS = 20
"""Euler steps of a default generation."""
CFG_SCALE = 4.0
"""Classifier-free guidance (the pipeline's `true_cfg_scale`), the empty prompt as negative."""
