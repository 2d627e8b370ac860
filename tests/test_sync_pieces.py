"""Weight sync's pieces and wire without an engine (``loader.vllm.sync_pieces``, ``loader.vllm.sync_push``).

Which trainer rank sends which part of a worker's wants (the lowest rank holding it, the wants covered exactly);
and a real gloo group of two trainer ranks and two workers (threads of this process) pushing full, then delta:
the workers' wants bit for bit the trainer's tensors cast to bf16, the delta's bytes on the wire far below a full
push's, the changed bytes counted; a trainer rank that hangs mid-push is a PeerFailure on every other member.
With a :class:`~loader.vllm.SyncEndpoint` over a stand-in engine (it records what its workers would be asked):
trainer ranks in processes of their own (``torch.distributed`` gloo ranks where they hold DTensors) refuse a
``Partial`` trainer tensor by name before any worker is asked anything; a group whose rank never arrives is a
PeerFailure, and the same endpoint then takes the next group (the tickets line up). The transport's choice (NCCL
only where every member's tensors are on CUDA) is a pure function.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from datetime import timedelta

import pytest
import torch

from loader.distributed.collectives import backend_device, transport_backend
from loader.errors import PeerFailure
from loader.vllm.sync_endpoint import SyncEndpoint
from loader.vllm.sync_pieces import plan_pieces
from loader.vllm.sync_plan import Want
from loader.vllm.sync_push import header, prepare_outgoing, receive_wants, send_packets, stats
from loader.vllm.sync_wire import Wire, group_store, host_store, join_group, join_store, open_tickets, skip_ticket

ROWS, COLS = 10, 6


def rows_parts(bounds: list[tuple[int, int]], key: str = "w", cols: int = COLS) -> list[dict]:
    """Per rank, ``key``'s rows ``bounds[r]`` (an FSDP ``Shard(0)``), plus a replicated ``b`` of 4 elements."""
    return [
        {key: [[[[a, b], [0, cols]], [[0, b - a], [0, cols]]]] if b > a else [], "b": [[[[0, 4]], [[0, 4]]]]}
        for a, b in bounds
    ]


def test_each_piece_comes_from_the_lowest_rank_holding_it_and_the_wants_are_covered_once():
    wants = [Want("w", (3, 0), (5, COLS), torch.bfloat16), Want("b", (0,), (4,), torch.bfloat16)]
    pieces = plan_pieces(wants, rows_parts([(0, 5), (5, 10)]))
    assert [(p.want, p.box, p.sender, p.local) for p in pieces] == [
        (0, ((3, 5), (0, 6)), 0, ((3, 5), (0, 6))),
        (0, ((5, 8), (0, 6)), 1, ((0, 3), (0, 6))),
        (1, ((0, 4),), 0, ((0, 4),)),  # replicated: sent once, by rank 0
    ]


def test_a_want_no_trainer_rank_holds_is_an_error_naming_the_tensor():
    with pytest.raises(ValueError, match="trainer tensor 'w'"):
        plan_pieces([Want("w", (0, 0), (10, COLS), torch.bfloat16)], rows_parts([(0, 4), (5, 10)]))


def run_members(fns: list) -> list:
    """Run each ``fn()`` in its own thread; their results (or exceptions)."""
    out: list = [None] * len(fns)

    def call(i: int) -> None:
        try:
            out[i] = fns[i]()
        except BaseException as e:
            out[i] = e

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


@pytest.fixture()
def world():
    """Two trainer ranks holding rows 0-5 / 5-10 of a float32 ``w`` (and ``b`` each), two workers wanting rows
    2-7 and 6-10 of it in bf16 (worker 1 also ``b``)."""
    bounds = [(0, 5), (5, 10)]
    parts = rows_parts(bounds)
    wants = [
        [Want("w", (2, 0), (5, COLS), torch.bfloat16)],
        [Want("w", (6, 0), (4, COLS), torch.bfloat16), Want("b", (0,), (4,), torch.bfloat16)],
    ]
    pieces = [plan_pieces(w, parts) for w in wants]
    store = host_store(0, 10.0)
    address = f"127.0.0.1:{store.port}"
    wires = run_members([lambda r=r: Wire(join_store(address, 10.0), r, 4, 3.0) for r in range(4)])
    assert not any(isinstance(w, BaseException) for w in wires), wires
    return {"bounds": bounds, "wants": wants, "pieces": pieces, "wires": wires, "store": store}


def push(world: dict, full_w: torch.Tensor, bias: torch.Tensor, bases: list, olds: list, delta: bool, hang=None):
    """One push over ``world``; each member's result (trainers: bytes sent, totals; workers: wants, bytes)."""
    wants, pieces, wires = world["wants"], world["pieces"], world["wires"]

    def trainer(r: int):
        a, b = world["bounds"][r]
        local = {"w": full_w[a:b], "b": bias}
        mine = [[p for p in ps if p.sender == r] for ps in pieces]
        out = prepare_outgoing(local, mine, wants, bases[r], delta)
        _, full, _ = header(wires[r], False, not delta or any(x is None for x in bases[r]), 1)
        if hang == r:
            return None  # never sends: the others time out
        sent = send_packets(wires[r], 2, out, full)
        assert wires[r].agree(True)
        bases[r] = out.segments
        return sent, stats(wires[r], sent, out.changed)

    def worker(w: int):
        _, full, _ = header(wires[2 + w], False, olds[w] is None, 0)
        new, got = receive_wants(wires[2 + w], 2, pieces[w], wants[w], olds[w], full)
        assert wires[2 + w].agree(True)
        olds[w] = new
        return new, got, stats(wires[2 + w], [0, 0], [0, 0])

    return run_members([lambda: trainer(0), lambda: trainer(1), lambda: worker(0), lambda: worker(1)])


def expected(wants: list, full_w: torch.Tensor, bias: torch.Tensor) -> list:
    tensors = {"w": full_w, "b": bias}
    out = []
    for want in wants:
        box = tensors[want.key]
        for d, (o, n) in enumerate(zip(want.offsets, want.lengths)):
            box = box.narrow(d, o, n)
        out.append(box.to(want.dtype))
    return out


def test_a_full_then_a_delta_push_give_the_workers_the_trainers_values_bit_for_bit(world):
    torch.manual_seed(0)
    w, b = torch.randn(ROWS, COLS), torch.randn(4)
    bases, olds = [[None, None], [None, None]], [None, None]
    first = push(world, w, b, bases, olds, delta=True)  # the first push is full, whatever is asked
    assert not any(isinstance(x, BaseException) for x in first), first
    for k in (0, 1):
        assert all(torch.equal(x.view(torch.int16), y.view(torch.int16))
                   for x, y in zip(first[2 + k][0], expected(world["wants"][k], w, b)))  # fmt: skip
    full_bytes = first[0][1][0]
    assert full_bytes == (5 * COLS * 2, 4 * COLS * 2 + 4 * 2)  # each worker's wants in bf16, once
    w2 = w.clone()
    w2[7, 3] += 1.0  # one element changed (worker 1's row 7; trainer rank 1's)
    second = push(world, w2, b, bases, olds, delta=True)
    assert not any(isinstance(x, BaseException) for x in second), second
    for k in (0, 1):
        got = second[2 + k][0]
        assert all(torch.equal(x.view(torch.int16), y.view(torch.int16))
                   for x, y in zip(got, expected(world["wants"][k], w2, b)))  # fmt: skip
    sent, changed = second[0][1]
    assert changed == (0, 2) and all(s < f for s, f in zip(sent, full_bytes)) and sent == (second[2][1], second[3][1])


def test_a_trainer_rank_that_hangs_mid_push_is_a_peer_failure_on_every_other_member(world):
    w, b = torch.randn(ROWS, COLS), torch.randn(4)
    out = push(world, w, b, [[None, None], [None, None]], [None, None], delta=False, hang=1)
    assert out[1] is None
    for member in (0, 2, 3):
        assert isinstance(out[member], PeerFailure), out[member]
        assert out[member].stage == "sync"


#: trainer rank 1 as a process of its own: it joins, starts the push, and dies
DYING = """
import os, sys
from loader.vllm.sync_push import header
from loader.vllm.sync_wire import Wire, join_store
wire = Wire(join_store(sys.argv[1], 20.0), 1, 4, 20.0)
header(wire, False, True, 1)
os._exit(1)
"""


def test_a_trainer_rank_that_dies_mid_push_is_a_peer_failure_on_every_other_member():
    torch.manual_seed(1)
    w, b = torch.randn(ROWS, COLS), torch.randn(4)
    parts = rows_parts([(0, 5), (5, 10)])
    wants = [[Want("w", (2, 0), (5, COLS), torch.bfloat16)], [Want("w", (6, 0), (4, COLS), torch.bfloat16)]]
    pieces = [plan_pieces(x, parts) for x in wants]
    store = host_store(0, 20.0)
    address = f"127.0.0.1:{store.port}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(__file__)), *sys.path])}
    dying = subprocess.Popen([sys.executable, "-c", DYING, address], env=env)

    def trainer():
        wire = Wire(join_store(address, 20.0), 0, 4, 20.0)
        mine = [[p for p in ps if p.sender == 0] for ps in pieces]
        out = prepare_outgoing({"w": w[0:5], "b": b}, mine, wants, [None, None], False)
        _, full, _ = header(wire, False, True, 1)
        send_packets(wire, 2, out, full)
        return wire.agree(True)

    def worker(k: int):
        wire = Wire(join_store(address, 20.0), 2 + k, 4, 20.0)
        _, full, _ = header(wire, False, True, 0)
        receive_wants(wire, 2, pieces[k], wants[k], None, full)
        return wire.agree(True)

    out = run_members([trainer, lambda: worker(0), lambda: worker(1)])
    assert dying.wait(30) == 1
    for member in out:
        assert isinstance(member, PeerFailure) and member.stage == "sync", member


#: a trainer rank in its own process: ``python -c TRAINER ADDRESS RANK MODE``; with MODE ``partial`` one of two
#: gloo ranks holding a Linear whose weight is ``Shard(0)`` and whose bias is ``Partial``, else a plain Linear (rank
#: and world given); prints what ``EngineSync`` raised
TRAINER = """
import json, socket, sys
import torch
address, rank, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
model = torch.nn.Linear(6, 10)
if mode == "partial":
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor
    dist.init_process_group("gloo", init_method=sys.argv[4], rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    model.weight = torch.nn.Parameter(distribute_tensor(model.weight.detach(), mesh, [Shard(0)]))
    model.bias = torch.nn.Parameter(DTensor.from_local(model.bias.detach(), mesh, [Partial()]))
from loader.vllm import EngineSync
try:
    EngineSync(address, model, timeout=30.0, rank=rank, trainers=2)
    said = {"raised": None}
except Exception as e:
    said = {"raised": type(e).__name__, "message": str(e), "ranks": list(getattr(e, "ranks", ()))}
print("RESULT " + json.dumps(said), flush=True)
"""


class StandIn:
    """An engine with no workers: records each ``collective_rpc``; its workers' prepare refuses every trainer."""

    def __init__(self):
        self.calls: list[str] = []

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        self.calls.append(method)
        if method == "regiontrace_sync_prepare":
            return [{"rank": 0, "error": "the stand-in engine plans nothing"}]
        return [{"rank": 0}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trainers(address: str, ranks: list[int], mode: str) -> list[subprocess.Popen]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(__file__)), *sys.path])}
    rendezvous = f"tcp://127.0.0.1:{free_port()}"
    return [subprocess.Popen([sys.executable, "-c", TRAINER, address, str(r), mode, rendezvous], env=env,
                             stdout=subprocess.PIPE, text=True) for r in ranks]  # fmt: skip


def results(procs: list[subprocess.Popen]) -> list[dict]:
    out = []
    for p in procs:
        text, _ = p.communicate(timeout=90)
        assert p.returncode == 0, text
        out.append(json.loads(text.split("RESULT ", 1)[1]))
    return out


def arrived(endpoint: SyncEndpoint, group: int, ranks: list[int]) -> None:
    """Wait (as long as a start takes) until trainer group ``group``'s ``ranks`` have prepared."""
    group_store(endpoint.root, group).wait([f"prepare/{r}" for r in ranks], timedelta(seconds=120))


def test_a_partial_trainer_tensor_is_refused_by_name_before_any_worker_is_asked():
    engine = StandIn()
    endpoint = SyncEndpoint(engine, trainers=2, timeout=30.0)
    procs = trainers(endpoint.address, [0, 1], "partial")
    arrived(endpoint, 1, [0, 1])
    with pytest.raises(ValueError, match="trainer tensor 'bias' has a Partial placement") as refused:
        endpoint.accept()
    said = results(procs)
    assert [s["raised"] for s in said] == ["ValueError", "ValueError"], said
    assert all("trainer tensor 'bias' has a Partial placement" in s["message"] for s in said), said
    assert "'weight'" not in str(refused.value)  # the Shard(0) weight is fine
    assert engine.calls == []  # no worker planned, connected or received anything


def test_a_group_whose_rank_never_arrives_is_a_peer_failure_and_the_endpoint_takes_the_next_group():
    engine = StandIn()
    endpoint = SyncEndpoint(engine, trainers=2, timeout=4.0)
    lone = trainers(endpoint.address, [0], "plain")  # group 1: rank 1 never comes
    arrived(endpoint, 1, [0])  # the endpoint's 4 s are rank 1's alone, however slow rank 0's start
    with pytest.raises(PeerFailure) as failed:
        endpoint.accept()
    assert failed.value.ranks == (1,) and failed.value.stage == "sync"
    [said] = results(lone)
    assert said["raised"] == "PeerFailure" and said["ranks"] == [1], said
    group = trainers(endpoint.address, [0, 1], "plain")  # group 2, both ranks: the same endpoint takes them
    arrived(endpoint, 2, [0, 1])
    with pytest.raises(ValueError, match="the stand-in engine plans nothing"):
        endpoint.accept()
    said = results(group)
    assert [s["raised"] for s in said] == ["ValueError", "ValueError"], said
    assert engine.calls == ["regiontrace_sync_prepare"]  # group 2 reached the workers (group 1 never did)
    assert endpoint.group == 2


def test_each_trainer_ranks_arrivals_are_numbered_and_a_missing_ranks_ticket_is_spent():
    root = host_store(0, 5.0)
    open_tickets(root, 2)
    address = f"127.0.0.1:{root.port}"
    first = [join_group(address, r, 5.0) for r in (0, 1)]
    first[0].set("x", "a")
    assert group_store(root, 1).get("x") == b"a" and not group_store(root, 2).check(["x"])
    join_group(address, 0, 5.0)  # group 2: rank 0 arrives, rank 1 never does
    skip_ticket(root, 1, 2)
    third = [join_group(address, r, 5.0) for r in (0, 1)]  # group 3: both ranks again under one number
    third[1].set("y", "b")
    assert third[0].get("y") == b"b" and group_store(root, 3).get("y") == b"b"
    skip_ticket(root, 0, 3)  # a rank that did arrive keeps its ticket: a no-op
    assert root.add("joined/0", 0) == 3


def test_the_transport_is_nccl_only_where_every_members_tensors_are_on_cuda():
    assert transport_backend(["cuda", "cuda", "cuda"]) == "nccl"
    assert transport_backend(["cpu", "cuda", "cuda"]) == "gloo"  # a CPU engine: gloo, packets staged on the trainers
    assert transport_backend(["cuda", "cpu"]) == "gloo"
    assert transport_backend(["cpu"]) == "gloo"
    assert backend_device("gloo") == torch.device("cpu")
    with pytest.raises(ValueError, match="'mpi'"):
        backend_device("mpi")


def test_a_wire_reads_its_groups_transport_from_the_store():
    store = host_store(0, 5.0)
    assert Wire(store, 0, 1, 5.0).backend == "gloo"  # no choice made: gloo
    store.set("backend", "gloo")
    wire = Wire(store, 0, 1, 5.0)
    assert wire.backend == "gloo" and wire.device == torch.device("cpu")
    assert wire.allreduce([3, 4], torch.distributed.ReduceOp.SUM, "a test") == [3, 4]


def test_an_endpoint_advertises_the_host_it_is_given_and_trainers_reach_it_there():
    endpoint = SyncEndpoint(StandIn(), trainers=1, timeout=30.0, host="localhost")
    host, _, port = endpoint.address.rpartition(":")
    assert host == "localhost" and int(port) == endpoint.root.port
    store = join_group(endpoint.address, 0, 30.0)  # a trainer's arrival by that name: group 1's keys
    store.set("hello", "1")
    assert group_store(endpoint.root, 1).get("hello") == b"1"
