"""Writing tiny random Wan checkpoints with diffusers' ``save_pretrained``, and running diffusers on them.

Shared by the checkpoint tests. Everything is built from diffusers' and transformers' own
classes with seeded random weights, so a directory written here is exactly what
``WanPipeline.from_pretrained`` loads, in any size fv-wan has no card for.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from fv_wan.models.tokenizer import ByteTokenizer

__all__ = ["byte_level_hf_tokenizer", "tiny_transformer_config", "tiny_vae_config", "write_checkpoint", "diffusers_model",
           "reference_pipeline", "to_original_layout"]


def byte_level_hf_tokenizer() -> Any:
    """A real Hugging Face fast tokenizer with ByteTokenizer's ids (< 259), so save/reload works.

    Each UTF-8 byte b is one token with id b + 3 (pad 0, eos 1, unk 2); eos is appended, as T5 does.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    # The byte-level pre-tokenizer spells byte b as a printable character: the printable Latin-1
    # bytes stand for themselves, the rest are moved to 256, 257, ... in byte order.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelled = {b: chr(b) for b in printable}
    for offset, b in enumerate(b for b in range(256) if b not in spelled):
        spelled[b] = chr(256 + offset)
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{spelled[b]: b + ByteTokenizer.byte_offset for b in range(256)}}
    assert set(spelled.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", model_max_length=512
    )


def tiny_transformer_config(**overrides: Any) -> dict[str, Any]:
    """``WanTransformer3DModel`` kwargs of a 3-layer, 3-head model no built-in card has."""
    config = dict(
        patch_size=(1, 2, 2), num_attention_heads=3, attention_head_dim=8, in_channels=16, out_channels=16, text_dim=48,
        freq_dim=32, ffn_dim=40, num_layers=3, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
        image_dim=None, added_kv_proj_dim=None, rope_max_seq_len=32,
    )  # fmt: skip
    config.update(overrides)
    return config


def tiny_vae_config(**overrides: Any) -> dict[str, Any]:
    """``AutoencoderKLWan`` kwargs: Wan 2.1 layout, base_dim 12 (the tiny cards use 8)."""
    config = dict(base_dim=12, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1, temperal_downsample=[False, True, True])
    config.update(overrides)
    return config


def _seeded(seed: int, build: Any) -> Any:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def _text_encoder(d_model: int, seed: int) -> Any:
    from transformers import UMT5Config, UMT5EncoderModel

    config = UMT5Config(
        vocab_size=ByteTokenizer.vocab_size, d_model=d_model, d_kv=8, d_ff=2 * d_model, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=32, dropout_rate=0.0,
        feed_forward_proj="gated-gelu", pad_token_id=ByteTokenizer.pad_token_id, eos_token_id=ByteTokenizer.eos_token_id,
    )  # fmt: skip
    return _seeded(seed, lambda: UMT5EncoderModel(config).eval())


def write_checkpoint(
    root: Path,
    *,
    transformer: dict[str, Any],
    vae: dict[str, Any],
    scheduler: Any,
    text_d_model: int | None = None,
    transformer_2: dict[str, Any] | None = None,
    boundary_ratio: float | None = None,
    expand_timesteps: bool = False,
    image_encoder_width: int | None = None,
    seed: int = 0,
) -> Path:
    """Write a Wan pipeline (``WanImageToVideoPipeline`` when ``image_encoder_width`` or ``in_channels``
    says image-to-video) with ``save_pretrained``: seeded random weights, a byte-level tokenizer."""
    from diffusers import AutoencoderKLWan, WanImageToVideoPipeline, WanPipeline, WanTransformer3DModel

    modules: dict[str, Any] = {
        "tokenizer": byte_level_hf_tokenizer(),
        "text_encoder": _text_encoder(text_d_model or transformer["text_dim"], seed + 1),
        "vae": _seeded(seed + 2, lambda: AutoencoderKLWan(**vae).eval()),
        "scheduler": scheduler,
        "transformer": _seeded(seed + 3, lambda: WanTransformer3DModel(**transformer).eval()),
    }
    if transformer_2 is not None:
        modules["transformer_2"] = _seeded(seed + 4, lambda: WanTransformer3DModel(**transformer_2).eval())
    image = image_encoder_width is not None or transformer["in_channels"] != vae.get("z_dim", 16)
    if image_encoder_width is not None:
        from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

        config = CLIPVisionConfig(hidden_size=image_encoder_width, intermediate_size=2 * image_encoder_width,
                                  num_hidden_layers=3, num_attention_heads=2, image_size=32, patch_size=8,
                                  projection_dim=image_encoder_width)
        modules["image_encoder"] = _seeded(seed + 5, lambda: CLIPVisionModel(config).eval())
        modules["image_processor"] = CLIPImageProcessor(size=32, crop_size=32)
    cls = WanImageToVideoPipeline if image else WanPipeline
    pipe = cls(**modules, boundary_ratio=boundary_ratio, expand_timesteps=expand_timesteps)
    pipe.save_pretrained(root, safe_serialization=True)
    return root


def diffusers_model(cls: Any, folder: Path) -> Any:
    """A diffusers model from a saved folder without ``from_pretrained``.

    ``from_pretrained`` of models with ``_keep_in_fp32_modules`` (WanTransformer3DModel) insists on
    ``low_cpu_mem_usage``, which needs ``accelerate``; the plain config + state-dict route does not.
    """
    model = cls.from_config(cls.load_config(folder))
    index = folder / "diffusion_pytorch_model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["diffusion_pytorch_model.safetensors"]
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(folder / name))
    model.load_state_dict(state, strict=True)
    return model.eval()


def reference_pipeline(root: Path, *, transformer_folder: Path | None = None) -> Any:
    """``<model_index's pipeline>.from_pretrained(root)``: tokenizer, encoders, scheduler and options from the
    directory; the transformer(s) and VAE from their saved folders (see :func:`diffusers_model`)."""
    import diffusers
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    index = json.loads((root / "model_index.json").read_text())
    cls = getattr(diffusers, index["_class_name"])
    models: dict[str, Any] = {
        "transformer": diffusers_model(WanTransformer3DModel, transformer_folder or root / "transformer"),
        "vae": diffusers_model(AutoencoderKLWan, root / "vae"),
    }
    if index.get("transformer_2", [None, None])[0] is not None:
        models["transformer_2"] = diffusers_model(WanTransformer3DModel, root / "transformer_2")
    pipe = cls.from_pretrained(root, **models)
    pipe.set_progress_bar_config(disable=True)
    return pipe


#: diffusers -> original Wan release names, written out here independently of fv's declared
#: ORIGINAL_TO_DIFFUSERS_KEYMAP (which goes the other way), so the tests check that map.
TO_ORIGINAL = (
    (r"condition_embedder\.text_embedder\.linear_1\.", "text_embedding.0."),
    (r"condition_embedder\.text_embedder\.linear_2\.", "text_embedding.2."),
    (r"condition_embedder\.time_embedder\.linear_1\.", "time_embedding.0."),
    (r"condition_embedder\.time_embedder\.linear_2\.", "time_embedding.2."),
    (r"condition_embedder\.time_proj\.", "time_projection.1."),
    (r"\.attn1\.to_([qkv])\.", r".self_attn.\1."),
    (r"\.attn1\.to_out\.0\.", ".self_attn.o."),
    (r"\.attn1\.norm_([qk])\.", r".self_attn.norm_\1."),
    (r"\.attn2\.to_([qkv])\.", r".cross_attn.\1."),
    (r"\.attn2\.to_out\.0\.", ".cross_attn.o."),
    (r"\.attn2\.norm_([qk])\.", r".cross_attn.norm_\1."),
    (r"^(blocks\.\d+)\.norm2\.", r"\1.norm3."),  # the cross-attention norm is norm3 in the original
    (r"\.ffn\.net\.0\.proj\.", ".ffn.0."),
    (r"\.ffn\.net\.2\.", ".ffn.2."),
    (r"^(blocks\.\d+)\.scale_shift_table$", r"\1.modulation"),
    (r"^proj_out\.", "head.head."),
    (r"^scale_shift_table$", "head.modulation"),
)


def to_original_layout(folder: Path, *, prefix: str = "model.diffusion_model.", round_to: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Rewrite a diffusers-layout (text-to-video) transformer folder in the original Wan release's layout.

    Weights renamed (with a ComfyUI-style ``prefix``; optionally rounded through ``round_to``, as releases
    ship) into ``wan2.1_tiny.safetensors``; ``config.json`` in the original field names. Returns the weights.
    """
    c = json.loads((folder / "config.json").read_text())
    original = {}
    for key, tensor in load_file(folder / "diffusion_pytorch_model.safetensors").items():
        for pattern, replacement in TO_ORIGINAL:
            key = re.sub(pattern, replacement, key)
        original[f"{prefix}{key}"] = tensor if round_to is None else tensor.to(round_to).float()
    assert f"{prefix}head.head.weight" in original
    (folder / "diffusion_pytorch_model.safetensors").unlink()
    save_file(original, folder / "wan2.1_tiny.safetensors")
    (folder / "config.json").write_text(json.dumps({
        "_class_name": "WanModel", "model_type": "t2v", "dim": c["num_attention_heads"] * c["attention_head_dim"],
        "num_heads": c["num_attention_heads"], "num_layers": c["num_layers"], "ffn_dim": c["ffn_dim"],
        "freq_dim": c["freq_dim"], "in_dim": c["in_channels"], "out_dim": c["out_channels"], "eps": c["eps"],
        "text_dim": c["text_dim"], "text_len": 512,
    }))  # fmt: skip
    return original
