"""A tiny Qwen2-VL checkpoint with random weights, built locally.

    python -m ecmooncake tiny-model DIR [--seed N] [--dtype bfloat16]

Writes a complete checkpoint that ``vllm serve DIR`` loads on a CPU: the
model config and random weights (float32, or bfloat16 for a GPU) (LM hidden size 128, 2 layers; a
vision tower of width 64 and 2 blocks), a byte-level BPE tokenizer trained
here with the ``tokenizers`` library plus Qwen2-VL's special tokens, the
chat template, and the image processor's config. Nothing is downloaded; the
same seed gives the same files, so two instances built from one directory
compute bit-identical encoder outputs and tokens.

Needs torch, transformers and tokenizers (a vLLM environment has them).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# Qwen2-VL's special tokens, in the order the real tokenizer numbers them.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# Qwen2-VL-Instruct's chat template: an image part becomes
# <|vision_start|><|image_pad|><|vision_end|>, which the processor expands
# to one pad per merged patch.
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Images are resized to between these many pixels: a 112 x 112 image is
# 8 x 8 patches of 14, merged 2 x 2 into 16 placeholder tokens.
MIN_PIXELS = 56 * 56
MAX_PIXELS = 224 * 224

HIDDEN = 128
LAYERS = 2
HEADS = 4
KV_HEADS = 2
VISION_WIDTH = 64
VISION_DEPTH = 2
VISION_HEADS = 2


def _corpus() -> list[str]:
    """Plain text to learn merges from: enough to give words their tokens."""
    words = (
        "the a an image picture photo of in on with and is are what describe this that "
        "color red green blue yellow black white cat dog house tree sky sea car person "
        "you i assistant user system helpful answer question please tell me about it "
        "one two three four five big small left right top bottom here there"
    ).split()
    lines = []
    for i in range(2000):
        lines.append(" ".join(words[(i * 7 + k * 13) % len(words)] for k in range(12)))
    lines += ["You are a helpful assistant.", "What is in this image?", "Describe the picture."]
    return lines


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[3:],
        model_max_length=32768,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


DTYPES = ("float32", "bfloat16")


def build(out: Path | str, seed: int = 0, dtype: str = "float32") -> Path:
    """Writes the checkpoint into out (created) and returns its path; the
    weights are drawn in float32 from seed, then cast to dtype."""
    import torch
    from transformers import (
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    vocab = (len(tokenizer) + 63) // 64 * 64
    head_dim = HIDDEN // HEADS
    config = Qwen2VLConfig(
        text_config={
            "vocab_size": vocab,
            "hidden_size": HIDDEN,
            "intermediate_size": 4 * HIDDEN,
            "num_hidden_layers": LAYERS,
            "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS,
            "max_position_embeddings": 4096,
            "max_window_layers": LAYERS,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1000000.0,
                # the three sections (time, height, width) split head_dim / 2
                "mrope_section": [head_dim // 8, 3 * head_dim // 16, 3 * head_dim // 16],
            },
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
            "tie_word_embeddings": False,
        },
        vision_config={
            "depth": VISION_DEPTH,
            "embed_dim": VISION_WIDTH,
            "hidden_size": HIDDEN,
            "num_heads": VISION_HEADS,
            "mlp_ratio": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config).to(torch.float32).eval()
    if dtype != "float32":
        model = model.to(getattr(torch, dtype))
        model.config.dtype = dtype
    model.save_pretrained(out, safe_serialization=True)
    image_processor = Qwen2VLImageProcessor(
        min_pixels=MIN_PIXELS,
        max_pixels=MAX_PIXELS,
        patch_size=14,
        merge_size=2,
        temporal_patch_size=2,
    )
    video_processor = Qwen2VLVideoProcessor(
        min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=14, merge_size=2, temporal_patch_size=2
    )
    processor = Qwen2VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"], "do_sample": False}, indent=2)
    )
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="directory to write the checkpoint into (created)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default %(default)s)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="the weights' type (default %(default)s)")


def main(args: argparse.Namespace) -> int:
    try:
        path = build(args.dir, seed=args.seed, dtype=args.dtype)
    except ImportError as exc:
        print(f"ecmooncake tiny-model: needs torch, transformers and tokenizers ({exc})", file=sys.stderr)
        return 2
    print(path)
    return 0
