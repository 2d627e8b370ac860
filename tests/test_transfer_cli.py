"""``regiontrace plan --transfer N``: the picture (bytes written in its cells, rank labels under its bars) and a
destination of the user's own (``--transfer-to MODULE:FUNCTION``), run in-process through the CLI's ``main``."""

from __future__ import annotations

import contextlib
import io
import json
import textwrap
import xml.etree.ElementTree as ET

import pytest

pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")]

ENGINE = textwrap.dedent(
    """
    import torch
    from torch import nn
    from torch.distributed.tensor import Shard

    from loader import Convert


    class Engine(nn.Module):
        def __init__(self, config):
            super().__init__()
            rows = (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim
            self.qkv_proj = nn.Parameter(torch.empty(rows, config.hidden_size, dtype=config.dtype))


    def build(config):
        layer0 = "model.layers.0.self_attn."
        qkv = [layer0 + f"{p}_proj.weight" for p in "qkv"]
        rules = [Convert(qkv, "qkv_proj", lambda q, k, v: torch.cat([q, k, v]))]
        return Engine(config), rules, {"qkv_proj": [Shard(0)]}


    def model_only(config):
        return Engine(config)


    def not_a_model(config):
        return 42
    """
)


def plan(*args: str) -> tuple[int, str, str]:
    from loader.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(list(args))
        except SystemExit as e:  # argparse
            status = int(e.code or 0)
    return status, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    pytest.importorskip("transformers")
    from loader.cli.demo_models import write_checkpoint

    root = tmp_path_factory.mktemp("transfer_cli")
    write_checkpoint("transformers", str(root / "ckpt"))
    (root / "engine.py").write_text(ENGINE)
    return root


def test_the_transfer_picture_writes_bytes_in_its_cells_and_ranks_under_its_bars(ckpt):
    from loader.cli.common import human_bytes

    svg = ckpt / "transfer.svg"
    status, out, err = plan("plan", str(ckpt / "ckpt"), "--mesh", "4", "--transfer", "2", "--json")
    assert status == 0, err
    pairs = {(p["src"], p["dst"]): p["bytes"] for p in json.loads(out)["transfer"]["pairs"]}
    status, out, err = plan("plan", str(ckpt / "ckpt"), "--mesh", "4", "--transfer", "2", "--transfer-svg", str(svg))
    assert status == 0 and f"wrote {svg}" in out, err
    texts = ["".join(e.itertext()) for e in ET.parse(svg).getroot() if e.tag.endswith("text")]
    assert len(pairs) == 2 * 4
    for n in pairs.values():  # each pair's bytes written in its cell
        assert human_bytes(n) in texts, (human_bytes(n), texts)
    assert all(f"rank {d}" in texts for d in range(2, 6)), texts  # the destination ranks under their bars
    assert texts.count("1.000") == 4  # each bar's received ÷ shard above it


def test_plan_transfer_into_a_destination_of_ones_own(ckpt):
    """`--transfer-to engine.py:build`: the engine's fused qkv of layer 0, by its rules, `Shard(0)` over the mesh:
    each destination rank receives exactly its shard; the pair bytes add up to the engine's tensor."""
    engine = f"{ckpt / 'engine.py'}:build"
    args = ("plan", str(ckpt / "ckpt"), "--mesh", "4", "--transfer", "2", "--transfer-to", engine)
    status, out, err = plan(*args)
    assert status == 0, err
    text = out[out.index("transfer plan") :]
    assert "from the checkpoint's model, Shard(0) over 2 rank(s) 0–1, into Engine (--transfer-to) on ranks 2–5" in text
    assert text.count(" 1.000 ") == 4 and "1 tensor(s) traced" in text
    status, out, err = plan(*args, "--json")
    moved = json.loads(out)["transfer"]
    qkv_bytes = (4 + 2 * 4) * 8 * 32 * 2  # (heads + 2 kv heads) x head_dim rows, hidden 32, bfloat16
    assert sum(p["bytes"] for p in moved["pairs"]) == qkv_bytes
    assert [r["received"] for r in moved["ranks"] if r["dst_shard_bytes"]] == [qkv_bytes // 4] * 4


def test_transfer_to_is_checked(ckpt):
    base = ("plan", str(ckpt / "ckpt"), "--mesh", "4")
    status, _, err = plan(*base, "--transfer-to", f"{ckpt / 'engine.py'}:build")
    assert status == 2 and "--transfer-to is the destination of --transfer N" in err
    status, _, err = plan(*base, "--transfer", "2", "--transfer-to", f"{ckpt / 'engine.py'}:not_a_model")
    assert status == 2 and "returned int: return the destination model" in err
    status, _, err = plan(*base, "--transfer", "2", "--transfer-to", f"{ckpt / 'engine.py'}:model_only")
    assert status != 0 and "no checkpoint key in the source's layout: ['qkv_proj']" in err  # no rules: no key
