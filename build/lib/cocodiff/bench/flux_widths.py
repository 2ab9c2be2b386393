"""Write a FLUX.1-dev-widths pipeline folder: the real transformer's widths at reduced depth.

    python -m cocodiff.bench.flux_widths PATH [--double 2] [--single 2]

The transformer has FLUX.1-dev's widths (hidden 3072 = 24 heads x 128, T5 width 4096, CLIP's
pooled 768, guidance embedding) at `--double` double and `--single` single blocks (2 + 2: 1.03 B
parameters), beside one-layer CLIP and T5 encoders of those widths with a 36-word vocabulary, a
small AutoencoderKL (16 latent channels, widths 32) and FLUX.1's scheduler; random weights, fp32
safetensors (4 GB at 2 + 2). `FluxPipeline.from_pretrained(PATH)` loads it, so every command takes
it as `--model PATH`: memory and step times of a real-width transformer without a checkpoint
(docs/usage.md, "Sharded weights").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

__all__ = ["build", "main"]

WORDS = ("<pad>", "</s>", "<unk>", "<|startoftext|>", "<|endoftext|>", *"abcdefghijklmnopqrstuvwxyz",
         "small", "green", "star", "red", "circle")


def build(double: int = 2, single: int = 2, seed: int = 0):
    """The pipeline (random weights from `seed`)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizerFast, PreTrainedTokenizerFast, T5Config, T5EncoderModel

    torch.manual_seed(seed)
    vocab = {word: i for i, word in enumerate(WORDS)}
    words = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", end_of_word_suffix=""))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    clip_tokenizer = CLIPTokenizerFast(tokenizer_object=words, bos_token="<|startoftext|>", eos_token="<|endoftext|>",
                                       pad_token="<|endoftext|>", unk_token="<unk>", model_max_length=77)
    t5_tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
                                           model_max_length=512)
    clip = CLIPTextModel(CLIPTextConfig(vocab_size=len(vocab), hidden_size=768, intermediate_size=256, num_hidden_layers=1,
                                        num_attention_heads=2, max_position_embeddings=77, projection_dim=768,
                                        bos_token_id=3, eos_token_id=4, pad_token_id=4))
    t5 = T5EncoderModel(T5Config(vocab_size=len(vocab), d_model=4096, d_kv=64, num_heads=2, d_ff=256, num_layers=1))
    transformer = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=double, num_single_layers=single,
                                         attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                                         pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(32,) * 4, layers_per_block=1,
                        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4, norm_num_groups=8,
                        use_quant_conv=False, use_post_quant_conv=False, scaling_factor=0.3611, shift_factor=0.1159)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096)
    return FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=clip, tokenizer=clip_tokenizer, text_encoder_2=t5,
                        tokenizer_2=t5_tokenizer, transformer=transformer)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cocodiff.bench.flux_widths", description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, help="the folder to write (a diffusers pipeline)")
    parser.add_argument("--double", type=int, default=2, help="double-stream blocks (FLUX.1-dev: 19)")
    parser.add_argument("--single", type=int, default=2, help="single-stream blocks (FLUX.1-dev: 38)")
    args = parser.parse_args(argv)
    pipe = build(args.double, args.single)
    pipe.save_pretrained(args.path, safe_serialization=True)
    params = sum(p.numel() for p in pipe.transformer.parameters())
    print(f"{args.path}: FLUX.1-dev widths, {args.double} double + {args.single} single blocks, {params / 1e9:.2f} B parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
