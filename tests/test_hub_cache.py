"""Hugging Face Hub cache snapshots and repo ids as checkpoint paths, on a fake cache built on disk.

The cache has the layout ``snapshot_download`` leaves: ``models--org--name/refs/<ref>`` holds a commit hash,
``snapshots/<commit>/<file>`` are relative symlinks into ``../../blobs/<sha256>``. Every test runs offline
(``HF_HUB_OFFLINE=1``) with ``HF_HUB_CACHE`` pointing at a temporary folder: nothing touches the network.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from fake_hub import add_snapshot, repo_folder
from safetensors.torch import save
from torch import nn

from loader import CheckpointError, SafetensorsCheckpoint, load_hf_checkpoint
from loader.checkpoint import FileIdentity, read_tensor, resolve_checkpoint
from loader.checkpoint.hub import hub_cache_dir, looks_like_repo_id
from loader.errors import CheckpointNotFoundError
from loader.options import LoadOptions, StorageOptions

pytest.importorskip("huggingface_hub")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = "org/name"
INDEX = "model.safetensors.index.json"
MAIN = "a" * 40  # commit of refs/main: sharded checkpoint
OLD = "b" * 40  # commit of refs/v1: single-file checkpoint


def model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


def sharded_files(state: dict[str, torch.Tensor]) -> dict[str, bytes]:
    first = {k: v for k, v in state.items() if k.startswith("0.")}
    second = {k: v for k, v in state.items() if k.startswith("2.")}
    names = {"model-00001-of-00002.safetensors": first, "model-00002-of-00002.safetensors": second}
    weight_map = {key: name for name, part in names.items() for key in part}
    index = json.dumps({"metadata": {}, "weight_map": weight_map}).encode()
    config = json.dumps({"model_type": "none"}).encode()
    return {name: save(part) for name, part in names.items()} | {
        INDEX: index,
        "config.json": config,
    }


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fake Hub cache: ``org/name`` at ``main`` (sharded, model(0)) and ``v1`` (one file, model(1))."""
    root = tmp_path / "hub"
    add_snapshot(root, REPO, MAIN, sharded_files(model(0).state_dict()), refs=("main",))
    add_snapshot(root, REPO, OLD, {"model.safetensors": save(model(1).state_dict())}, refs=("v1",))
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # "org/name" is no folder here
    return root


def assert_loaded(net: nn.Module, seed: int) -> None:
    for key, value in model(seed).state_dict().items():
        assert torch.equal(net.state_dict()[key], value), key


# ----------------------------------------------------------------------------------------------- snapshots


def test_sharded_snapshot_of_blob_symlinks_opens(cache: Path):
    snapshot = repo_folder(cache, REPO) / "snapshots" / MAIN
    ckpt = SafetensorsCheckpoint.open(snapshot)
    assert ckpt.root == str(snapshot)
    assert ckpt.files == tuple(str(snapshot / f"model-0000{i}-of-00002.safetensors") for i in (1, 2))
    assert set(ckpt.keys()) == set(model(0).state_dict())
    for file in ckpt.files:  # the identity is the blob's, read through the link
        assert os.path.islink(file) and "blobs" in os.path.realpath(file)
        assert ckpt.identities[file] == FileIdentity.of(os.stat(file))
    for key, value in model(0).state_dict().items():
        assert torch.equal(read_tensor(ckpt[key]), value), key


def test_symlinks_to_files_anywhere_one_rule_for_single_and_sharded(tmp_path: Path):
    """A symlink farm: shards and single files may link anywhere, as long as the target is a regular file."""
    store = tmp_path / "store"
    store.mkdir()
    state = model(0).state_dict()
    for name, data in sharded_files(state).items():
        (store / name).write_bytes(data)
    (store / "single.safetensors").write_bytes(save(model(1).state_dict()))
    farm = tmp_path / "farm"
    farm.mkdir()
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", INDEX):
        os.symlink(store / name, farm / name)  # absolute links out of the folder
    ckpt = SafetensorsCheckpoint.open(farm)
    assert ckpt.files == tuple(str(farm / f"model-0000{i}-of-00002.safetensors") for i in (1, 2))
    assert all(torch.equal(read_tensor(ckpt[k]), v) for k, v in state.items())
    single = tmp_path / "single"
    single.mkdir()
    os.symlink(store / "single.safetensors", single / "model.safetensors")
    for path in (single, single / "model.safetensors"):
        ckpt = SafetensorsCheckpoint.open(path)
        assert ckpt.files == (str(single / "model.safetensors"),)
        assert ckpt.identities == {ckpt.files[0]: FileIdentity.of(os.stat(store / "single.safetensors"))}


def test_allow_external_symlinks_is_gone(cache: Path):
    """The removed parameter is refused like any unknown one; symlinks to regular files need no setting."""
    snapshot = repo_folder(cache, REPO) / "snapshots" / MAIN
    with pytest.raises(TypeError, match="allow_external_symlinks"):
        SafetensorsCheckpoint.open(snapshot, allow_external_symlinks=True)  # type: ignore[call-arg]
    assert len(SafetensorsCheckpoint.open(snapshot)) == 4


def test_repo_id_opens_the_cached_main_snapshot(cache: Path):
    ckpt = SafetensorsCheckpoint.open(REPO)
    assert ckpt.root == str(repo_folder(cache, REPO) / "snapshots" / MAIN)
    assert len(ckpt.files) == 2 and set(ckpt.identities) == set(ckpt.files)
    assert resolve_checkpoint(REPO) == ckpt.root


@pytest.mark.parametrize("revision", [OLD, "v1"])
def test_repo_id_at_a_revision(cache: Path, revision: str):
    ckpt = SafetensorsCheckpoint.open(REPO, storage=StorageOptions(revision=revision))
    snapshot = repo_folder(cache, REPO) / "snapshots" / OLD
    assert ckpt.files == (str(snapshot / "model.safetensors"),)
    assert torch.equal(read_tensor(ckpt["0.weight"]), model(1).state_dict()["0.weight"])


@pytest.mark.parametrize(("revision", "seed"), [(None, 0), ("v1", 1)])
def test_load_hf_checkpoint_from_repo_id(cache: Path, revision: str | None, seed: int):
    net = model(7)
    report = load_hf_checkpoint(
        net, REPO, options=LoadOptions(progress=False), storage=StorageOptions(revision=revision)
    )
    assert_loaded(net, seed)
    assert report.bytes_read == sum(t.numel() * t.element_size() for t in model(seed).state_dict().values())


def test_local_folder_wins_over_a_repo_id(cache: Path, tmp_path: Path):
    local = tmp_path / "org" / "name"
    local.mkdir(parents=True)
    (local / "model.safetensors").write_bytes(save(model(2).state_dict()))
    net = model(7)
    load_hf_checkpoint(net, REPO, options=LoadOptions(progress=False))
    assert_loaded(net, 2)
    with pytest.raises(CheckpointError, match="revision='v1' is for Hub repo ids") as info:
        SafetensorsCheckpoint.open(REPO, storage=StorageOptions(revision="v1"))
    assert info.value.path == str(local)


# ----------------------------------------------------------------------------------------------- not found


def test_repo_not_cached_offline_names_what_was_tried(cache: Path, tmp_path: Path):
    with pytest.raises(CheckpointNotFoundError) as info:
        SafetensorsCheckpoint.open("org/missing")
    err = info.value
    assert isinstance(err, FileNotFoundError) and isinstance(err, CheckpointError)
    message = str(err)
    for part in ("'org/missing'", str(tmp_path / "org" / "missing"), str(cache), "offline", "'main'"):
        assert part in message, (part, message)
    assert err.path == "org/missing"


def test_unknown_revision_offline(cache: Path):
    with pytest.raises(CheckpointNotFoundError, match="revision 'v9'.*not in the cache"):
        SafetensorsCheckpoint.open(REPO, storage=StorageOptions(revision="v9"))


def test_cached_snapshot_without_weights_is_not_a_checkpoint(cache: Path):
    add_snapshot(cache, "org/config-only", MAIN, {"config.json": b"{}"}, refs=("main",))
    with pytest.raises(CheckpointNotFoundError, match="holds no .safetensors files"):
        SafetensorsCheckpoint.open("org/config-only")
    with pytest.raises(CheckpointNotFoundError, match="cache.*; not downloaded"):
        resolve_checkpoint("org/config-only", download=False)


@pytest.mark.parametrize("path", ["/no/such/folder", "./nope", "a/b/c", "has space", "x/../y", "org--name"])
def test_missing_path_that_is_no_repo_id(cache: Path, path: str):
    with pytest.raises(CheckpointNotFoundError) as info:
        SafetensorsCheckpoint.open(path)
    assert "no such file or folder" in str(info.value) and "Hub" not in str(info.value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("org/name", True), ("gpt2", True), ("Qwen/Qwen3-30B-A3B", True), ("a_b.c-d/e.f", True),
     ("/abs/path", False), ("./rel", False), ("a/b/c", False), ("org/", False), ("org--x/name", False),
     ("a..b", False), ("-x", False), ("x" * 97, False), ("", False)],
)  # fmt: skip
def test_looks_like_repo_id(text: str, expected: bool):
    assert looks_like_repo_id(text) is expected


def test_cache_dir_is_read_from_the_environment_at_each_call(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == str(tmp_path / "home" / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert hub_cache_dir() == str(tmp_path / "elsewhere")


def test_without_huggingface_hub_a_repo_id_is_a_clear_error(tmp_path: Path):
    code = textwrap.dedent("""
        import sys
        sys.modules["huggingface_hub"] = None  # as if not installed: importing it raises ImportError
        from loader import SafetensorsCheckpoint
        try:
            SafetensorsCheckpoint.open("org/name")
        except FileNotFoundError as e:
            print(type(e).__name__, e)
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1"))  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("CheckpointNotFoundError") and "pip install huggingface_hub" in r.stdout


# ----------------------------------------------------------------------------------------------- hostile revisions


def evil_folder(tmp_path: Path) -> Path:
    """A checkpoint outside the cache (model(2)): what a traversal would load."""
    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / "model.safetensors").write_bytes(save(model(2).state_dict()))
    return evil


@pytest.mark.parametrize(
    ("revision", "why"),
    [
        ("../../../evil_ref", "has a '..' component"),
        ("main/../../../../evil_ref", "has a '..' component"),
        ("..", "has a '..' component"),
        ("/tmp/evil_ref", "is an absolute path"),
        ("..\\..\\evil_ref", "holds a backslash"),
        ("ma\0in", "holds a NUL byte"),
    ],
)
def test_a_revision_that_leaves_refs_is_refused(cache: Path, tmp_path: Path, revision: str, why: str):
    """``huggingface_hub`` reads ``refs/<revision>`` as a path: ``../../../evil_ref`` reads a file of the
    attacker's, whose content leads to a folder outside the cache, which then loaded. Refused before any read."""
    evil_folder(tmp_path)
    (tmp_path / "evil_ref").write_text("../../../evil")  # refs/../../../evil_ref; snapshots/../../../evil
    net = model(7)
    with pytest.raises(CheckpointError, match="revision=.* " + why.replace("(", r"\(")) as info:
        load_hf_checkpoint(net, REPO, options=LoadOptions(progress=False), storage=StorageOptions(revision=revision))
    assert f"revision={revision!r}" in str(info.value)
    assert not isinstance(info.value, FileNotFoundError)
    assert_loaded(net, 7)  # untouched
    with pytest.raises(CheckpointError, match=why):
        resolve_checkpoint(REPO, revision=revision)


@pytest.mark.parametrize(
    "content",
    [
        "../../../evil",
        "../../../evil\n",
        "/abs/evil",
        "A" * 40,
        "a" * 39,
        "",
        pytest.param("x" * 5000, id="5000-bytes"),
    ],
)
def test_a_cached_ref_that_is_not_a_commit_hash_is_refused(cache: Path, tmp_path: Path, content: str):
    """A ``refs/main`` holding a path led ``huggingface_hub`` to ``snapshots/<path>``: a folder outside the cache."""
    evil_folder(tmp_path)
    (repo_folder(cache, REPO) / "refs" / "main").write_text(content)
    net = model(7)
    with pytest.raises(CheckpointError, match="the ref of revision 'main' holds .*, not a 40-hex commit hash") as info:
        load_hf_checkpoint(net, REPO, options=LoadOptions(progress=False))
    assert info.value.path == str(repo_folder(cache, REPO) / "refs" / "main")
    assert_loaded(net, 7)


def test_a_ref_hash_with_a_trailing_newline_is_accepted(cache: Path):
    """A ref's content is stripped of whitespace (an editor's newline) before it is checked and used."""
    (repo_folder(cache, REPO) / "refs" / "v1").write_text(f"  {OLD}\n")
    net = model(7)
    load_hf_checkpoint(net, REPO, options=LoadOptions(progress=False), storage=StorageOptions(revision="v1"))
    assert_loaded(net, 1)


def test_a_snapshot_folder_linked_out_of_the_cache_is_refused(cache: Path, tmp_path: Path):
    """``snapshots/<commit>`` itself a symlink to a folder elsewhere: the snapshot must lie in ``snapshots/``."""
    evil = evil_folder(tmp_path)
    commit = "c" * 40
    os.symlink(evil, repo_folder(cache, REPO) / "snapshots" / commit)
    (repo_folder(cache, REPO) / "refs" / "evil").write_text(commit)
    for revision in ("evil", commit):
        net = model(7)
        with pytest.raises(CheckpointError, match=f"resolves to {evil}, outside the repo's snapshots folder"):
            load_hf_checkpoint(
                net, REPO, options=LoadOptions(progress=False), storage=StorageOptions(revision=revision)
            )
        assert_loaded(net, 7)


# ----------------------------------------------------------------------------------------------- CLI


def test_plan_cli_takes_a_cached_repo_id(tmp_path: Path):
    """``regiontrace plan org/name`` plans the cached snapshot exactly as its folder; a missing one fails."""
    pytest.importorskip("transformers")
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from hf_models import build

    _, hf_model = build("qwen3_moe")
    saved = tmp_path / "saved"
    hf_model.save_pretrained(saved, max_shard_size="20KB")
    cache = tmp_path / "hub"
    files = {n: (saved / n).read_bytes() for n in os.listdir(saved)}
    snapshot = add_snapshot(cache, "org/tiny-moe", MAIN, files, refs=("main",))
    env = dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache))

    def plan(*args: str) -> subprocess.CompletedProcess:
        argv = [sys.executable, "-m", "loader", "plan", *args, "--mesh", "2x2", "--json"]
        return subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)

    by_id, by_folder = plan("org/tiny-moe", "--revision", "main"), plan(str(snapshot))
    assert by_id.returncode == 0, by_id.stderr
    assert by_folder.returncode == 0, by_folder.stderr
    assert json.loads(by_id.stdout)["ranks"] == json.loads(by_folder.stdout)["ranks"]
    assert json.loads(by_id.stdout)["checkpoint"] == str(snapshot)
    missing = plan("org/tiny-moe", "--revision", "v9")
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert "'org/tiny-moe'" in missing.stderr and "revision 'v9'" in missing.stderr and str(cache) in missing.stderr
    assert "hf download org/tiny-moe" in missing.stderr
