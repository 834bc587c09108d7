"""A tiny random ColPali (`ColPaliForRetrieval`) folder and its reference processor.

The folder is what `save_pretrained` writes: config.json and weights, a byte-level BPE tokenizer
with Gemma's <pad> / <eos> / <bos> and PaliGemma's <image> (no automatic BOS: ColPaliProcessor
writes "<bos>" into its prompts and turns the tokenizer's own off), and the PIL SigLIP image
processor's preprocessor_config.json (32 px images, 8 px patches: 16 image tokens, the folder's
`image_seq_length`). Vision: SigLIP, 2 layers of 64 (2 heads of 32); text: Gemma, hidden 64,
2 layers, 4 query / 1 KV heads of 32, GeGLU 128; the projection to 24.
"""

from __future__ import annotations

from pathlib import Path

import torch

SPECIAL = ["<pad>", "<eos>", "<bos>", "<image>"]
PAD, EOS, BOS, IMAGE = range(4)
IMAGE_SIZE, PATCH_SIZE = 32, 8
NUM_IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2
CORPUS = [
    "Describe the image.",
    "Question: what does the chart show?",
    "a red square and a blue circle on a white page",
    "The quick brown fox jumps over the lazy dog.",
    "picture document page table figure caption",
]
TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=32,  # the CPU kernel's width, where it builds (as the vision heads)
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    hidden_act="gelu_pytorch_tanh",
    pad_token_id=PAD,
    eos_token_id=EOS,
    bos_token_id=BOS,
)
VISION = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=IMAGE_SIZE,
    patch_size=PATCH_SIZE,
    vision_use_head=False,  # PaliGemma's towers: last_hidden_state, no pooling head
)
EMBEDDING_DIM = 24


def save_tokenizer(folder: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        extra_special_tokens={"image_token": "<image>"},
    )
    fast.save_pretrained(str(folder))
    return fast


def image_processor():
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    processor = SiglipImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor.image_seq_length = NUM_IMAGE_TOKENS  # PaliGemma folders save it beside the sizes
    return processor


def colpali_config(vocab_size: int):
    from transformers import ColPaliConfig, PaliGemmaConfig

    vlm = PaliGemmaConfig(
        text_config=dict(TEXT, model_type="gemma", vocab_size=vocab_size),
        vision_config=dict(VISION, model_type="siglip_vision_model"),
        image_token_index=IMAGE,
        vocab_size=vocab_size,
        projection_dim=TEXT["hidden_size"],
        hidden_size=TEXT["hidden_size"],
    )
    config = ColPaliConfig(vlm_config=vlm.to_dict(), embedding_dim=EMBEDDING_DIM)
    config.architectures = ["ColPaliForRetrieval"]
    return config


def build_colpali(folder: Path, seed: int = 43) -> Path:
    from transformers import ColPaliForRetrieval

    folder.mkdir(parents=True)
    tokenizer = save_tokenizer(folder)
    config = colpali_config(len(tokenizer))
    torch.manual_seed(seed)
    model = ColPaliForRetrieval(config).eval()
    with torch.no_grad():  # Gemma's norms start at 0 (scale 1): give them some spread
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.normal_(0.0, 0.3)
    model.save_pretrained(str(folder))
    image_processor().save_pretrained(str(folder))
    return folder


def reference_processor(folder: Path):
    """transformers' ColPaliProcessor over the folder's tokenizer and image processor."""
    from transformers import AutoTokenizer, ColPaliProcessor

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    return ColPaliProcessor(image_processor=image_processor(), tokenizer=tokenizer)
