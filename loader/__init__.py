"""loader: Hugging Face safetensors checkpoints into (sharded) PyTorch models through traced conversions."""

from .api import load_hf_checkpoint
from .checkpoint import SafetensorsCheckpoint
from .errors import CheckpointError
from .planner import HFLoadPlanner, LoadReport
from .reader import SafetensorsReader
from .rules import Convert, Rename

__all__ = [
    "CheckpointError", "Convert", "HFLoadPlanner", "LoadReport", "Rename", "SafetensorsCheckpoint",
    "SafetensorsReader", "load_hf_checkpoint",
]
