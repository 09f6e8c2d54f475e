"""Readers of the profiles behind the ground-truth performance model: the project's own
analytic profiles (``builtin``) and the research data sets that override them where they
have measurements (``pollux``, ``gavel``, ``synergy``), with the cell and file parsing
they share (``files``)."""
