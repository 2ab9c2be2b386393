"""The model x feature matrix: every preset with every feature, each cell exact, lossy within its
floor, or refused in one line before any rank loads weights (`cocodiff matrix`, docs/matrix.md).

`cells.py` declares the columns, `run.py` checks refusals and launches the rest, `job.py` is what
each rank runs, `report.py` writes the table.
"""
