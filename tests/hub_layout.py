"""nginx laid out like the Hugging Face Hub: the resolve URLs and the two API routes ``HfFileSystem`` reads.

The served folder holds ``{org}/{name}/{revision}/{file}``; a revision that is a symlink to a sibling folder
(``main -> 0123abcd...``) is a branch, and the folder it points to names the commit (``X-Repo-Commit``).

- ``GET|HEAD /{org}/{name}/resolve/{revision}/{file}``: the file, ranges included, with ``X-Repo-Commit``,
  ``ETag`` and ``X-Linked-Etag`` / ``X-Linked-Size`` (nginx's ETag and the whole file's size: the Hub's ETag is
  a sha256, not worth hashing whole checkpoints at start). 404s carry ``X-Error-Code``: ``RepoNotFound``,
  ``RevisionNotFound`` or ``EntryNotFound``, as the Hub's do, so huggingface_hub raises its own errors.
- ``GET /api/models/{org}/{name}[/revision/{revision}]`` (``HfApi.repo_info``; ``main`` when no revision:
  ``id``, ``sha``, ``siblings``) and
  ``GET /api/models/{org}/{name}/tree/{revision}[/{path}]`` (``list_repo_tree``: ``recursive=true`` honoured,
  one page, ``oid`` a stand-in: sha1 of path, size and mtime; no ``lfs`` entry): JSON written at start, so a
  file added later is served by resolve but missing from the listings.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

RESOLVE = r"^/(?<hub_org>[^/]+)/(?<hub_repo>[^/]+)/resolve/(?<hub_rev>[^/]+)/(?<hub_file>.+)$"
API = r"^/api/models/(?<hub_org>[^/]+)/(?<hub_repo>[^/]+)(/(?<hub_route>revision|tree)/(?<hub_rev>[^/]+))?"

MAPS = """\
    map_hash_bucket_size 512;  # keys "{{org}}/{{name}}/<40-hex commit>" outgrow the default 64
    map "$hub_org/$hub_repo/$hub_rev" $hub_commit {{
        default $hub_rev;
{commits}
    }}
    map "$hub_org/$hub_repo" $hub_api_missing {{
        default RepoNotFound;
{repos}
    }}
    map "$hub_route:$arg_recursive" $hub_suffix {{ default .json; ~^tree:(?i:true|1)$ .recursive.json; }}
"""

LOCATIONS = """\
        location ~ {resolve} {{
            set $hub_missing EntryNotFound;
            if (!-d $document_root/$hub_org/$hub_repo/$hub_rev) {{ set $hub_missing RevisionNotFound; }}
            if (!-d $document_root/$hub_org/$hub_repo) {{ set $hub_missing RepoNotFound; }}
            add_header X-Repo-Commit $hub_commit always;
            add_header X-Linked-Etag $sent_http_etag;
            add_header X-Linked-Size $sent_http_content_length;
            add_header X-Error-Code $hub_error always;
            rewrite {resolve} /$hub_org/$hub_repo/$hub_rev/$hub_file break;
        }}
        location ~ {api} {{
            root {api_root};
            set $hub_missing $hub_api_missing;  # maps, no `if`: try_files is not inherited into if blocks
            add_header X-Error-Code $hub_error always;
            try_files $uri$hub_suffix =404;
        }}
        location / {{ return 404; }}
"""


def hub_config(root: Path, tmp: Path) -> tuple[str, str]:
    """nginx ``http``-level maps and ``server`` locations for the Hub layout; writes the API's JSON under ``tmp``."""
    api_root = tmp / "hub"
    commits, repos = [], []
    for org in _dirs(root):
        for repo in _dirs(org):
            repos.append(f'        "{org.name}/{repo.name}" RevisionNotFound;')
            for rev in _dirs(repo):
                commit = rev.resolve().name
                commits.append(f'        "{org.name}/{repo.name}/{rev.name}" {commit};')
                _write_api(api_root / "api" / "models" / org.name / repo.name, rev, f"{org.name}/{repo.name}", commit)
    maps = MAPS.format(commits="\n".join(commits), repos="\n".join(repos))
    # $hub_error names what is missing, on 404s only (an empty value adds no header)
    maps += '    map $status $hub_error { default ""; 404 $hub_missing; }\n'
    return maps, LOCATIONS.format(resolve=RESOLVE, api=API, api_root=api_root)


def _dirs(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []


def _write_api(out: Path, rev: Path, repo_id: str, commit: str) -> None:
    files = sorted(p.relative_to(rev).as_posix() for p in rev.rglob("*") if p.is_file())
    info = {"id": repo_id, "modelId": repo_id, "sha": commit, "private": False, "siblings": []}
    info["siblings"] = [{"rfilename": f} for f in files]
    _write(out / "revision" / f"{rev.name}.json", info)
    if rev.name == "main" or not out.with_suffix(".json").exists():  # /api/models/{org}/{name}: the default branch
        _write(out.with_suffix(".json"), info)
    for folder in [rev, *(p for p in rev.rglob("*") if p.is_dir())]:
        rel = folder.relative_to(rev).as_posix()
        base = out / "tree" / rev.name / rel if rel != "." else out / "tree" / rev.name
        _write(base.with_name(base.name + ".json"), _tree(rev, sorted(folder.iterdir())))
        _write(base.with_name(base.name + ".recursive.json"), _tree(rev, sorted(folder.rglob("*"))))


def _tree(rev: Path, entries: list[Path]) -> list[dict]:
    rows = []
    for p in entries:
        stat = p.stat()
        path = p.relative_to(rev).as_posix()
        oid = hashlib.sha1(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
        if p.is_dir():
            rows.append({"type": "directory", "oid": oid, "path": path})
        else:
            rows.append({"type": "file", "oid": oid, "size": stat.st_size, "path": path})
    return rows


def _write(path: Path, value: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value))
