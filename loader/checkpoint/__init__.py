"""Checkpoint I/O: safetensors headers (:mod:`.header`), byte-range reads (:mod:`.files`) and checkpoints
(one file or a sharded folder, :mod:`.folder`)."""

from .files import FileReader, coalesce_ranges, read_ranges, read_tensor
from .folder import INDEX_NAME, SINGLE_NAME, SafetensorsCheckpoint
from .header import DTYPES, MAX_HEADER_BYTES, FileIdentity, TensorInfo, read_header

__all__ = [
    "DTYPES",
    "INDEX_NAME",
    "MAX_HEADER_BYTES",
    "SINGLE_NAME",
    "FileIdentity",
    "FileReader",
    "SafetensorsCheckpoint",
    "TensorInfo",
    "coalesce_ranges",
    "read_header",
    "read_ranges",
    "read_tensor",
]
