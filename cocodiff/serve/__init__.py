"""`cocodiff serve`: an image-generation service on the ranks, in three parts, each testable alone.

- `api`: the HTTP layer (FastAPI). It validates requests in OpenAI's images shape, enqueues them
  and answers; bad input is a 400 in OpenAI's error shape and never reaches the ranks.
- `scheduler`: a bounded FIFO queue that groups compatible requests into batches; every request
  is answered exactly once.
- `ranks`: the rank loop. Rank 0 serves HTTP in a thread and broadcasts each batch; every rank
  runs the same pipeline call.
- `progress`: where each request stands (queued, step i of N, done), reported by the rank loop
  from the pipeline's step callback and read by `GET /v1/progress/{id}` and the web page
  (`static/index.html`, served at `/`).
"""

from __future__ import annotations

__all__: list[str] = []
