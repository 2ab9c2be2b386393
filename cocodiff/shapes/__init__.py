"""tiny-shapes: a small text-to-image FLUX model trained here on procedural coloured shapes."""
