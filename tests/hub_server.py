"""A small Hugging Face Hub for the tests: the part of the Hub's HTTP protocol huggingface_hub
uses to look up and download a model (HF_ENDPOINT=http://127.0.0.1:PORT), on a thread.

    GET  /api/models/{repo}[/revision/{rev}]        model_info: sha, siblings, private, gated
    GET  /api/models/{repo}/tree/{rev}[/{path}]     list_repo_tree (snapshot_download, >= 2.x)
    HEAD /{repo}/resolve/{rev}/{file}               X-Repo-Commit, ETag, Content-Length
    GET  /{repo}/resolve/{rev}/{file}               the bytes (Range: bytes=N- honoured)

Errors carry the Hub's X-Error-Code headers (RepoNotFound, RevisionNotFound, EntryNotFound,
GatedRepo), which huggingface_hub turns into its typed errors: an unknown repo, or a private one
without a token, is 401 RepoNotFound; a wrong token 401 "Invalid credentials"; a gated repo 403.
Every request is recorded (`requests`), so tests can say which files were fetched.

Fixtures: `hub_models` (session: the tiny model folders served), `fake_hub` (a started Hub
serving them, with HF_ENDPOINT / HF_HOME / HF_HUB_OFFLINE=0 set for the test and a fresh cache).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

TOKEN = "hf_test_token_0123456789"
"""The token the private and gated repos accept."""

# Files a load must never fetch: other formats of the same weights, and a .bin beside safetensors.
DECOYS = {
    "model.onnx": b"onnx decoy",
    "onnx/model.onnx": b"onnx decoy",
    "onnx/model_quantized.onnx": b"onnx decoy",
    "openvino/openvino_model.xml": b"<openvino decoy/>",
    "openvino/openvino_model.bin": b"openvino decoy",
    "openvino_model.xml": b"<openvino decoy/>",
    "pytorch_model.bin": b"pickle decoy beside model.safetensors",
    "tf_model.h5": b"tf decoy",
    "flax_model.msgpack": b"flax decoy",
    "rust_model.ot": b"rust decoy",
    "model.gguf": b"gguf decoy",
    "README.md": b"# a model card\n",
}


@dataclass
class HubRepo:
    repo_id: str
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    """commit hash → {path: bytes}"""
    refs: dict[str, str] = field(default_factory=dict)
    """branch or tag → commit hash"""
    private: bool = False
    gated: bool = False

    def add_revision(self, files: dict[str, bytes], refs: tuple[str, ...]) -> str:
        digest = hashlib.sha1(self.repo_id.encode())
        for path in sorted(files):
            digest.update(path.encode() + b"\0" + hashlib.sha1(files[path]).digest())
        commit = digest.hexdigest()
        self.commits[commit] = dict(files)
        for ref in refs:
            self.refs[ref] = commit
        return commit

    def commit_of(self, revision: str) -> str | None:
        if revision in self.commits:
            return revision
        return self.refs.get(revision)


def folder_files(folder: Path, extra: dict[str, bytes] | None = None) -> dict[str, bytes]:
    """{relative path: bytes} of every file under `folder` (plus `extra`)."""
    files = {
        str(p.relative_to(folder)).replace("\\", "/"): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }
    files.update(extra or {})
    return files


class FakeHub:
    """The Hub's model endpoints over `repos`, on 127.0.0.1 in a thread."""

    def __init__(self) -> None:
        self.repos: dict[str, HubRepo] = {}
        self.requests: list[tuple[str, str]] = []
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._url = ""

    def add(
        self,
        repo_id: str,
        files: dict[str, bytes],
        refs: tuple[str, ...] = ("main",),
        private: bool = False,
        gated: bool = False,
    ) -> str:
        """A revision of `repo_id` (created on first use); returns its commit hash."""
        repo = self.repos.setdefault(repo_id, HubRepo(repo_id, private=private, gated=gated))
        return repo.add_revision(files, refs)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> FakeHub:
        hub = self

        class Handler(_Handler):
            fake_hub = hub

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        """Down: no new connections, and the open keep-alive ones (huggingface_hub's session
        pools them) are cut, so the next request finds nothing listening."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        with self._lock:
            connections, self._connections = list(self._connections), set()
        for sock in connections:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    @property
    def url(self) -> str:
        """Its address (kept after stop: where a client would find nothing now)."""
        return self._url

    # ------------------------------------------------------------------ what was asked

    def opened(self, sock: socket.socket) -> None:
        with self._lock:
            self._connections.add(sock)

    def closed(self, sock: socket.socket) -> None:
        with self._lock:
            self._connections.discard(sock)

    def record(self, method: str, path: str) -> None:
        with self._lock:
            self.requests.append((method, path))

    def fetched(self, repo_id: str, method: str = "GET") -> list[str]:
        """The files of `repo_id` requested with `method` through /resolve/, in order."""
        prefix = f"/{repo_id}/resolve/"
        out = []
        for m, path in list(self.requests):
            if m == method and path.startswith(prefix):
                out.append(path[len(prefix) :].split("/", 1)[1])
        return out

    def touched(self, repo_id: str) -> list[str]:
        """Every file of `repo_id` named in a /resolve/ request (HEAD or GET)."""
        return sorted(set(self.fetched(repo_id, "GET")) | set(self.fetched(repo_id, "HEAD")))


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    fake_hub: FakeHub

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass

    def setup(self) -> None:
        super().setup()
        self.fake_hub.opened(self.connection)

    def finish(self) -> None:
        self.fake_hub.closed(self.connection)
        super().finish()

    def do_GET(self) -> None:
        self._route("GET")

    def do_HEAD(self) -> None:
        self._route("HEAD")

    # ------------------------------------------------------------------ routing

    def _route(self, method: str) -> None:
        path = unquote(urlsplit(self.path).path)
        self.fake_hub.record(method, path)
        parts = [p for p in path.split("/") if p]
        if parts[:2] == ["api", "models"]:
            self._api(parts[2:])
        elif "resolve" in parts:
            at = parts.index("resolve")
            repo_id = "/".join(parts[:at])
            if len(parts) < at + 3:
                return self._error(404, "EntryNotFound", "no file named")
            revision, filename = parts[at + 1], "/".join(parts[at + 2 :])
            self._resolve(method, repo_id, revision, filename)
        else:
            self._error(404, None, "not a Hub route")

    def _api(self, parts: list[str]) -> None:
        for keyword in ("revision", "tree"):
            if keyword in parts:
                at = parts.index(keyword)
                repo_id, rest = "/".join(parts[:at]), parts[at + 1 :]
                break
        else:
            keyword, repo_id, rest = "revision", "/".join(parts), ["main"]
        repo, commit = self._repo_commit(repo_id, rest[0] if rest else "main")
        if commit is None:
            return
        files = repo.commits[commit]
        if keyword == "revision":
            info = {
                "id": repo_id,
                "modelId": repo_id,
                "sha": commit,
                "private": repo.private,
                "gated": "manual" if repo.gated else False,
                "disabled": False,
                "tags": [],
                "siblings": [{"rfilename": name} for name in sorted(files)],
            }
            return self._json(info, commit)
        under = "/".join(rest[1:])
        entries = _tree(files, under)
        self._json(entries, commit)

    def _repo_commit(self, repo_id: str, revision: str) -> tuple[HubRepo, str | None]:
        repo = self.fake_hub.repos.get(repo_id)
        if repo is None:
            self._error(401, "RepoNotFound", "Repository not found")
            return None, None  # type: ignore[return-value]
        if repo.private or repo.gated:
            auth = self.headers.get("authorization") or ""
            if not auth:
                if repo.private:
                    self._error(401, "RepoNotFound", "Repository not found")
                else:
                    self._error(403, "GatedRepo", "Access to this model is restricted")
                return repo, None
            if auth != f"Bearer {TOKEN}":
                self._error(401, None, "Invalid credentials in Authorization header")
                return repo, None
        commit = repo.commit_of(revision)
        if commit is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return repo, commit

    def _resolve(self, method: str, repo_id: str, revision: str, filename: str) -> None:
        repo, commit = self._repo_commit(repo_id, revision)
        if commit is None:
            return
        data = repo.commits[commit].get(filename)
        if data is None:
            return self._error(404, "EntryNotFound", f"{filename} does not exist", commit)
        etag = hashlib.sha256(data).hexdigest()
        start = 0
        ranged = self.headers.get("range", "")
        if ranged.startswith("bytes=") and ranged[6:].split("-")[0].isdigit():
            start = int(ranged[6:].split("-")[0])
        body = data[start:]
        self.send_response(206 if start else 200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("ETag", f'"{etag}"')
        self.send_header("X-Repo-Commit", commit)
        self.send_header("Accept-Ranges", "bytes")
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if method == "GET":
            self.wfile.write(body)

    # ------------------------------------------------------------------ answers

    def _json(self, value: object, commit: str) -> None:
        body = json.dumps(value).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Repo-Commit", commit)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(
        self, status: int, code: str | None, message: str, commit: str | None = None
    ) -> None:
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        if commit:
            self.send_header("X-Repo-Commit", commit)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


def _tree(files: dict[str, bytes], under: str) -> list[dict]:
    """list_repo_tree's entries (recursive), files and folders, below `under`."""
    prefix = f"{under}/" if under else ""
    entries: dict[str, dict] = {}
    for path, data in sorted(files.items()):
        if not path.startswith(prefix):
            continue
        parts = path.split("/")
        for depth in range(1, len(parts)):
            folder = "/".join(parts[:depth])
            if folder.startswith(prefix) or not prefix:
                entries.setdefault(
                    folder,
                    {
                        "type": "directory",
                        "path": folder,
                        "oid": hashlib.sha1(folder.encode()).hexdigest(),
                    },
                )
        entries[path] = {
            "type": "file",
            "path": path,
            "size": len(data),
            "oid": hashlib.sha1(data).hexdigest(),
        }
    return list(entries.values())


# ----------------------------------------------------------------------------- fixtures


@dataclass(frozen=True)
class HubModels:
    """The tiny model folders the test Hub serves."""

    v1: Path
    """A tiny BERT with sentence-transformers files (mean pooling): tag v1 of org/tiny-st."""
    v2: Path
    """Other weights, CLS pooling: main of org/tiny-st."""
    bin_only: Path
    """A tiny BERT whose only weights are pytorch_model.bin."""


def _st_pooling(folder: Path, mode: str) -> None:
    from st_metadata import write_st_metadata

    hidden = json.loads((folder / "config.json").read_text())["hidden_size"]
    pooling = {
        "word_embedding_dimension": hidden,
        "pooling_mode_cls_token": mode == "cls",
        "pooling_mode_mean_tokens": mode == "mean",
    }
    write_st_metadata(folder, pooling, normalize=True)
    (folder / "config_sentence_transformers.json").write_text(json.dumps({"prompts": {}}))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 64}))


@pytest.fixture(scope="session")
def hub_models(tmp_path_factory, minilm_path: Path) -> HubModels:
    import torch
    from conftest import TINY_SIZES, copy_bert_tokenizer
    from transformers import BertConfig, BertModel

    root = tmp_path_factory.mktemp("hub_models")
    folders = []
    for name, seed, mode in (("v1", 10, "mean"), ("v2", 11, "cls")):
        folder = root / name
        folder.mkdir()
        torch.manual_seed(seed)
        BertModel(BertConfig(vocab_size=30522, **TINY_SIZES)).save_pretrained(str(folder))
        copy_bert_tokenizer(minilm_path, folder)
        _st_pooling(folder, mode)
        folders.append(folder)
    bin_only = root / "bin_only"
    bin_only.mkdir()
    torch.manual_seed(12)
    model = BertModel(BertConfig(vocab_size=30522, **TINY_SIZES))
    model.config.save_pretrained(str(bin_only))
    torch.save(model.state_dict(), bin_only / "pytorch_model.bin")
    copy_bert_tokenizer(minilm_path, bin_only)
    return HubModels(folders[0], folders[1], bin_only)


@dataclass
class HubSetup:
    hub: FakeHub
    models: HubModels
    home: Path
    """HF_HOME of the test (its cache: home / "hub")."""
    commits: dict[str, str]
    """"v1", "v2" → commit of org/tiny-st"""

    @property
    def cache(self) -> Path:
        return self.home / "hub"

    def env(self, offline: bool = False) -> dict[str, str]:
        """The environment of a subprocess that should use this Hub and cache."""
        return {
            "HF_ENDPOINT": self.hub.url,
            "HF_HOME": str(self.home),
            "HF_HUB_OFFLINE": "1" if offline else "0",
            "HF_HUB_DISABLE_TELEMETRY": "1",
        }


@pytest.fixture
def fake_hub(hub_models: HubModels, tmp_path: Path, monkeypatch) -> HubSetup:
    """A started test Hub serving org/tiny-st (v1 tag, main = v2; decoys beside), the private
    org/private-st (TOKEN), the gated org/gated-st and org/tiny-bin (.bin weights only); this
    test's environment points at it with an empty HF_HOME and offline mode off."""
    import huggingface_hub.constants

    hub = FakeHub()
    commits = {
        "v1": hub.add("org/tiny-st", folder_files(hub_models.v1, DECOYS), refs=("v1",)),
        "v2": hub.add("org/tiny-st", folder_files(hub_models.v2, DECOYS), refs=("main",)),
    }
    hub.add("org/private-st", folder_files(hub_models.v1), private=True)
    hub.add("org/gated-st", folder_files(hub_models.v1), gated=True)
    hub.add("org/tiny-bin", folder_files(hub_models.bin_only, {"tf_model.h5": b"tf decoy"}))
    hub.start()
    home = tmp_path / "hf_home"
    home.mkdir()
    setup = HubSetup(hub, hub_models, home, commits)
    for name, value in setup.env().items():
        monkeypatch.setenv(name, value)
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_TOKEN", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    # huggingface_hub read these when it was imported; its HTTP session checks HF_HUB_OFFLINE.
    # (Not ENDPOINT: its URL templates were built from it at import, and an explicit endpoint=,
    # which tidepool passes from HF_ENDPOINT, replaces that prefix.)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(home / "token"))
    yield setup
    hub.stop()


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst
