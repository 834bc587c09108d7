"""The Hugging Face Hub, through huggingface_hub: which files of a model repo a load reads, the
cache, the download, and one-line errors.

    repo id ──▶ the Hugging Face cache: the revision's snapshot, if it holds every file the load
            │   reads (the tree listing huggingface_hub cached, else the folder's own layout)
            └─▶ the Hub (HF_ENDPOINT; never with HF_HUB_OFFLINE=1): model_info's file list
                ──▶ select_files ──▶ snapshot_download of those files only, under a per-repo lock
                    (processes on one node, e.g. Ray actors, download a model once)

Nothing here reads a model: checkpoint/loader.py decides where a model comes from.
"""

from __future__ import annotations

import contextlib
import fnmatch
import glob
import json
import logging
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidepool import envs
from tidepool.checkpoint import legacy_clip

logger = logging.getLogger("tidepool")


class ModelNotFoundError(FileNotFoundError):
    """No folder, cached snapshot, Hub repo or package has the model (or the Hub is out of reach)."""


class ModelAccessError(PermissionError):
    """The Hub has the model but will not give it: gated, or the token is refused."""


# ----------------------------------------------------------------------------- what a load reads

# Files at the top of a model folder that the load reads (config, tokenizer, heads, metadata).
_TOP_LEVEL_FILES = frozenset(
    {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "vocab.txt",
        "vocab.json",
        "merges.txt",
        "chat_template.jinja",
        "chat_template.json",
        # sentence-transformers
        "modules.json",
        "config_sentence_transformers.json",
        "sentence_bert_config.json",
        # image models' processors (CLIP, SigLIP, Qwen2-VL, ColPali: multimodal/processing.py)
        "preprocessor_config.json",
        "processor_config.json",
        # FlagEmbedding's BGE-M3 heads; colbert-ir's ColBERT metadata
        "sparse_linear.pt",
        "colbert_linear.pt",
        "artifact.metadata",
    }
)
# sentencepiece models (T5's spiece.model, XLM-R's sentencepiece.bpe.model, tokenizer.model).
_SENTENCEPIECE = re.compile(r"^(spiece|sentencepiece.*|tokenizer)\.model$")
# sentence-transformers module folders: 1_Pooling/, 2_Dense/, 1_SpladePooling/, ...
_MODULE_FOLDER = re.compile(r"^\d+_[A-Za-z0-9_.-]+$")
_MODULE_FILES = ("*.json", "*.txt")


def _weights(names: list[str]) -> list[str]:
    """The weights of one folder: safetensors if any (the `model*` ones beside an index or other
    safetensors, e.g. not a consolidated copy), else pytorch_model*.bin; never both."""
    safetensors = [n for n in names if n.endswith(".safetensors")]
    if safetensors:
        named_model = [n for n in safetensors if n.startswith("model")]
        chosen = named_model or safetensors
        index = [n for n in names if n == "model.safetensors.index.json"]
        return sorted(chosen) + index
    bins = [n for n in names if fnmatch.fnmatch(n, "pytorch_model*.bin")]
    index = [n for n in names if n == "pytorch_model.bin.index.json"]
    return sorted(bins) + index


def select_files(repo_files: list[str], trust_remote_code: bool = False) -> list[str]:
    """The files of a model repo a load reads: config, tokenizer files, the weights (safetensors,
    else pytorch_model*.bin), sentence-transformers' module folders and metadata, FlagEmbedding's
    heads, ColBERT's artifact.metadata, and with `trust_remote_code` the repo's top-level *.py.
    ONNX, OpenVINO, TensorFlow, Flax, gguf, Rust, Core ML files and other folders are never
    selected."""
    by_folder: dict[str, list[str]] = {}
    for path in repo_files:
        folder, _, name = path.rpartition("/")
        by_folder.setdefault(folder, []).append(name)
    chosen: list[str] = []
    top = by_folder.get("", [])
    chosen += [n for n in top if n in _TOP_LEVEL_FILES or _SENTENCEPIECE.match(n)]
    chosen += _weights(top)
    if trust_remote_code:
        chosen += [n for n in top if n.endswith(".py")]
    for folder, names in by_folder.items():
        if "/" in folder or not _MODULE_FOLDER.match(folder):
            continue
        picked = [n for n in names if any(fnmatch.fnmatch(n, p) for p in _MODULE_FILES)]
        picked += _weights(names)
        chosen += [f"{folder}/{n}" for n in picked]
    return sorted(set(chosen))


def _missing_by_layout(folder: Path, trust_remote_code: bool) -> list[str]:
    """What a snapshot without a cached tree listing lacks, judged from its own files: weights
    (every shard its index names), sentence-transformers modules' files, the auto_map code."""
    missing = _missing_weights(folder)
    modules = _read_json(folder / "modules.json")
    for module in modules if isinstance(modules, list) else []:
        path, kind = str(module.get("path") or ""), str(module.get("type") or "")
        if not path or not kind.endswith(("Pooling", "Dense")):
            continue
        if not (folder / path / "config.json").is_file():
            missing.append(f"{path}/config.json")
        if kind.endswith("Dense"):
            missing += [f"{path}/{name}" for name in _missing_weights(folder / path)]
    if trust_remote_code:
        config = _read_json(folder / "config.json") or {}
        for module in remote_code_modules(config):
            if "--" not in module and not (folder / f"{module}.py").is_file():
                missing.append(f"{module}.py")
    return missing


def _missing_weights(base: Path) -> list[str]:
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = _read_json(base / index_name)
        if isinstance(index, dict):
            shards = sorted(set((index.get("weight_map") or {}).values()))
            return [s for s in shards if not (base / s).is_file()]
    if any(base.glob("*.safetensors")) or any(base.glob("pytorch_model*.bin")):
        return []
    return ["model.safetensors"]


def remote_code_modules(config: dict[str, Any]) -> list[str]:
    """The modules config.json's auto_map names ("modeling_x" of "modeling_x.XModel"; another
    repo's as "org/repo--modeling_x")."""
    auto_map = config.get("auto_map") or {}
    modules: list[str] = []
    for value in auto_map.values():
        for ref in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(ref, str) and "." in ref:
                module = ref.rsplit(".", 1)[0]
                if module not in modules:
                    modules.append(module)
    return modules


def _read_json(path: Path) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


# ----------------------------------------------------------------------------- options


@dataclass(frozen=True)
class HubOptions:
    """Where and what to fetch (the engine arguments of the same names)."""

    revision: str | None = None
    """A branch, tag or commit; None: the repo's default branch."""
    download_dir: str | None = None
    """The Hugging Face cache to read and fill; None: HF_HUB_CACHE / HF_HOME / ~/.cache."""
    token: str | bool | None = None
    """The Hub token; None: HF_TOKEN, else the one saved by `hf auth login`."""
    trust_remote_code: bool = False
    """Also fetch the repo's *.py (its modeling code)."""

    @property
    def cache_dir(self) -> str:
        if self.download_dir:
            return str(Path(self.download_dir).expanduser())
        explicit = envs.hf_hub_cache()
        if explicit:
            return explicit
        from huggingface_hub import constants

        return constants.HF_HUB_CACHE

    @property
    def hub_token(self) -> str | bool | None:
        return self.token if self.token is not None else envs.hf_token()


@dataclass(frozen=True)
class Snapshot:
    path: Path
    commit: str
    missing: tuple[str, ...] = ()
    """Files the load reads that the snapshot lacks (a partial cache)."""


def is_offline() -> bool:
    offline = envs.hf_hub_offline()
    if offline is not None:
        return offline
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def endpoint() -> str:
    from huggingface_hub import constants

    return envs.hf_endpoint() or constants.ENDPOINT


def is_repo_id(model: str) -> bool:
    """`model` is shaped like a Hub repo id ("name" or "org/name")."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(model)
    except HFValidationError:
        return False
    return True


# ----------------------------------------------------------------------------- the cache


def find_in_cache(repo_id: str, options: HubOptions) -> Snapshot | None:
    """The cached snapshot of `options.revision` (refs/<branch or tag>, or a commit), with what
    it lacks for the load; None when the cache has no such snapshot with a config.json."""
    from huggingface_hub import try_to_load_from_cache

    found = None
    # config.json at the top; sentence-transformers' older CLIP layout has modules.json there.
    for name in ("config.json", "modules.json"):
        try:
            found = try_to_load_from_cache(
                repo_id, name, cache_dir=options.cache_dir, revision=options.revision
            )
        except ValueError:  # not a valid repo id / revision
            return None
        if isinstance(found, str):
            break
    if not isinstance(found, str):
        return None
    folder = Path(found).parent
    if name == "modules.json" and legacy_clip.module_folder(folder) is None:
        return None
    tree = _cached_tree(repo_id, folder.name, options.cache_dir)
    if tree is not None:
        wanted = select_files(tree, options.trust_remote_code)
        missing = [f for f in wanted if not (folder / f).is_file()]
    else:
        missing = _missing_by_layout(folder, options.trust_remote_code)
    return Snapshot(folder, folder.name, tuple(missing))


def _cached_tree(repo_id: str, commit: str, cache_dir: str) -> list[str] | None:
    """The repo's file list at `commit` as snapshot_download cached it (huggingface_hub >= 2);
    None when there is none."""
    try:
        from huggingface_hub import get_cached_repo_tree
    except ImportError:
        return None
    try:
        return [f.path for f in get_cached_repo_tree(repo_id, revision=commit, cache_dir=cache_dir)]
    except Exception:  # no listing cached for that commit
        return None


# ----------------------------------------------------------------------------- the Hub


def download(repo_id: str, options: HubOptions, use_cache: bool = True) -> Snapshot:
    """The files of `repo_id` a load reads, from the cache where they are complete (unless not
    `use_cache`: the Hub says what the revision is now), else from the Hub; one process per node
    downloads, the others wait on the repo's lock and find the cache filled. Raises
    ModelNotFoundError / ModelAccessError with one line saying why."""
    with _repo_lock(repo_id, options.cache_dir):
        cached = find_in_cache(repo_id, options) if use_cache else None
        if cached is not None and not cached.missing:
            return cached
        try:
            return _download(repo_id, options)
        except (ModelNotFoundError, ModelAccessError):
            raise
        except Exception as e:
            error = hub_error(e, repo_id, options)
            if error is None:
                raise
            raise error from None


def _download(repo_id: str, options: HubOptions) -> Snapshot:
    from huggingface_hub import HfApi, snapshot_download

    token = options.hub_token
    api = HfApi(endpoint=endpoint(), token=token)
    info = api.model_info(repo_id, revision=options.revision)
    files = [s.rfilename for s in info.siblings or ()]
    wanted = select_files(files, options.trust_remote_code)
    where = _describe(repo_id, options)
    if "config.json" not in wanted and legacy_clip.listed_module_config(wanted) is None:
        raise ModelNotFoundError(
            f"{where} on {endpoint()} has no config.json: not a transformers model folder"
        )
    size = sum(s.size or 0 for s in info.siblings or () if s.rfilename in wanted)
    logger.info(
        "downloading %d files of %s from %s%s",
        len(wanted),
        where,
        endpoint(),
        f" ({size / 1e6:.1f} MB)" if size else "",
    )
    path = snapshot_download(
        repo_id,
        revision=options.revision,
        cache_dir=options.cache_dir,
        token=token,
        endpoint=endpoint(),
        allow_patterns=[glob.escape(f) for f in wanted],
        tqdm_class=None if sys.stderr.isatty() else _silent_tqdm(),
    )
    folder = Path(path)
    missing = [f for f in wanted if not (folder / f).is_file()]
    if missing:
        raise ModelNotFoundError(
            f"the download of {where} lacks {', '.join(missing[:5])}: the repo changed during the "
            "download? Run it again"
        )
    return Snapshot(folder, folder.name)


def _silent_tqdm() -> type:
    """A progress bar class that shows nothing (no terminal: a log file would fill with bars)."""
    from huggingface_hub.utils import tqdm

    class SilentTqdm(tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return SilentTqdm


def _repo_lock(repo_id: str, cache_dir: str) -> Any:
    """A file lock per repo in the cache's .locks/ (huggingface_hub keeps its own there); none
    where the cache is read-only (then nothing can be downloaded into it anyway)."""
    from filelock import FileLock

    folder = Path(cache_dir) / ".locks" / ("models--" + repo_id.replace("/", "--"))
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return contextlib.nullcontext()
    return FileLock(str(folder / "tidepool-snapshot.lock"))


def _describe(repo_id: str, options: HubOptions) -> str:
    return repr(repo_id) + (f" at revision {options.revision!r}" if options.revision else "")


_TOKEN_HINT = "pass a token that has access (hf_token= / --hf-token / HF_TOKEN)"


def hub_error(error: Exception, repo_id: str, options: HubOptions) -> Exception | None:
    """One line for a Hub failure (not found, gated, token refused, out of reach); None for an
    error that is no Hub failure (a bug: keep its traceback)."""
    from huggingface_hub import errors

    where = _describe(repo_id, options)
    hub = endpoint()
    token_given = bool(options.hub_token)
    if type(error).__name__ == "LocalTokenNotFoundError":  # hf_token=True, nothing saved
        return ModelAccessError(
            "hf_token=True asks for the token saved by `hf auth login`, and none is saved: "
            "log in, or pass the token itself (hf_token= / --hf-token TOKEN / HF_TOKEN)"
        )
    if isinstance(error, errors.GatedRepoError):
        return ModelAccessError(
            f"{where} on {hub} is gated: accept its conditions on its page, then {_TOKEN_HINT}"
            + (" (this token has no access yet)" if token_given else "")
        )
    if isinstance(error, errors.RevisionNotFoundError):
        return ModelNotFoundError(
            f"revision {options.revision!r} of {repo_id!r} not found on {hub}"
        )
    if isinstance(error, errors.RepositoryNotFoundError):
        private = (
            "or this token has no access to it"
            if token_given
            else f"a private repo needs a token: {_TOKEN_HINT}"
        )
        return ModelNotFoundError(f"model {where} not found on {hub} ({private})")
    if isinstance(error, errors.HfHubHTTPError) and error.response is not None:
        status = error.response.status_code
        if status in (401, 403):
            reason = error.response.headers.get("X-Error-Message") or "unauthorized"
            return ModelAccessError(f"{hub} refused the token for {where} ({status}: {reason})")
        if status < 500:
            return ModelNotFoundError(f"{hub} answered {status} for {where}: {_first_line(error)}")
    if _is_unreachable(error):
        return ModelNotFoundError(
            f"cannot reach the Hub at {hub} ({type(error).__name__}: {_first_line(error)}) and "
            f"{where} is not in the Hugging Face cache ({options.cache_dir}); check the network "
            f"or HF_ENDPOINT, or run `tidepool download {repo_id}` where the Hub is reachable"
        )
    return None


def _is_unreachable(error: Exception) -> bool:
    from huggingface_hub import errors
    from huggingface_hub.utils import OfflineModeIsEnabled

    if isinstance(error, (errors.LocalEntryNotFoundError, OfflineModeIsEnabled, OSError)):
        return True
    if isinstance(error, errors.HfHubHTTPError):  # 5xx: the Hub is down
        return True
    module = type(error).__module__.split(".")[0]
    return module in ("requests", "urllib3", "httpx", "httpx2", "httpcore")


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
