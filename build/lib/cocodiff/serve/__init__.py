"""`cocodiff serve`: an image (or video) generation service on the ranks, in three parts, each testable alone.

- `api`: the HTTP layer (FastAPI). It validates requests in OpenAI's images shape, estimates them
  (`admission`: memory from the model's configs, time from measured steps), enqueues them and
  answers; bad input, or a request over a limit, is a 400 in OpenAI's error shape and never
  reaches the ranks. A client that leaves cancels its request.
- `scheduler`: a bounded FIFO queue that groups compatible requests into batches; every request
  is answered exactly once.
- `ranks`: the rank loop. Rank 0 serves HTTP in a thread and broadcasts each batch (or each
  step's joins and leaves, `stepper`); every rank runs the same pipeline call (`calls`) or step.
- `videos`: a video model's jobs (OpenAI's Videos API: `POST /v1/videos`, its status, content and
  delete, and the blocking `/v1/videos/sync`) over the same queue; rank 0 encodes the MP4s.
- `caching`: step caches (LOSSY) per request, the server's `--cache` or the request's `cache`; under
  step-level batching each request's cache state follows its rows (engine/cache/rows.py).
- `drain`: SIGTERM stops admitting at once and abandons running work after `--drain-seconds`.
- `progress`: where each request stands (queued, step i of N, done), reported by the rank loop
  from the pipeline's step callback and read by `GET /v1/progress/{id}` and the web page
  (`static/index.html`, served at `/`).
"""

from __future__ import annotations

__all__: list[str] = []
