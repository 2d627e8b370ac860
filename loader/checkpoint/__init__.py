"""Checkpoint I/O: the :class:`Checkpoint` protocol every format implements (:mod:`.protocol`), where a
tensor's elements are stored (chunks and encodings, :mod:`.chunks`), safetensors headers (:mod:`.header`),
byte-range reads (:mod:`.files`), safetensors checkpoints (one file or a sharded folder, :mod:`.folder`), the
``quantization_config`` of its ``config.json`` (:mod:`.config`), ``torch.save`` checkpoints (``pytorch_model*.bin``:
:mod:`.binfolder`, :mod:`.torchzip`, :mod:`.ziparchive`, :mod:`.pickles`) and Hub
repo ids resolved to cached snapshots (:mod:`.hub`)."""

from ..storage import FileIdentity, FileReader
from .binfolder import BIN_INDEX_NAME, BIN_SINGLE_NAME, BinCheckpoint, open_checkpoint
from .chunks import ENCODINGS, PLAIN, Chunk, StoredTensorInfo, TensorInfo, check_encodings, chunk_source
from .config import config_location, quantization_config
from .files import coalesce_ranges, read_ranges, read_tensor
from .folder import INDEX_NAME, MAX_INDEX_BYTES, SINGLE_NAME, SafetensorsCheckpoint
from .header import (
    DTYPES,
    MAX_HEADER_BYTES,
    HeaderFile,
    read_header,
    read_header_file,
)
from .hub import resolve_checkpoint
from .protocol import Checkpoint, TableCheckpoint

__all__ = [
    "BIN_INDEX_NAME",
    "BIN_SINGLE_NAME",
    "BinCheckpoint",
    "open_checkpoint",
    "DTYPES",
    "ENCODINGS",
    "PLAIN",
    "Checkpoint",
    "Chunk",
    "TableCheckpoint",
    "check_encodings",
    "chunk_source",
    "INDEX_NAME",
    "MAX_HEADER_BYTES",
    "MAX_INDEX_BYTES",
    "SINGLE_NAME",
    "FileIdentity",
    "FileReader",
    "HeaderFile",
    "SafetensorsCheckpoint",
    "StoredTensorInfo",
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
