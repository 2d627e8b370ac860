"""What the bench scripts share: the models they build (the Qwen3-MoE of the load benchmarks, DeepSeek-V3), a
checkpoint folder's files, the whole-file ``preadv`` the read floors are made of, and the accounting of cold loads
(dropping files from the page cache, the physical bytes a process read, the pages resident) and of peak memory."""

from __future__ import annotations

import json
import os

#: the Qwen3-MoE of bench/load_bench.py, bench/tp_bench.py, bench/transfer_bench.py and bench/remote_bench.py
#: (transformers ``Qwen3MoeConfig`` keywords; the tests' tiny one is loader/cli/model_configs.py's)
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


#: DeepSeek-V3's own sizes (transformers ``DeepseekV3Config`` keywords), built on the meta device by
#: bench/plan_scale.py
DEEPSEEK_V3 = dict(
    num_hidden_layers=61,
    first_k_dense_replace=3,
    n_routed_experts=256,
    n_shared_experts=1,
    hidden_size=7168,
    moe_intermediate_size=2048,
    intermediate_size=18432,
    vocab_size=129280,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    num_attention_heads=128,
    num_key_value_heads=128,
    num_experts_per_tok=8,
    n_group=8,
    topk_group=4,
    tie_word_embeddings=False,
)


def ours_options(**load: object) -> dict:
    """Keyword arguments for ours' loads (``load_hf_checkpoint``, ``SafetensorsReader``): ``options`` (a
    :class:`~loader.options.LoadOptions` of ``load`` and the settings in ``$BENCH_OURS``, a JSON object such as
    ``{"io_threads": 2, "direct_io": true}``, inherited by every worker and rank) and ``storage`` (its
    ``direct_io``)."""
    from loader.options import LoadOptions, StorageOptions

    settings = {**load, **json.loads(os.environ.get("BENCH_OURS", "{}"))}
    storage = StorageOptions(direct_io=bool(settings.pop("direct_io", False)))
    return {"options": LoadOptions(**settings), "storage": storage}


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


def drop_cache(files: list[str]) -> None:
    """Drop ``files``' pages from the page cache (``POSIX_FADV_DONTNEED``; pages still mapped or dirty stay)."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_bytes() -> int:
    """``read_bytes`` of ``/proc/self/io``: bytes this process caused to be read from block devices."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


def resident_bytes(files: list[str]) -> int | None:
    """Bytes of ``files`` in the page cache (``mincore``), or None where that cannot be asked."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    except OSError:
        return None
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for path in files:
        size = os.path.getsize(path)
        if not size:
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED: maps, faults nothing in
            if addr in (None, ctypes.c_void_p(-1).value):
                return None
            try:
                vec = (ctypes.c_ubyte * ((size + page - 1) // page))()
                if libc.mincore(addr, size, vec) != 0:
                    return None
                total += sum(v & 1 for v in vec) * page
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
    return total


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def reset_peak() -> int:
    """Reset this process's peak RSS to its current RSS (``/proc/self/clear_refs`` = 5); return the RSS."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # pragma: no cover - not Linux / not permitted: the peak then includes earlier phases
        pass
    return _status("VmRSS")


def peak() -> int:
    """Peak RSS (``VmHWM``) since the last :func:`reset_peak`."""
    return _status("VmHWM")
