"""vLLM's side of the image benchmarks, in its own process, driven over stdin / stdout.

Runs under the python of vLLM's CPU venv (/work/venv-vllm) with the environment
benchmarks/peers/peers.py gives vLLM, so it imports only the standard library at module level and
vLLM, PIL and numpy once started; `clip_images.py` and `colpali_pages.py` start it.

    python image_worker.py --model PATH --images DIR --task embed|token_embed [--prompt TEXT]

DIR holds the benchmark's images as lossless PNG files (sorted by name: the drivers name them
00000.png, ...); they are opened and decoded once at start, so each run times the same work the
in-process sides do on already-decoded images: vLLM's preprocessing (its HF image processor) and
the model. The model is `vllm.LLM(model=PATH, runner="pooling", dtype="float32", seed=0)`; each
prompt is `{"prompt": TEXT, "multi_modal_data": {"image": image}}` (CLIP: TEXT "", the image
alone; ColPali: the text after the image tokens). `--task embed` runs `LLM.embed` (one vector an
image), `--task token_embed` runs `LLM.encode(pooling_task="token_embed")` (a vector a token).

Protocol: one JSON line at start, {"ready": true, "vllm": version, "threads": n}, or {"error":
"Type: message"} when vLLM refuses the model (then the process exits 0). Each {"cmd": "run",
"out": "FILE.npy"} line embeds every image and answers {"seconds": wall, "cpu_seconds": CPU of
this process and its children, "lengths": [vectors per image]}, the vectors written to FILE.npy
as one float32 array (the images' rows one after another); {"cmd": "quit"} ends.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from generate_worker import _tree_cpu_seconds  # noqa: E402  (stdlib-only, like this module)


def load_images(folder: str) -> list:
    from PIL import Image

    images = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".png"):
            with Image.open(os.path.join(folder, name)) as image:
                image.load()
                images.append(image.copy())
    return images


def stub_pixtral_processor() -> str:
    """Where torchvision is absent (peer_venvs.sh removes PyPI's CUDA torchvision from vLLM's CPU
    venv: its ops do not load against the CPU torch), vLLM 0.32's vision.py imports its Pixtral
    model for an isinstance check on every vision config, and that imports transformers' Pixtral
    image processor, which needs torchvision: PaliGemma / ColPali cannot start. The one name
    vLLM takes from it (`_num_image_tokens`, used by Pixtral alone) is given a module that
    refuses if called; nothing of a SigLIP / PaliGemma model goes through it. Returns what was
    done (printed by the drivers), "" where torchvision imports."""
    import importlib.util
    import types

    if importlib.util.find_spec("torchvision") is not None:
        return ""
    name = "transformers.models.pixtral.image_processing_pixtral"
    stub = types.ModuleType(name)

    def _num_image_tokens(*args, **kwargs):
        raise NotImplementedError("Pixtral's image processor needs torchvision (not installed)")

    stub._num_image_tokens = _num_image_tokens  # type: ignore[attr-defined]
    sys.modules[name] = stub
    return "no torchvision: transformers' Pixtral image processor stubbed (unused by this model)"


class Engine:
    def __init__(self, args) -> None:
        self.note = stub_pixtral_processor() if args.task == "token_embed" else ""
        import torch
        import vllm

        self.torch, self.vllm, self.task = torch, vllm, args.task
        self.llm = vllm.LLM(
            model=args.model,
            runner="pooling",
            dtype="float32",
            seed=0,
            enable_prefix_caching=False,  # every round computes, as the other sides do
            mm_processor_cache_gb=0,  # no reuse of an image's processed inputs between rounds
        )
        self.images = load_images(args.images)
        self.prompt = args.prompt

    def prompts(self, images: list) -> list[dict]:
        return [{"prompt": self.prompt, "multi_modal_data": {"image": im}} for im in images]

    def run(self, images: list) -> list:
        """One array (tokens x dim, or 1 x dim) per image, float32."""
        if self.task == "embed":
            outs = self.llm.embed(self.prompts(images), use_tqdm=False)
            return [self.torch.tensor(o.outputs.embedding).reshape(1, -1) for o in outs]
        outs = self.llm.encode(self.prompts(images), pooling_task="token_embed", use_tqdm=False)
        return [o.outputs.data.float().reshape(len(o.outputs.data), -1) for o in outs]


def serve(engine: Engine, protocol) -> None:
    import numpy as np

    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        cpu_start = _tree_cpu_seconds(os.getpid())
        start = time.perf_counter()
        rows = engine.run(engine.images)
        seconds = time.perf_counter() - start
        cpu = _tree_cpu_seconds(os.getpid()) - cpu_start
        np.save(cmd["out"], np.concatenate([r.numpy() for r in rows]).astype(np.float32))
        answer = {"seconds": seconds, "cpu_seconds": cpu, "lengths": [len(r) for r in rows]}
        protocol.write(json.dumps(answer) + "\n")
        protocol.flush()


def alternate(runs: dict, rounds: int, count: int, unit: str, digits: int = 1) -> tuple:
    """Each run once per round, the order rotating (A B C, B C A, ...): wall seconds per round,
    the last outputs. A run returns its vectors, or (vectors, wall s, CPU s) where it times
    itself in its own process (vLLM); otherwise this process's CPU seconds are printed beside
    the wall time (a busy machine shows as wall >> CPU / threads). The image benchmarks'
    driver side (clip_images.py, colpali_pages.py)."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    outs: dict[str, object] = {}
    names = list(runs)
    for r in range(rounds):
        line = [f"round {r}"]
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start, cpu = time.perf_counter(), time.process_time()
            out = runs[name]()
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
            if isinstance(out, tuple):
                out, wall, cpu = out
            outs[name] = out
            times[name].append(wall)
            line.append(
                f"{name} {count / wall:7.{digits}f} {unit}/s ({wall:.2f} s wall, {cpu:.2f} s CPU)"
            )
        print(" | ".join(line), flush=True)
    return times, outs


def vllm_python_or_none(python: str | None) -> str | None:
    """`python` where it exists; else None, saying so (a machine without the vLLM venv runs the
    other sides)."""
    if python and not Path(python).exists():
        print(f"vLLM: not run ({python} not found: bash benchmarks/peers/peer_venvs.sh vllm)")
        return None
    return python


def save_pngs(images: list, folder: Path) -> Path:
    """The benchmark's decoded images as lossless PNG files in `folder`, in order (the worker
    decodes the same pixels, in the same modes)."""
    folder.mkdir(parents=True, exist_ok=True)
    for i, image in enumerate(images):
        image.save(folder / f"{i:05d}.png", format="PNG")
    return folder


class ImageWorker:
    """The drivers' end: starts this file under `python` with vLLM's CPU environment (peers.py's
    VLLM_ENV and LD_PRELOAD), reads its first line; `error` is vLLM's refusal, or None."""

    def __init__(self, python: str, model: Path, images: Path, task: str, prompt: str = "") -> None:
        here = Path(__file__).resolve().parent
        sys.path.insert(0, str(here / "peers"))
        from peers import VLLM_ENV, vllm_preload

        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **VLLM_ENV)
        preload = vllm_preload(python)
        env |= {"LD_PRELOAD": preload} if preload else {}
        env.pop("PYTHONPATH", None)  # vLLM's venv, not tidepool's tree
        argv = ["--model", str(model), "--images", str(images), "--task", task, "--prompt", prompt]
        self.out = images / "vllm.npy"
        self.log = images.parent / "vllm-worker.log"
        with open(self.log, "w") as log:  # vLLM's own logging, kept out of the report
            self.proc = subprocess.Popen(
                [python, str(Path(__file__).resolve()), *argv],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=env,
            )
        first = self._read()
        self.error, self.info = first.get("error"), first
        if self.error:
            self.proc.wait(timeout=60)

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            tail = self.log.read_text().strip().splitlines()[-3:]
            return {
                "error": f"the vLLM worker exited (code {self.proc.wait()}): {' | '.join(tail)}"
            }
        return json.loads(line)

    def run(self):
        """(vectors as one float32 array, vectors per image, wall seconds, CPU seconds)."""
        import numpy as np

        self.proc.stdin.write(json.dumps({"cmd": "run", "out": str(self.out)}) + "\n")
        self.proc.stdin.flush()
        answer = self._read()
        if "error" in answer:
            raise RuntimeError(answer["error"])
        rows = np.load(self.out)
        return rows, answer["lengths"], answer["seconds"], answer["cpu_seconds"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--images", required=True)
    parser.add_argument("--task", required=True, choices=["embed", "token_embed"])
    parser.add_argument("--prompt", default="")
    args = parser.parse_args()
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # everything the libraries print goes to stderr
    try:
        engine = Engine(args)
        engine.run(engine.images[:1])  # warm-up
    except Exception as e:  # vLLM's refusal is the figure: the driver prints it
        traceback.print_exc()
        where = traceback.extract_tb(e.__traceback__)[-1]
        site = f" (at {os.path.basename(where.filename)}:{where.lineno}: {where.line})"
        message = " ".join(f"{type(e).__name__}: {e}{site}".split())
        protocol.write(json.dumps({"error": message[:2000]}) + "\n")
        protocol.flush()
        return
    info = {"vllm": engine.vllm.__version__, "threads": engine.torch.get_num_threads()}
    info |= {"note": engine.note} if engine.note else {}
    protocol.write(json.dumps({"ready": True, **info}) + "\n")
    protocol.flush()
    serve(engine, protocol)


if __name__ == "__main__":
    main()
