"""Which int8 layers hand their output on already quantized (`Int8Linear.feed`): where a linear's
output is, unchanged, the next linear's input, its epilogue quantizes each row for that next
linear while the row is in L1, and the next linear skips its quantizer pass (one read of the
tensor, ~10% of an int8 MiniLM pass).

The links follow the native encoders' layer shapes (models/bert.py and the models built on it,
models/t5.py): in a post-LN layer the attention output's LayerNorm'd rows are FFN up's input,
FFN up's rows FFN down's, and FFN down's LayerNorm'd rows the next layer's fused QKV input; in a
T5 FFN the (gated) up projection's rows are `wo`'s. A consumer takes the handoff only when it is
given that very tensor object, so a model that does something else with it stays correct, just
without the saving.
"""

from __future__ import annotations

from torch import nn

from tidepool.models.bert import BertLayer, BertSelfAttention
from tidepool.models.deberta_v2 import DebertaV2Layer
from tidepool.quantization.int8_linear import Int8Linear, Scratch


def link_handoffs(model: nn.Module) -> int:
    """Link the producer → consumer pairs of `model`'s int8 layers; returns how many. Also gives
    the layers whose output is read by one module only, right after (a BERT layer's fused QKV:
    the attention; FFN up: FFN down), one reused output buffer per role and model."""
    links = 0
    qkv_scratch, up_scratch = Scratch(), Scratch()
    _residual_stream_scratch(model)
    for module in model.modules():
        layers = getattr(module, "layer", None)
        if isinstance(layers, nn.ModuleList):
            for i, layer in enumerate(layers):
                up = _at(layer, "intermediate.dense")
                links += _link(_at(layer, "attention.output.dense"), up)
                # A BERT-family layer hands FFN up's output to FFN down only (bert.py,
                # mpnet.py, deberta_v2.py): its float32 form need not be written.
                exclusive = isinstance(layer, (BertLayer, DebertaV2Layer))
                if _link(up, _at(layer, "output.dense"), exclusive):
                    links += 1
                    up.use_scratch(up_scratch)  # type: ignore[union-attr]
                attention = _at(layer, "attention.self")
                if isinstance(attention, BertSelfAttention) and isinstance(
                    attention.qkv, Int8Linear
                ):
                    attention.qkv.use_scratch(qkv_scratch)
                if i + 1 < len(layers):
                    links += _link(
                        _at(layer, "output.dense"), _at(layers[i + 1], "attention.self.qkv")
                    )
        up = getattr(module, "wi_1", None) or getattr(module, "wi", None)
        links += _link(up, getattr(module, "wo", None))
    return links


def _residual_stream_scratch(model: nn.Module) -> None:
    """The residual stream of a post-LN layer stack takes two buffers in turn: layer i's
    attention output (read by its FFN up and FFN down) and its FFN down output (read by layer
    i + 1) are both dead when layer i + 1 writes the same buffers. The last layer's FFN down keeps
    fresh tensors: the model returns them."""
    for module in model.modules():
        layers = getattr(module, "layer", None)
        if not isinstance(layers, nn.ModuleList):
            continue
        attention_out, ffn_out = Scratch(), Scratch()
        for i, layer in enumerate(layers):
            linear = _at(layer, "attention.output.dense")
            if isinstance(linear, Int8Linear):
                linear.use_scratch(attention_out)
            linear = _at(layer, "output.dense")
            if isinstance(linear, Int8Linear) and i + 1 < len(layers):
                linear.use_scratch(ffn_out)


def _at(module: nn.Module, path: str) -> nn.Module | None:
    for name in path.split("."):
        module = getattr(module, name, None)
        if module is None:
            return None
    return module


def _link(producer: nn.Module | None, consumer: nn.Module | None, exclusive: bool = False) -> int:
    if isinstance(producer, Int8Linear) and isinstance(consumer, Int8Linear):
        producer.feed(consumer, exclusive)
        return 1
    return 0
