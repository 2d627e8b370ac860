"""Checkpoint I/O: safetensors headers (:mod:`.header`), byte-range reads (:mod:`.files`), checkpoints
(one file or a sharded folder, :mod:`.folder`), the ``quantization_config`` of its ``config.json``
(:mod:`.config`) and Hub repo ids resolved to cached snapshots (:mod:`.hub`)."""

from ..storage import FileIdentity, FileReader
from .config import config_location, quantization_config
from .files import coalesce_ranges, read_ranges, read_tensor
from .folder import INDEX_NAME, MAX_INDEX_BYTES, SINGLE_NAME, SafetensorsCheckpoint
from .header import (
    DTYPES,
    MAX_HEADER_BYTES,
    HeaderFile,
    TensorInfo,
    read_header,
    read_header_file,
)
from .hub import resolve_checkpoint

__all__ = [
    "DTYPES",
    "INDEX_NAME",
    "MAX_HEADER_BYTES",
    "MAX_INDEX_BYTES",
    "SINGLE_NAME",
    "FileIdentity",
    "FileReader",
    "HeaderFile",
    "SafetensorsCheckpoint",
    "TensorInfo",
    "coalesce_ranges",
    "config_location",
    "quantization_config",
    "read_header",
    "read_header_file",
    "read_ranges",
    "read_tensor",
    "resolve_checkpoint",
]
