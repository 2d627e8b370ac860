"""loader: Hugging Face safetensors checkpoints into (sharded) PyTorch models through traced conversions."""

from .api import load_hf_checkpoint
from .checkpoint import Checkpoint, SafetensorsCheckpoint
from .engine import load_engine_weights
from .errors import CheckpointError, PeerFailure
from .hooks import PlanHooks
from .options import LoadOptions, RemoteOptions, RequestCosts, Rules, SaveOptions, StorageOptions, TransferOptions
from .planner import HFLoadPlanner
from .reader import SafetensorsReader
from .report import LoadReport
from .rules import Convert, Rename
from .save import SaveReport, save_hf_checkpoint
from .simulate import RankFigures, simulate_load
from .transfer import PreparedTransfer, TransferReport, prepare_transfer, transfer_weights

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "Convert",
    "HFLoadPlanner",
    "LoadOptions",
    "LoadReport",
    "PeerFailure",
    "PreparedTransfer",
    "PlanHooks",
    "RankFigures",
    "RemoteOptions",
    "Rename",
    "RequestCosts",
    "Rules",
    "SafetensorsCheckpoint",
    "SafetensorsReader",
    "SaveOptions",
    "SaveReport",
    "StorageOptions",
    "TransferOptions",
    "TransferReport",
    "load_engine_weights",
    "load_hf_checkpoint",
    "prepare_transfer",
    "save_hf_checkpoint",
    "simulate_load",
    "transfer_weights",
]
