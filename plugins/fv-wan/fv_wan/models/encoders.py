"""Wan conditioning encoders: UMT5 text encoder and CLIP vision encoder.

The post-processing reproduces diffusers' Wan pipelines exactly:
``WanPipeline._get_t5_prompt_embeds`` (clean, pad to max length, encode with the mask,
cut each row to its real length and zero-pad back) and
``WanImageToVideoPipeline.encode_image`` (penultimate CLIP hidden states).
"""

from __future__ import annotations

import html
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from PIL import Image
from torch import nn

from fv_wan.models.tokenizer import ByteTokenizer
from fv_wan.models.umt5 import load_umt5

try:  # optional, as in diffusers: fixes mojibake before the html/whitespace cleanup
    import ftfy
except ImportError:  # pragma: no cover - depends on the environment
    ftfy = None

try:  # diffusers collapses whitespace with `regex` (Unicode White_Space), which differs from `re` on \x1c-\x1f
    import regex as re
except ImportError:  # pragma: no cover - transformers depends on regex
    import re

#: OpenAI CLIP normalisation constants (what CLIPImageProcessor uses by default).
CLIP_MEAN: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)

_WHITESPACE = re.compile(r"\s+")

ImageInput = Image.Image | torch.Tensor | np.ndarray


def clean_prompt(text: str) -> str:
    """ftfy (when installed), html-unescape twice, collapse whitespace, strip (diffusers ``prompt_clean``)."""
    if ftfy is not None:
        text = ftfy.fix_text(text)
    text = html.unescape(html.unescape(text)).strip()
    return _WHITESPACE.sub(" ", text).strip()


@contextmanager
def quiet_transformers_loading() -> Iterator[None]:
    """transformers' own "Loading weights" bar off while a component loads: fv shows one progress
    line per stage, and that bar writes ``\r`` frames even when stderr is not a terminal."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


class TextTokenizer(Protocol):
    """The Hugging Face tokenizer call subset the Wan text path uses (``ByteTokenizer`` implements it)."""

    def __call__(
        self,
        texts: Any,
        max_length: int | None = ...,
        padding: Any = ...,
        truncation: bool = ...,
        add_special_tokens: bool = ...,
        return_attention_mask: bool = ...,
        return_tensors: Any = ...,
    ) -> Any: ...


def _module_device_dtype(module: nn.Module) -> tuple[torch.device, torch.dtype]:
    parameter = next(module.parameters())
    return parameter.device, parameter.dtype


def _resolve_dir(path_or_repo: str | Path, subfolders: Sequence[str], local_files_only: bool) -> Path:
    path = Path(path_or_repo)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    patterns = [f"{subfolder}/*" for subfolder in subfolders]
    return Path(snapshot_download(str(path_or_repo), allow_patterns=patterns, local_files_only=local_files_only))


class WanTextEncoder(nn.Module):
    """UMT5 encoder + tokenizer producing Wan's (B, max_sequence_length, dim) zero-padded prompt embeddings."""

    def __init__(self, model: nn.Module, tokenizer: TextTokenizer) -> None:
        super().__init__()
        self.model = model
        self.tokenizer = tokenizer

    @torch.no_grad()
    def encode(
        self,
        prompts: str | Sequence[str],
        max_sequence_length: int = 512,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """Embeddings (B, max_sequence_length, dim); rows past each prompt's real token count are exactly 0."""
        if max_sequence_length < 1:
            raise ValueError(f"max_sequence_length must be >= 1, got {max_sequence_length}")
        batch = [prompts] if isinstance(prompts, str) else list(prompts)
        model_device, model_dtype = _module_device_dtype(self.model)
        tokens = self.tokenizer(
            [clean_prompt(prompt) for prompt in batch],
            padding="max_length",
            max_length=max_sequence_length,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        hidden = self.embed_ids(tokens.input_ids, tokens.attention_mask, max_sequence_length, dtype=dtype or model_dtype)
        return hidden.to(device) if device is not None else hidden

    @torch.no_grad()
    def embed_ids(
        self, input_ids: torch.Tensor, mask: torch.Tensor, max_sequence_length: int = 512, *, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """Already-tokenised prompts -> (B, max_sequence_length, dim), zero past each prompt's real length."""
        model_device, model_dtype = _module_device_dtype(self.model)
        # Right padding past the longest prompt cannot change a real token's output (its keys are
        # masked; T5's position bias is relative; every other layer is per token), so the encoder
        # runs over the longest prompt only: Wan pads to 512 tokens, a prompt is often ~30.
        width = max(int(mask.gt(0).sum(dim=1).max()), 1) if mask.numel() else mask.shape[1]
        if not mask[:, width:].gt(0).any():
            input_ids, mask = input_ids[:, :width], mask[:, :width]
        input_ids, mask = input_ids.to(model_device), mask.to(model_device)
        seq_lens = mask.gt(0).sum(dim=1)
        hidden = self.model(input_ids, mask).last_hidden_state.to(dtype or model_dtype)
        # Keep the first seq_len rows of each prompt, zeros after: diffusers' cut-and-re-pad, vectorised.
        length = hidden.shape[1]
        keep = torch.arange(length, device=hidden.device)[None, :] < seq_lens[:, None]
        hidden = torch.where(keep[..., None], hidden, torch.zeros((), dtype=hidden.dtype, device=hidden.device))
        if length < max_sequence_length:
            padding = hidden.new_zeros(hidden.shape[0], max_sequence_length - length, hidden.shape[2])
            hidden = torch.cat([hidden, padding], dim=1)
        return hidden

    def forward(self, prompts: str | Sequence[str], max_sequence_length: int = 512) -> torch.Tensor:
        return self.encode(prompts, max_sequence_length)

    @classmethod
    def from_pretrained(
        cls,
        path_or_repo: str | Path,
        *,
        subfolder: str = "text_encoder",
        tokenizer_subfolder: str = "tokenizer",
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        local_files_only: bool = True,
    ) -> WanTextEncoder:
        """Load ``UMT5EncoderModel`` and its tokenizer from a diffusers-layout Wan checkpoint (dir or repo id).

        A pair that :func:`fv_wan.models.umt5.load_umt5` reproduces exactly loads without transformers
        (seconds of import saved on a cold start); any other through transformers' classes.
        """
        root = _resolve_dir(path_or_repo, (subfolder, tokenizer_subfolder), local_files_only)
        own = load_umt5(root / subfolder, root / tokenizer_subfolder)
        if own is not None:
            return cls(own[0].to(device=device, dtype=dtype).eval(), own[1])
        from transformers import AutoTokenizer, UMT5EncoderModel

        tokenizer = AutoTokenizer.from_pretrained(root / tokenizer_subfolder, local_files_only=True)
        with quiet_transformers_loading():
            model = UMT5EncoderModel.from_pretrained(root / subfolder, local_files_only=True)
        return cls(model.to(device=device, dtype=dtype).eval(), tokenizer)

    @classmethod
    def tiny(cls, seed: int = 0, *, d_model: int = 32, num_layers: int = 2) -> WanTextEncoder:
        """A random few-layer UMT5 over the 259-id ``ByteTokenizer`` vocabulary (no download)."""
        from transformers import UMT5Config, UMT5EncoderModel

        config = UMT5Config(
            vocab_size=ByteTokenizer.vocab_size, d_model=d_model, d_kv=8, d_ff=2 * d_model,
            num_layers=num_layers, num_heads=4, relative_attention_num_buckets=8,
            relative_attention_max_distance=32, dropout_rate=0.0, feed_forward_proj="gated-gelu",
            pad_token_id=ByteTokenizer.pad_token_id, eos_token_id=ByteTokenizer.eos_token_id,
        )  # fmt: skip
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = UMT5EncoderModel(config)
        return cls(model.eval(), ByteTokenizer())


class ClipPreprocessor:
    """Built-in CLIP preprocessing: shortest-edge bicubic resize, center crop, /255, mean/std normalise.

    Mirrors ``CLIPImageProcessor`` defaults; used when a checkpoint ships no image processor config.
    """

    def __init__(
        self,
        size: int = 224,
        crop_size: int = 224,
        mean: Sequence[float] = CLIP_MEAN,
        std: Sequence[float] = CLIP_STD,
    ) -> None:
        if size < 1 or crop_size < 1 or crop_size > size:
            raise ValueError(f"need 1 <= crop_size <= size, got size={size}, crop_size={crop_size}")
        self.size = size
        self.crop_size = crop_size
        self.mean = np.asarray(mean, dtype=np.float32).reshape(3, 1, 1)
        self.std = np.asarray(std, dtype=np.float32).reshape(3, 1, 1)

    def _one(self, image: ImageInput) -> np.ndarray:
        pil = _to_pil(image)
        width, height = pil.size
        short, long = (width, height) if width <= height else (height, width)
        new_long = int(self.size * long / short)
        new_size = (self.size, new_long) if width <= height else (new_long, self.size)  # (w, h)
        array = np.asarray(pil.resize(new_size, resample=Image.Resampling.BICUBIC)).transpose(2, 0, 1)
        top = (array.shape[1] - self.crop_size) // 2
        left = (array.shape[2] - self.crop_size) // 2
        array = array[:, top : top + self.crop_size, left : left + self.crop_size]
        scaled = (array.astype(np.float64) * (1 / 255)).astype(np.float32)
        return (scaled - self.mean) / self.std

    def __call__(self, images: ImageInput | Sequence[ImageInput]) -> torch.Tensor:
        batch = list(images) if isinstance(images, (list, tuple)) else [images]
        return torch.from_numpy(np.stack([self._one(image) for image in batch]))


def _to_pil(image: ImageInput) -> Image.Image:
    """PIL images pass through (as RGB); tensors are (3, H, W) in [0, 1]; arrays are (H, W, 3) uint8."""
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, torch.Tensor):
        if image.ndim != 3 or image.shape[0] != 3:
            raise ValueError(f"image tensors must be (3, H, W) in [0, 1], got shape {tuple(image.shape)}")
        image = (image.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
            raise ValueError(f"image arrays must be (H, W, 3) uint8, got {image.dtype} {image.shape}")
        return Image.fromarray(image, mode="RGB")
    raise TypeError(f"unsupported image type {type(image).__name__}; use PIL.Image, torch.Tensor or np.ndarray")


class WanImageEncoder(nn.Module):
    """CLIP vision tower; ``encode`` returns the penultimate hidden states as Wan 2.1 I2V consumes them."""

    def __init__(self, model: nn.Module, processor: Callable[..., Any] | None = None) -> None:
        super().__init__()
        self.model = model
        # A transformers image processor (called with images=..., return_tensors="pt") or None for the built-in one.
        self.processor = processor
        self._builtin = ClipPreprocessor(*self._builtin_sizes(model)) if processor is None else None

    @staticmethod
    def _builtin_sizes(model: nn.Module) -> tuple[int, int]:
        image_size = int(getattr(getattr(model, "config", None), "image_size", 224))
        return image_size, image_size

    def pixel_values(self, images: ImageInput | Sequence[ImageInput]) -> torch.Tensor:
        if self.processor is not None:
            # As uint8 PIL images, like the built-in path: a processor given a [0, 1] float tensor
            # would rescale it by 1/255 a second time.
            batch = list(images) if isinstance(images, (list, tuple)) else [images]
            return self.processor(images=[_to_pil(image) for image in batch], return_tensors="pt").pixel_values
        assert self._builtin is not None
        return self._builtin(images)

    @torch.no_grad()
    def encode(
        self,
        images: ImageInput | Sequence[ImageInput],
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """(B, tokens, hidden) = ``hidden_states[-2]`` of the CLIP vision model."""
        hidden = self.embed_pixels(self.pixel_values(images))
        return hidden.to(device=device or hidden.device, dtype=dtype or hidden.dtype)

    @torch.no_grad()
    def embed_pixels(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Already-preprocessed pixels -> ``hidden_states[-2]`` (what Wan 2.1 I2V consumes)."""
        model_device, model_dtype = _module_device_dtype(self.model)
        pixels = pixel_values.to(device=model_device, dtype=model_dtype)
        return self.model(pixel_values=pixels, output_hidden_states=True).hidden_states[-2]

    def forward(self, images: ImageInput | Sequence[ImageInput]) -> torch.Tensor:
        return self.encode(images)

    @classmethod
    def from_pretrained(
        cls,
        path_or_repo: str | Path,
        *,
        subfolder: str = "image_encoder",
        processor_subfolder: str = "image_processor",
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        local_files_only: bool = True,
    ) -> WanImageEncoder:
        """Load ``CLIPVisionModel`` (+ ``CLIPImageProcessor`` when the checkpoint has one)."""
        from transformers import CLIPImageProcessor, CLIPVisionModel

        root = _resolve_dir(path_or_repo, (subfolder, processor_subfolder), local_files_only)
        with quiet_transformers_loading():
            model = CLIPVisionModel.from_pretrained(root / subfolder, local_files_only=True)
        processor_dir = root / processor_subfolder
        processor = (
            CLIPImageProcessor.from_pretrained(processor_dir, local_files_only=True)
            if (processor_dir / "preprocessor_config.json").is_file()
            else None
        )
        return cls(model.to(device=device, dtype=dtype).eval(), processor)

    @classmethod
    def tiny(
        cls, seed: int = 0, *, hidden_size: int = 16, image_size: int = 32, patch_size: int = 8
    ) -> WanImageEncoder:
        """A random 3-layer CLIP vision tower with the built-in preprocessing (no download)."""
        from transformers import CLIPVisionConfig, CLIPVisionModel

        config = CLIPVisionConfig(
            hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=3,
            num_attention_heads=2, image_size=image_size, patch_size=patch_size, projection_dim=hidden_size,
        )  # fmt: skip
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = CLIPVisionModel(config)
        return cls(model.eval())
