"""sentence-transformers' exported backends (OpenVINO, ONNX Runtime; float32 and int8), made offline
from a local model folder and cached, for peer_worker.py under the OpenVINO venv.

Each export lives in a copy of the model folder (`export_dir`), in the subfolders and file names
sentence-transformers itself uses, so a later run loads it instead of exporting again:

    onnx/model.onnx                                   ONNX float32 (optimum's export)
    onnx/model_qint8_avx512_vnni.onnx                 ONNX Runtime dynamic int8 (weights int8 per
                                                      channel, activations per tensor at run time)
    openvino/openvino_model.xml                       OpenVINO float32 IR
    openvino/openvino_model_qint8_quantized.xml       OpenVINO static int8 (NNCF post-training
                                                      quantization over a calibration set)

sentence-transformers' static OpenVINO export downloads glue/sst2 for its calibration set; here the
same recipe (`OVQuantizer.quantize` over the texts tokenized as it tokenizes them: padded to 384)
runs on local texts instead (300, as in issue 17).

OpenVINO's CPU plugin runs float32 models in bfloat16 where the CPU has AVX512-BF16 / AMX (its
default INFERENCE_PRECISION_HINT): exports and calibration always run in f32 here, and the timed
model gets the hint the caller asks for (peers.py: f32 by default, so the "float32" row is float32
and the int8 row keeps its non-quantized ops in f32, as on a CPU without bf16).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Export:
    """How one exported backend is made and loaded."""

    backend: str
    """sentence-transformers' `backend=` ("onnx" or "openvino")."""
    file_name: str
    """The model file inside the export folder (`model_kwargs["file_name"]`)."""
    quantize: str | None
    """None: the float32 export; "dynamic": ONNX dynamic int8; "static": OpenVINO static int8."""


EXPORTS = {
    "st-onnx": Export("onnx", "onnx/model.onnx", None),
    "st-onnx-int8": Export("onnx", "onnx/model_qint8_avx512_vnni.onnx", "dynamic"),
    "st-openvino": Export("openvino", "openvino/openvino_model.xml", None),
    "st-openvino-int8": Export("openvino", "openvino/openvino_model_qint8_quantized.xml", "static"),
}


def _model_class(task: str):
    if task == "embed":
        from sentence_transformers import SentenceTransformer

        return SentenceTransformer
    from sentence_transformers import CrossEncoder

    return CrossEncoder


def _load(
    task: str,
    path: Path,
    backend: str,
    file_name: str | None,
    max_len: int,
    ov_precision: str = "f32",
):
    cls = _model_class(task)
    kwargs: dict = {"file_name": file_name} if file_name else {}
    if backend == "openvino" and ov_precision != "default":
        kwargs["ov_config"] = {"INFERENCE_PRECISION_HINT": ov_precision}
    if task == "embed":
        model = cls(str(path), device="cpu", backend=backend, model_kwargs=kwargs)
        model.max_seq_length = max_len
        return model
    return cls(str(path), device="cpu", backend=backend, model_kwargs=kwargs, max_length=max_len)


def _float_export(task: str, export_dir: Path, backend: str, file_name: str, max_len: int) -> None:
    """Export the float32 model once (optimum converts the torch weights) and save it in place."""
    if (export_dir / file_name).exists():
        return
    model = _load(task, export_dir, backend, None, max_len)
    model.save_pretrained(str(export_dir))


def _dynamic_int8(task: str, export_dir: Path, max_len: int) -> None:
    from sentence_transformers import export_dynamic_quantized_onnx_model

    model = _load(task, export_dir, "onnx", EXPORTS["st-onnx"].file_name, max_len)
    export_dynamic_quantized_onnx_model(model, "avx512_vnni", str(export_dir))


def _static_int8(task: str, export_dir: Path, calibration: list, max_len: int) -> None:
    """sentence-transformers' `export_static_quantized_openvino_model` with a local calibration
    set in place of glue/sst2 (its default OVQuantizationConfig, its tokenization)."""
    from datasets import Dataset
    from optimum.intel.openvino import OVConfig, OVQuantizationConfig, OVQuantizer
    from sentence_transformers.backend.utils import save_or_push_to_hub_model

    model = _load(task, export_dir, "openvino", EXPORTS["st-openvino"].file_name, max_len)
    config = OVQuantizationConfig(num_samples=len(calibration))
    quantizer = OVQuantizer.from_pretrained(model.transformers_model)
    if task == "embed":
        dataset = Dataset.from_dict({"text": list(calibration)})
        columns = ["text"]

        def tokenize(batch):
            return model.tokenizer(
                batch["text"], padding="max_length", max_length=384, truncation=True
            )
    else:
        dataset = Dataset.from_dict(
            {"query": [q for q, _ in calibration], "passage": [p for _, p in calibration]}
        )
        columns = ["query", "passage"]

        def tokenize(batch):
            return model.tokenizer(
                batch["query"],
                batch["passage"],
                padding="max_length",
                max_length=384,
                truncation=True,
            )

    dataset = dataset.map(tokenize, batched=True, remove_columns=columns)
    save_or_push_to_hub_model(
        export_function=lambda save_dir: quantizer.quantize(
            dataset, save_directory=save_dir, ov_config=OVConfig(quantization_config=config)
        ),
        export_function_name="export_static_quantized_openvino_model",
        config=config,
        model_name_or_path=str(export_dir),
        file_suffix="qint8_quantized",
        backend="openvino",
        model=model,
    )


def prepare(
    engine: str, task: str, source: Path, export_dir: Path, calibration: list, max_len: int
) -> Export:
    """The export for `engine`, made (and cached in export_dir) if it is not there yet."""
    spec = EXPORTS[engine]
    if not (export_dir / "config.json").exists():
        tmp = export_dir.with_suffix(".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(source, tmp)
        tmp.rename(export_dir)
    base = EXPORTS["st-onnx" if spec.backend == "onnx" else "st-openvino"]
    _float_export(task, export_dir, base.backend, base.file_name, max_len)
    if spec.quantize and not (export_dir / spec.file_name).exists():
        if spec.quantize == "dynamic":
            _dynamic_int8(task, export_dir, max_len)
        else:
            _static_int8(task, export_dir, calibration, max_len)
    return spec


def load(engine: str, task: str, export_dir: Path, max_len: int, ov_precision: str = "f32"):
    """The sentence-transformers model (SentenceTransformer or CrossEncoder) on the export;
    ov_precision: OpenVINO's INFERENCE_PRECISION_HINT (f32, bf16, or default: OpenVINO's choice)."""
    spec = EXPORTS[engine]
    return _load(task, export_dir, spec.backend, spec.file_name, max_len, ov_precision)
