"""Saving a (sharded) model as a Hugging Face checkpoint through the inverse of its traced conversions.

:mod:`.layout` (files, headers and offsets from shapes and dtypes alone) ← :mod:`.sources` (the original keys
and the inverted conversions) ← :mod:`.write` (preallocated files, positional writes, commit) ← :mod:`.api`
(``save_hf_checkpoint``, one process or every rank of a process group).
"""

from .api import RankWrites, SaveReport, plan_rank_writes, save_hf_checkpoint
from .layout import SaveLayout, TensorSpec, plan_layout
from .sources import SaveMapping, map_for_save

__all__ = [
    "RankWrites",
    "SaveLayout",
    "SaveMapping",
    "SaveReport",
    "TensorSpec",
    "map_for_save",
    "plan_layout",
    "plan_rank_writes",
    "save_hf_checkpoint",
]
