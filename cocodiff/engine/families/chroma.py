"""Chroma (`ChromaTransformer2DModel`): FLUX.1's blocks with no `_cp_plan`, its plan inferred.

Its blocks build their attention mask as m_i * m_j from the (batch, tokens) 0/1 mask they are
handed (float: SDPA adds it to the scores, so each query's row gets m_j where m_i is 1 and nothing
where it is 0). The inferred plan splits that mask with the tokens; `square_masks` runs it as one
process does: its diagonal m gathered over every key, and m_i * m_j rebuilt over this rank's heads
(dispatch.py; the form checked once per module, every rank agreeing). A ring takes one mask per
key, not a bias per row: refused in one line.
"""

from __future__ import annotations

from .base import Family

__all__ = ["FAMILY"]

FAMILY = Family(
    infer=True,
    square_masks=True,
    refuses={"stages": "its split plan is inferred from its whole forward at the first call, and a pipeline "
                       "stage holds part of it (use Ulysses, CFG and batch groups)",
             "ring": "its blocks add m_i * m_j of its token mask to the scores, a different bias on each "
                     "query's row, which ring blocks do not take (--plan uN)"},
)
"""Chroma's `ChromaTransformer2DModel`."""
