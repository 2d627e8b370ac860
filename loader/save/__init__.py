"""Saving a (sharded) model as a Hugging Face checkpoint through the inverse of its traced conversions.

:mod:`.filelayout` (files, headers and offsets from shapes and dtypes alone) ← :mod:`.sources` (the original keys
and the inverted conversions) ← :mod:`.write` (preallocated files, positional writes, through the storage's write side:
:class:`loader.storage.Staging`, whose local driver commits by an atomic swap into place under a lock, keeping the
user's files and refusing mounts: :mod:`loader.storage.local_commit`) ← :mod:`.api`
(``save_hf_checkpoint``, one process or every rank of a process group; :mod:`.agreement`: what the ranks
compare before anyone writes) ← :mod:`.writeplan` (any rank's write plan in one process: ``plan_writes``).
"""

from .api import RankWrites, SaveReport, plan_rank_writes, save_hf_checkpoint
from .filelayout import SaveLayout, TensorSpec, plan_layout
from .sources import SaveMapping, map_for_save
from .writeplan import WriteFigures, plan_writes

__all__ = [
    "RankWrites",
    "SaveLayout",
    "SaveMapping",
    "SaveReport",
    "TensorSpec",
    "WriteFigures",
    "map_for_save",
    "plan_layout",
    "plan_rank_writes",
    "plan_writes",
    "save_hf_checkpoint",
]
