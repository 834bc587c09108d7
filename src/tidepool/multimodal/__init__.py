"""Images (and later other modalities) as the engine sees them.

features.py    MultiModalFeature: one item's processed tensors, content hash and placeholder
               range in the prompt (a leaf: the request carries them, the runner encodes them)
processing.py  a prompt + PIL images → token ids with placeholders + features, with the
               model's own Hugging Face processor; one ImagePromptProcessor per model family
dual_tower.py  CLIP / SigLIP: an image-only prompt ("" + one image) → its placeholders
media.py       decoding images from bytes, data: URLs, http(s) URLs and local paths (limits)
"""
