"""What a job's output is the output of: its manifest, the fingerprints in it, and the lock that
keeps a second writer away.

Every output carries a manifest of everything that decides its rows (the model and a fingerprint
of its files, the pooling settings, dtype, quantization, the output format, the input's size and
a fingerprint of its first bytes). A rerun resumes only when every field is the same; otherwise
it stops before it touches anything, listing each field that differs. The local job keeps it in
OUTPUT.manifest.json; the Ray job in OUTPUT/_tidepool_job.json (plan.py).

The lock (`OutputLock`) is an exclusive `fcntl.flock` on OUTPUT.lock, taken without waiting: a
second job on the same output stops at once; the OS releases it when the process ends however it
ends (kill -9 included), so a crashed job never blocks its rerun.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from tidepool.jobs.formats import JobError

MANIFEST_VERSION = 1
PREFIX_BYTES = 1 << 20
"""The input's fingerprint covers its first MiB (and its size)."""
WHOLE_FILE_BYTES = 4 << 20
"""Model files up to this size are hashed whole; larger ones (weights) by three 1 MiB samples."""
SAMPLE_BYTES = 1 << 20
SKIPPED_MODEL_SUFFIXES = (".md", ".lock", ".incomplete")
"""Model-folder files that shape no output: documentation, a download's leftovers."""
SKIPPED_MODEL_DIRS = ("onnx", "openvino", ".git", ".cache")
"""Other runtimes' exports and caches in a model folder: tidepool never reads them."""


# ---------------------------------------------------------------------- fingerprints


def prefix_fingerprint(stream: BinaryIO, size: int) -> dict[str, Any]:
    """{"size", "prefix_sha256"} of a file: what tells one input from another cheaply."""
    digest = hashlib.sha256(stream.read(PREFIX_BYTES)).hexdigest()
    return {"size": size, "prefix_sha256": digest}


def file_fingerprint(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        return prefix_fingerprint(f, os.fstat(f.fileno()).st_size)


def _model_files(folder: Path) -> Iterator[Path]:
    for root, dirs, files in os.walk(folder, followlinks=True):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_MODEL_DIRS and not d.startswith("."))
        for name in sorted(files):
            skipped = name.startswith((".", "LICENSE")) or name.endswith(SKIPPED_MODEL_SUFFIXES)
            if not skipped:
                yield Path(root) / name


def _hash_file(path: Path, digest: Any) -> None:
    with path.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        digest.update(size.to_bytes(8, "little"))
        if size <= WHOLE_FILE_BYTES:
            digest.update(f.read())
            return
        for offset in (0, (size - SAMPLE_BYTES) // 2, size - SAMPLE_BYTES):
            f.seek(offset)
            digest.update(f.read(SAMPLE_BYTES))


def model_fingerprint(folder: Path | str) -> str:
    """sha256 over the model folder's files (relative path, size, content: small files whole,
    weights by their head, middle and tail): another model, other weights, another tokenizer or
    sentence-transformers module give another value; a copy of the same folder the same one."""
    folder = Path(folder)
    digest = hashlib.sha256()
    for path in _model_files(folder):
        digest.update(path.relative_to(folder).as_posix().encode("utf-8") + b"\0")
        _hash_file(path, digest)
    return digest.hexdigest()


def model_fields(model_config: Any) -> dict[str, Any]:
    """The manifest's fields of the engine's model (a tidepool ModelConfig)."""
    if model_config is None:
        return {"model": None}
    pooler = getattr(model_config, "pooler", None)
    return {
        "model": model_config.model,
        "model_fingerprint": model_fingerprint(model_config.path),
        "dtype": str(model_config.dtype).removeprefix("torch."),
        "quantization": model_config.quantization,
        "max_model_len": model_config.max_model_len,
        "pooler_config": None if pooler is None else _plain(vars(pooler)),
    }


def _plain(value: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(value, default=str))


# ---------------------------------------------------------------------- comparing


def differences(recorded: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    """'field: recorded → wanted' for every field that differs (nested ones by dotted name)."""
    out: list[str] = []
    for key in sorted(recorded.keys() | wanted.keys()):
        old, new = recorded.get(key), wanted.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            out.extend(f"{key}.{d}" for d in differences(old, new))
        elif old != new:
            out.append(f"{key}: {_short(old)} → {_short(new)}")
    return out


def _short(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 70 else text[:30] + "..." + text[-12:]


def refuse_other_job(where: str, changed: list[str]) -> JobError:
    return JobError(
        f"{where} holds the output of a job with other settings, so it cannot be resumed: "
        + "; ".join(changed)
        + ". Pass --overwrite to start again, or choose another output"
    )


def read_manifest(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_bytes())
    except ValueError as e:
        raise JobError(f"{path} is not a job manifest ({e}): pass --overwrite") from e
    if not isinstance(manifest, dict):
        raise JobError(f"{path} is not a job manifest: pass --overwrite")
    return manifest


# ---------------------------------------------------------------------- the lock


class OutputLock:
    """An exclusive, non-blocking flock on `path` (created if needed), held until `release`
    (or the process ends). `release` removes the file while still holding it; a job that finds
    the file replaced after locking it locks the new one, so two jobs can never both hold it."""

    def __init__(self, path: Path, output: Path | str) -> None:
        self.path = path
        self.fd: int | None = None
        for _ in range(10):
            fd = _open_lock_file(path)
            try:
                import fcntl

                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise JobError(
                        f"another job is writing {output} (it holds {path}); wait for it to "
                        "end, or choose another output"
                    ) from None
                raise JobError(f"cannot lock {path}: {e.strerror}") from None
            if _same_file(fd, path):
                self.fd = fd
                return
            os.close(fd)  # released and removed by its last holder meanwhile: lock the new one
        raise JobError(f"cannot lock {path}: it keeps being replaced")

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> OutputLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _open_lock_file(path: Path) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise JobError(f"cannot write next to the output ({path}): {e.strerror}") from None


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False
