"""``regiontrace plan CHECKPOINT --mesh 2x4``: per-rank load plan of a checkpoint, simulated in one process
(``--save``: also the per-rank write plan of saving the sharded model back; ``--transfer N``: moving the
weights of the same model from FSDP over N ranks into it)."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from regiontrace.cli.common import CLIError

from .. import HFLoadPlanner, SafetensorsCheckpoint
from ..checkpoint import Checkpoint
from ..checkpoint.hub import looks_like_repo_id, resolve_checkpoint
from ..errors import CheckpointNotFoundError, redact_url
from ..options import Rules, StorageOptions
from ..placements import placement_text, plan_placements
from ..simulate import coordinate_of, rank_figures, simulate_plans
from ..storage import is_url
from . import geometry
from .common import LOAD_COLUMNS, have_transformers, human_bytes, parse_mesh, quiet_transformers, table
from .models import build_meta_model, read_config
from .save_plan import write_plan, write_plan_json, write_plan_text
from .svg import render
from .transfer_plan import Destination, load_destination, transfer_plan, transfer_plan_json, transfer_plan_text
from .transfer_svg import transfer_svg as transfer_svg_text

HELP = "per-rank load plan of a Hugging Face checkpoint on a device mesh (no processes, no data read)"
DESCRIPTION = """\
Build the checkpoint's transformers model on the meta device (from its config.json, --config or
--model-type), shard it by the config's tensor-parallel plan over the mesh, and plan every rank's load with
loader.simulate.simulate_load: blocks, bytes read, bytes of its shards, what reading whole tensors would cost,
traced and deferred conversions. Nothing is read but headers, and no process group is started.

Sharding: TP styles on the LAST mesh dim (colwise → Shard(0) of a Linear weight, rowwise → Shard(1),
packed_colwise → strided Shard of the fused gate_up dim, embedding_rowwise → Shard(0), others replicated);
expert tensors (grouped_gemm) Shard(0) over experts on the FIRST dim of a 2-D mesh (--experts).

--save adds the write plan of saving the sharded model back with loader.save_hf_checkpoint on every rank
(loader.save.plan_writes): bytes each rank writes against its shard bytes (the shards it is the lowest
holder of), its positional writes and the files it writes into.

--transfer N adds the plan of loader.transfer_weights moving the same model's weights from an FSDP-style
Shard(0) over N ranks into the mesh's sharding (loader.transfer.simulate_transfer): destination ranks after
the N source ranks (--colocated: on the same ranks from 0); bytes each rank sends and receives against its
shard bytes, bytes per rank pair (--transfer-svg: as a picture), and the time each rank takes to compute
the plan. --transfer-to MODULE:FUNCTION moves them into another model instead: FUNCTION(config), called
under torch.device("meta"), returns it, (model, rules) or (model, rules, placements): its rules from the
checkpoint layout (transfer_weights' dst_mapping) and its placements on the mesh (default: its TP plan)."""
EPILOG = """\
examples:
  regiontrace plan ./Qwen3-30B-A3B --mesh 2x4
  regiontrace plan ./ckpt --mesh 8 --rank 3 --json
  regiontrace plan ./ckpt --mesh 2x4 --save      (the load plan, then the write plan)
  regiontrace plan ./ckpt --mesh 2x4 --transfer 8   (then FSDP over ranks 0-7 -> EP x TP on ranks 8-15)
  regiontrace plan ./ckpt --mesh 4 --transfer 8 --transfer-to engine.py:build   (into your engine's model)
  regiontrace plan ./ckpt --mesh 2x2 --svg plan.svg --tensor '*layers.0.mlp.experts*'
  regiontrace plan Qwen/Qwen3-30B-A3B --mesh 2x4   (cached, e.g. by `hf download Qwen/Qwen3-30B-A3B`)"""


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "plan", help=HELP, description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "checkpoint",
        metavar="CHECKPOINT",
        help="a checkpoint folder (model.safetensors or shards + index), a .safetensors file, a "
        "Hugging Face repo id (org/name) in the local cache (plan never downloads), or the URL of a folder or "
        "file (s3://, https://, hf://org/name): only headers, index and config are fetched",
    )
    p.add_argument("--revision", metavar="REV", help="branch, tag or commit of a repo id or hf:// URL (default: main)")
    p.add_argument(
        "--storage-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an option for a URL's backend (repeatable; VALUE is JSON, else a string), e.g. endpoint_url=http://...",
    )
    p.add_argument("--mesh", required=True, metavar="AxB", help="device mesh shape, e.g. 8 or 2x4 (EP x TP)")
    who = p.add_mutually_exclusive_group()
    who.add_argument("--rank", type=int, action="append", metavar="R", help="only rank R (repeatable)")
    who.add_argument("--all-ranks", action="store_true", help="every rank of the mesh (the default)")
    p.add_argument("--config", metavar="FILE", help="config.json to build the model from")
    p.add_argument("--model-type", metavar="TYPE", help="model type (e.g. qwen3_moe) for the config")
    p.add_argument(
        "--experts",
        choices=("ep", "tp"),
        help="expert tensors: expert- or tensor-parallel (default: ep on a 2-D mesh, tp on a 1-D mesh)",
    )
    p.add_argument("--save", action="store_true", help="also the per-rank write plan of saving the model back")
    p.add_argument(
        "--transfer",
        type=int,
        metavar="N",
        help="also the plan of moving the weights from FSDP (Shard(0)) over N ranks into the mesh's sharding",
    )
    p.add_argument("--colocated", action="store_true", help="--transfer: the mesh on the source's ranks")
    p.add_argument("--transfer-svg", metavar="FILE", help="--transfer: write its picture (bytes per rank pair)")
    p.add_argument(
        "--transfer-to",
        metavar="MODULE:FUNCTION",
        help="--transfer: into this destination instead: FUNCTION(config) returns the model, (model, rules) or "
        "(model, rules, placements) (MODULE: a dotted name or a .py file)",
    )
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("--svg", metavar="FILE", help="write the plan picture")
    p.add_argument(
        "--tensor",
        action="append",
        metavar="NAME",
        help="model tensors to draw (glob or substring; default: the first layer and the rest)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    mesh_shape = parse_mesh(args.mesh)
    if len(mesh_shape) > 2:
        raise CLIError(f"--mesh {args.mesh}: use a 1-D (TP) or 2-D (EP x TP) mesh")
    if args.transfer is not None and args.transfer < 1:
        raise CLIError(f"--transfer {args.transfer}: give the number of source (FSDP) ranks, at least 1")
    if args.transfer_svg and not args.transfer:
        raise CLIError("--transfer-svg draws the plan of --transfer N: give --transfer")
    if args.transfer_to and not args.transfer:
        raise CLIError("--transfer-to is the destination of --transfer N: give --transfer")
    checkpoint = _local_checkpoint(args.checkpoint, args.revision)
    if not have_transformers():
        raise CLIError("`plan` builds the model with transformers: pip install 'transformers>=5'")
    quiet_transformers()
    backend = _backend_settings(args.storage_option)
    if is_url(checkpoint):
        storage = StorageOptions(revision=args.revision, backend=backend)
        opened = SafetensorsCheckpoint.open(checkpoint, storage=storage)
        config = read_config(opened.store, args.config, args.model_type)
    else:
        if backend:
            raise CLIError("--storage-option is for URLs, not the local path " + checkpoint)
        opened, config = checkpoint, read_config(checkpoint, args.config, args.model_type)
    model = build_meta_model(config)
    dest = load_destination(args.transfer_to, config) if args.transfer_to else None
    result = plan_model(
        model,
        opened,
        mesh_shape,
        ranks=_ranks(args, mesh_shape),
        experts=args.experts,
        outputs=PlanOutputs(
            svg=args.svg,
            tensors=args.tensor,
            title=f"Load plan: {_base_name(args.checkpoint)}",
            model_type=config.model_type,
            save=args.save,
            transfer=TransferRequest(args.transfer, args.colocated, args.transfer_svg, dest) if args.transfer else None,
        ),
    )
    if args.json:
        print(json.dumps(result["json"], indent=2))
    else:
        print(result["text"])
    return 0


def _base_name(path: str) -> str:
    return path.rstrip("/").rpartition("/")[2] if is_url(path) else os.path.basename(os.path.abspath(path))


def _backend_settings(items: Sequence[str]) -> dict[str, Any]:
    """``--storage-option KEY=VALUE`` items as a URL backend's settings (:attr:`~loader.options.StorageOptions.backend`;
    VALUE parsed as JSON when it is JSON)."""
    out: dict[str, Any] = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise CLIError(f"--storage-option {item!r}: write KEY=VALUE")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def _local_checkpoint(path: str, revision: str | None) -> str:
    """``path`` itself (a local path or a URL), or the cached snapshot folder of the Hub repo id ``path`` (never
    downloaded)."""
    if is_url(path):
        return path
    if os.path.exists(path):
        if revision is not None:
            raise CLIError(f"--revision is for Hub repo ids, not the local path {path}")
        return path
    if not looks_like_repo_id(path):
        raise CLIError(f"no such checkpoint: {path}")
    try:
        return resolve_checkpoint(path, revision, download=False)
    except CheckpointNotFoundError as e:
        raise CLIError(f"{e} (plan reads the cache only: fetch the repo first, e.g. `hf download {path}`)") from e


def _ranks(args: argparse.Namespace, mesh_shape: Sequence[int]) -> list[int]:
    world = math.prod(mesh_shape)
    if not args.rank:
        return list(range(world))
    for r in args.rank:
        if not 0 <= r < world:
            raise CLIError(f"--rank {r} is outside the mesh {'x'.join(map(str, mesh_shape))} (0..{world - 1})")
    return sorted(set(args.rank))


@dataclass(frozen=True)
class TransferRequest:
    """A transfer plan ``plan_model`` adds: into the model's sharding (or ``into``) from ``Shard(0)`` over
    ``sources`` ranks.

    Attributes:
        sources: the number of source (FSDP) ranks.
        colocated: the source ranks are the destination's own (else ranks after them).
        svg: where to write its picture (None: none).
        into: the destination, if not the model itself (``--transfer-to``).
    """

    sources: int
    colocated: bool = False
    svg: str | None = None
    into: Destination | None = None


@dataclass(frozen=True)
class PlanOutputs:
    """What ``plan_model`` shows besides the load plan's table.

    Attributes:
        svg: where to write the load plan's picture (None: none). tensors: the model tensors it draws (patterns;
            None: a choice of them). title: its title. model_type: the model type shown in the text and picture.
        save: also the write plan of saving the model back (with the load's rules).
        transfer: also a transfer plan (:class:`TransferRequest`; None: none).
    """

    svg: str | None = None
    tensors: Sequence[str] | None = None
    title: str = "Load plan"
    model_type: str = ""
    save: bool = False
    transfer: TransferRequest | None = None


def plan_model(
    model: Any,
    checkpoint_path: str | Checkpoint,
    mesh_shape: Sequence[int],
    *,
    ranks: Sequence[int],
    placements: dict | None = None,
    experts: str | None = None,
    rules: Rules | None = None,
    outputs: PlanOutputs = PlanOutputs(),
) -> dict[str, Any]:
    """Simulate the load of ``model`` with ``rules`` (placements from its TP plan, ``experts`` as ``plan_placements``
    takes them, unless given); text, JSON and, as ``outputs`` asks, pictures, the save's write plan and a transfer
    plan."""
    svg, tensors, title, model_type, save = (
        outputs.svg,
        outputs.tensors,
        outputs.title,
        outputs.model_type,
        outputs.save,
    )
    checkpoint = (
        checkpoint_path if isinstance(checkpoint_path, Checkpoint) else SafetensorsCheckpoint.open(checkpoint_path)
    )
    why: dict[str, str] = {}
    if placements is None:
        placements, why = plan_placements(model, mesh_shape, experts=experts)
    planner = HFLoadPlanner(model, rules=rules)
    figures, plan = [], None
    for rank, coord, plan in simulate_plans(
        model, checkpoint, mesh_shape=mesh_shape, placements=placements, ranks=ranks, planner=planner
    ):
        figures.append(rank_figures(plan, rank, coord))
    deferred = {", ".join(d.conversion.targets): d.reason for d in plan.deferred} if plan else {}
    sharding: dict[str, tuple[str, str]] = {}
    for name, pl in placements.items():
        sharding.setdefault(generic_name(name), (placement_text(pl), why.get(name, "")))
    mesh_text = "x".join(map(str, mesh_shape))
    data_bytes = checkpoint.total_bytes
    shown = checkpoint.root if isinstance(checkpoint_path, Checkpoint) else checkpoint_path  # a URL's
    shown = redact_url(str(shown))
    head = (
        f"{shown}: {len(checkpoint)} checkpoint tensors, {human_bytes(data_bytes)}"
        + (f", model type {model_type}" if model_type else "")
        + f"; mesh {mesh_text}"
    )
    rows = [
        [
            f.rank,
            "(" + ",".join(map(str, f.coordinate)) + ")",
            f.traced + f.deferred,
            f.blocks,
            human_bytes(f.bytes_read),
            human_bytes(f.shard_bytes),
            human_bytes(f.whole_tensor_bytes),
            f"{f.bytes_read / f.shard_bytes:.2f}" if f.shard_bytes else "-",
            f.deferred_conversions,
        ]
        for f in figures
    ]
    text = [head, "", "sharding (all other tensors replicated):"]
    text += [f"  {name}  {pl}" + (f"  <- {style}" if style else "") for name, (pl, style) in sorted(sharding.items())]
    text += [
        "",
        table(
            [*LOAD_COLUMNS, "deferred"],
            rows,
            right=[True] * 9,
        ),
    ]
    if deferred:
        text += ["", "deferred conversions (read whole, run for real):"]
        text += [f"  {t}: {reason}" for t, reason in deferred.items()]
    out_json = {
        "checkpoint": shown,
        "mesh": list(mesh_shape),
        "model_type": model_type,
        "checkpoint_bytes": data_bytes,
        "placements": {n: placement_text(p) for n, p in placements.items()},
        "ranks": [asdict(f) | {"coordinate": list(f.coordinate)} for f in figures],
        "deferred": deferred,
    }
    if save:
        writes = write_plan(model, mesh_shape, placements, ranks, rules)
        text += ["", write_plan_text(writes)]
        out_json["save"] = write_plan_json(writes)
    if outputs.transfer is not None:
        request = outputs.transfer
        moved = transfer_plan(
            model, mesh_shape, placements, request.sources, colocated=request.colocated, dest=request.into
        )
        into = "this sharding" if request.into is None else f"{request.into.name} (--transfer-to)"
        text += ["", transfer_plan_text(moved, into)]
        out_json["transfer"] = transfer_plan_json(moved)
        if request.svg:
            with open(request.svg, "w") as f:
                f.write(transfer_svg_text(moved, f"Transfer plan: {title.removeprefix('Load plan: ')}"))
            text += [f"wrote {request.svg}"]
    if svg:
        model_tensors = dict(model.state_dict(keep_vars=True))
        chosen = geometry.select_tensors(list(model_tensors), tensors)
        if tensors and not chosen:
            some = ", ".join(list(model_tensors)[:6])
            raise CLIError(f"--tensor {' '.join(tensors)} matches no model tensor (e.g. {some})")
        views = geometry.collect(
            planner, checkpoint, model_tensors, mesh_shape, placements, ranks, chosen, placement_text
        )
        view = geometry.PlanView(
            title=title,
            subtitle=(
                f"{model_type + ' · ' if model_type else ''}mesh {mesh_text} "
                f"({len(ranks)} of {math.prod(mesh_shape)} ranks drawn) · "
                f"checkpoint {human_bytes(data_bytes)} in {len(checkpoint)} tensors"
            ),
            mesh_shape=tuple(mesh_shape),
            ranks=list(ranks),
            coords={r: coordinate_of(r, mesh_shape) for r in ranks},
            figures=figures,
            tensors=views,
            hidden=len(model_tensors) - len(chosen),
        )
        with open(svg, "w") as f:
            f.write(render(view))
        text += ["", f"wrote {svg}"]
        out_json["svg"] = svg
    return {"figures": figures, "text": "\n".join(text), "json": out_json, "placements": placements}


def generic_name(name: str) -> str:
    """``model.layers.3.mlp.experts.7.w1`` → ``model.layers.*.mlp.experts.*.w1``."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", name)
