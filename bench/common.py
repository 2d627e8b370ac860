"""What the bench scripts share: the Qwen3-MoE shape of the load benchmarks, a checkpoint folder's files, and
the whole-file ``preadv`` the read floors are made of."""

from __future__ import annotations

import os

#: the Qwen3-MoE of bench/load_bench.py and bench/tp_bench.py (transformers ``Qwen3MoeConfig`` keywords)
QWEN3_MOE = dict(
    hidden_size=1024,
    num_hidden_layers=4,
    num_experts=32,
    moe_intermediate_size=512,
    num_experts_per_tok=4,
    intermediate_size=2048,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=128,
    vocab_size=8192,
    tie_word_embeddings=False,
    decoder_sparse_step=1,
    mlp_only_layers=[],
)


def safetensors_files(directory: str) -> list[str]:
    """The ``*.safetensors`` files of ``directory``, sorted."""
    return sorted(os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(".safetensors"))


def pread_all(path: str, view: memoryview, size: int) -> None:
    """Read the first ``size`` bytes of ``path`` into ``view`` with ``preadv`` (what a read floor pays)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        pos = 0
        while pos < size:
            pos += os.preadv(fd, [view[pos:size]], pos)
    finally:
        os.close(fd)
