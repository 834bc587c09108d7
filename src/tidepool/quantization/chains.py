"""Which int8 layers hand their output on already quantized (`Int8Linear.feed`): where a linear's
output is, unchanged, the next linear's input, its epilogue quantizes each row for that next
linear while the row is in L1, and the next linear skips its quantizer pass (one read of the
tensor, ~10% of an int8 MiniLM pass).

The links are the model's own declaration (`int8_layout()`'s hand-offs and reused outputs,
models/quantizable.py; e.g. bert.py's `BertLayer.HANDOFFS`): in a post-LN layer the attention
output's LayerNorm'd rows are FFN up's input, FFN up's rows FFN down's, and FFN down's
LayerNorm'd rows the next layer's fused QKV input; in a T5 FFN the (gated) up projection's rows
are `wo`'s. A consumer takes the handoff only when it is given that very tensor object, so a
declaration that misses what the model does stays correct, just without the saving.
"""

from __future__ import annotations

from torch import nn

from tidepool.models.quantizable import Int8Layout
from tidepool.quantization.int8_linear import Int8Linear, Scratch


def link_handoffs(model: nn.Module, layout: Int8Layout) -> int:
    """Link `layout`'s producer → consumer pairs where both are int8 layers; returns how many.
    Also gives each group of `layout.shared_outputs` one reused output buffer."""
    modules = dict(model.named_modules())
    links = 0
    for handoff in layout.handoffs:
        producer, consumer = modules.get(handoff.producer), modules.get(handoff.consumer)
        if isinstance(producer, Int8Linear) and isinstance(consumer, Int8Linear):
            producer.feed(consumer, handoff.exclusive)
            links += 1
    for group in layout.shared_outputs:
        scratch = Scratch()
        for name in group:
            linear = modules.get(name)
            if isinstance(linear, Int8Linear):
                linear.use_scratch(scratch)
    return links
