"""A tiny FLUX.1 checkpoint folder as `save_pretrained` writes one: tiny-flux's transformer and VAE
with a tiny CLIP and T5 and their tokenizers, built here (nothing downloaded), so that a command
loads it with `from_pretrained` and encodes prompts with its own text encoders, as a user's
checkpoint does."""

from __future__ import annotations

import json
import string
from pathlib import Path

import torch

WORDS = "a an the red green blue yellow circle square triangle on of with and small large".split()


def _clip(folder: Path):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    vocab: dict[str, int] = {}
    for c in string.ascii_lowercase + string.digits:  # one token per character: no merges
        vocab[c], vocab[c + "</w>"] = len(vocab), len(vocab) + 1
    for special in ("<|startoftext|>", "<|endoftext|>"):
        vocab[special] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"), model_max_length=77)
    end = vocab["<|endoftext|>"]
    model = CLIPTextModel(CLIPTextConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, max_position_embeddings=77, projection_dim=32,
                                         bos_token_id=vocab["<|startoftext|>"], eos_token_id=end, pad_token_id=end))
    return model, tokenizer


def _t5(folder: Path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from tokenizers.processors import TemplateProcessing
    from transformers import T5Config, T5EncoderModel, T5TokenizerFast

    pieces = ["<pad>", "</s>", "<unk>", *(f"\u2581{w}" for w in WORDS)]
    tokenizer = Tokenizer(models.Unigram([(piece, -1.0) for piece in pieces], unk_id=2))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.post_processor = TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    tokenizer.save(str(folder / "tokenizer.json"))
    fast = T5TokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), eos_token="</s>", pad_token="<pad>",
                           unk_token="<unk>", extra_ids=0)
    model = T5EncoderModel(T5Config(vocab_size=len(pieces), d_model=64, d_kv=16, d_ff=64, num_layers=1, num_heads=4))
    return model, fast


def flux_checkpoint(folder: Path, seed: int = 0) -> Path:
    """`folder`/pipe: a FluxPipeline checkpoint (tiny-flux's transformer and VAE, seeded) -> its path."""
    from diffusers import FluxPipeline

    from cocodiff.models.presets import load_pipeline

    pipe, _ = load_pipeline("tiny-flux", seed=seed)
    scratch = folder / "tokenizer-files"
    scratch.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        clip, clip_tokenizer = _clip(scratch)
        t5, t5_tokenizer = _t5(scratch)
    FluxPipeline(scheduler=pipe.scheduler, vae=pipe.vae, text_encoder=clip, tokenizer=clip_tokenizer, text_encoder_2=t5,
                 tokenizer_2=t5_tokenizer, transformer=pipe.transformer).save_pretrained(folder / "pipe")
    return folder / "pipe"


def skyreels_v2_checkpoint(folder: Path, seed: int = 0) -> Path:
    """`folder`/pipe: a SkyReels-V2 text-to-video checkpoint, a class with no plan written anywhere (its plan
    is inferred at the first call): a tiny transformer, Wan's VAE as tiny-wan's, a tiny UMT5 and its tokenizer."""
    from diffusers import (
        AutoencoderKLWan,
        SkyReelsV2Pipeline,
        SkyReelsV2Transformer3DModel,
        UniPCMultistepScheduler,
    )
    from transformers import UMT5EncoderModel

    scratch = folder / "tokenizer-files"
    scratch.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        t5, tokenizer = _t5(scratch)
        umt5 = UMT5EncoderModel(t5.config)
        transformer = SkyReelsV2Transformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16, in_channels=16, out_channels=16,
            text_dim=64, freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=64)
        vae = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1)
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=8.0)
    SkyReelsV2Pipeline(tokenizer=tokenizer, text_encoder=umt5, transformer=transformer, vae=vae,
                       scheduler=scheduler).save_pretrained(folder / "pipe")
    return folder / "pipe"
