"""FP8 Wan transformers: which linears a precision path quantizes, and ComfyUI's fp8 checkpoint files.

Three on-disk fp8 layouts load, each keeping the file's own e4m3 bytes and scales (no
dequantize-then-requantize round trip, so an :class:`Fp8Linear` holds exactly what the file holds):

- ``scaled_fp8`` (ComfyUI's legacy ``*_fp8_scaled.safetensors``): a ``scaled_fp8`` marker tensor,
  e4m3 ``<layer>.weight`` with a per-tensor fp32 ``<layer>.scale_weight`` and an optional static
  ``<layer>.scale_input``;
- ``comfy_quant`` (ComfyUI's current format, also ModelOpt's names): ``<layer>.weight_scale`` and
  ``<layer>.input_scale``, each layer described by a ``<layer>.comfy_quant`` tensor (JSON bytes) or by
  the header's ``_quantization_metadata``;
- ``e4m3fn`` (``*_fp8_e4m3fn.safetensors``): e4m3 weights without scales, i.e. scale 1.

Names may be diffusers' or the original Wan release's (ComfyUI's files use the latter, under
``model.diffusion_model.``). Static input scales are read and not used: fv's ``fp8_dynamic`` path
quantizes activations per token at run time, which bounds the error per row instead of per tensor.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from fv_kernel.api import (
    Fp8Error,
    Fp8Linear,
    PrecisionContract,
    PrecisionPathContract,
    dequantize_e4m3,
)

__all__ = [
    "WAN_FP8_MAX_JUDGE_DELTA",
    "WAN_FP8_MIN_PSNR_DB",
    "WAN_FP8_TARGETS",
    "Fp8Checkpoint",
    "Fp8Layout",
    "install_fp8_checkpoint",
    "read_safetensors_metadata",
    "split_fp8_checkpoint",
    "wan_precision_contract",
]

#: The linears an fp8 path quantizes in a Wan transformer (fnmatch globs over module paths):
#: self- and cross-attention q/k/v/out and the FFN of every block, as ComfyUI's fp8_scaled files,
#: ModelOpt and LightX2V quantize them. Modulation, the time/text/image embedders, the patch
#: embedding, norms and ``proj_out`` stay in the card's precision (vLLM-Omni found FP8 on
#: multiplicative control signals visibly degrades output).
WAN_FP8_TARGETS: tuple[str, ...] = (
    "blocks.*.attn1.to_q", "blocks.*.attn1.to_k", "blocks.*.attn1.to_v", "blocks.*.attn1.to_out.0",
    "blocks.*.attn2.to_q", "blocks.*.attn2.to_k", "blocks.*.attn2.to_v", "blocks.*.attn2.to_out.0",
    "blocks.*.ffn.net.0.proj", "blocks.*.ffn.net.2",
)

Fp8Layout = Literal["scaled_fp8", "comfy_quant", "e4m3fn"]

_WEIGHT_SCALE_SUFFIXES = (".scale_weight", ".weight_scale")
_INPUT_SCALE_SUFFIXES = (".scale_input", ".input_scale")
_SUPPORTED_FORMATS = ("float8_e4m3fn",)


def read_safetensors_metadata(folder: Path) -> dict[str, str]:
    """The string metadata of every ``*.safetensors`` header in ``folder`` (or of one such file), merged."""
    from safetensors import safe_open

    metadata: dict[str, str] = {}
    files = [Path(folder)] if Path(folder).is_file() else sorted(Path(folder).glob("*.safetensors"))
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            metadata.update(handle.metadata() or {})
    return metadata


@dataclass
class Fp8Checkpoint:
    """A checkpoint's tensors with its fp8 layers taken apart (names as in the file).

    ``tensors`` holds every tensor that is not a scale or marker (the quantized layers'
    e4m3 ``.weight`` included); ``weight_scales`` maps a quantized layer's weight key to its fp32
    scale (0-dim per tensor, or ``[out]`` per channel; 1.0 in an ``e4m3fn`` file).
    """

    layout: Fp8Layout
    tensors: dict[str, torch.Tensor]
    weight_scales: dict[str, torch.Tensor]
    #: Static activation scales found (weight key -> scale); not used by fv's paths (module docstring).
    input_scales: dict[str, torch.Tensor] = field(default_factory=dict)

    def renamed(self, rename: Mapping[str, str]) -> Fp8Checkpoint:
        """The same checkpoint with keys renamed (``rename`` covers every key of ``tensors``)."""
        return Fp8Checkpoint(
            layout=self.layout, tensors={rename[k]: v for k, v in self.tensors.items()},
            weight_scales={rename[k]: v for k, v in self.weight_scales.items()},
            input_scales={rename[k]: v for k, v in self.input_scales.items()},
        )


def _layer_format(raw: object, where: str) -> None:
    fmt = raw.get("format") if isinstance(raw, dict) else None
    if fmt not in _SUPPORTED_FORMATS:
        raise Fp8Error(f"{where}: quantization format {fmt!r} cannot be loaded; allowed: {', '.join(_SUPPORTED_FORMATS)}",
                       param="model")


def _scale_tensor(scale: torch.Tensor, weight: torch.Tensor, key: str) -> torch.Tensor:
    scale = scale.detach().float()
    if scale.numel() == 1:
        return scale.reshape(())
    if scale.numel() == weight.shape[0]:
        return scale.reshape(weight.shape[0])
    raise Fp8Error(f"{key}: a weight scale of shape {tuple(scale.shape)} is neither per tensor (1 element) nor per "
                   f"output channel ({weight.shape[0]} elements)", param="model")


def split_fp8_checkpoint(state_dict: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
                         ) -> Fp8Checkpoint | None:
    """``state_dict``'s fp8 layout taken apart, or None when it holds no fp8 tensor, marker or scale.

    Raises :class:`Fp8Error` for what fv cannot run bit-exactly: another fp8 dtype than e4m3fn
    (``float8_e5m2`` files, nvfp4/mxfp8 ``comfy_quant`` formats), or a scale whose layer has no
    e4m3 weight.
    """
    tensors = dict(state_dict)
    raw_scales: dict[str, torch.Tensor] = {}
    input_scales: dict[str, torch.Tensor] = {}
    layout: Fp8Layout | None = None
    for key in list(tensors):
        leaf = key.rsplit(".", 1)[-1]
        if leaf == "scaled_fp8":
            marker = tensors.pop(key)
            if marker.dtype not in (torch.float8_e4m3fn, torch.float32):  # float32 means e4m3fn to ComfyUI too
                raise Fp8Error(f"{key}: a scaled_fp8 file of {marker.dtype} cannot be loaded; allowed: float8_e4m3fn",
                               param="model")
            layout = "scaled_fp8"
        elif leaf == "comfy_quant":
            _layer_format(json.loads(bytes(tensors.pop(key).to(torch.uint8).tolist()).decode()), key)
            layout = layout or "comfy_quant"
        elif any(key.endswith(s) for s in _WEIGHT_SCALE_SUFFIXES):
            raw_scales[key.rsplit(".", 1)[0] + ".weight"] = tensors.pop(key)
            if key.endswith(".weight_scale"):
                layout = layout or "comfy_quant"
        elif any(key.endswith(s) for s in _INPUT_SCALE_SUFFIXES):
            input_scales[key.rsplit(".", 1)[0] + ".weight"] = tensors.pop(key).detach().float()
    quant_meta = (metadata or {}).get("_quantization_metadata")
    if quant_meta is not None:
        for layer, conf in json.loads(quant_meta).get("layers", {}).items():
            _layer_format(conf, f"_quantization_metadata layer {layer!r}")
        layout = layout or "comfy_quant"
    other_fp8 = sorted(k for k, v in tensors.items() if v.dtype in (torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz))
    if other_fp8:
        raise Fp8Error(f"{other_fp8[0]}: {tensors[other_fp8[0]].dtype} weights cannot be loaded; allowed: float8_e4m3fn",
                       param="model")
    e4m3 = {k for k, v in tensors.items() if v.dtype == torch.float8_e4m3fn}
    if layout is None and not e4m3 and not raw_scales:
        return None
    orphans = sorted(k for k in [*raw_scales, *input_scales] if k not in e4m3)
    if orphans:
        raise Fp8Error(f"{orphans[0]}: a scale for a weight that is not float8_e4m3fn in the file", param="model")
    scales = {k: _scale_tensor(raw_scales[k], tensors[k], k) if k in raw_scales else torch.ones(()) for k in e4m3}
    if layout is None:
        layout = "e4m3fn"
    return Fp8Checkpoint(layout=layout, tensors=tensors, weight_scales=scales, input_scales=input_scales)


def install_fp8_checkpoint(
    model: nn.Module, checkpoint: Fp8Checkpoint, *, mode: Literal["fp8_weights", "fp8_dynamic"] | None,
    dtype: torch.dtype, kernel: str = "auto",
) -> dict[str, torch.Tensor]:
    """Prepare ``model`` (built on ``meta``, diffusers names) for ``checkpoint`` (renamed to them).

    With ``mode``, each linear whose weight the file holds in e4m3 becomes an :class:`Fp8Linear`
    (per-tensor or per-channel scale, as the file has it) taking the file's bytes and scale as they
    are; other e4m3 tensors (a ``*_fp8_e4m3fn`` file may cast non-linears too) are dequantized to
    ``dtype``. ``mode=None`` (the native path) dequantizes every e4m3 tensor to ``dtype``.
    Returns the state dict to load (``assign=True``).
    """
    state: dict[str, torch.Tensor] = {}
    modules = dict(model.named_modules())
    for key, tensor in checkpoint.tensors.items():
        scale = checkpoint.weight_scales.get(key)
        if scale is None:
            state[key] = tensor
            continue
        layer = key[: -len(".weight")] if key.endswith(".weight") else None
        target = modules.get(layer) if layer is not None else None
        if mode is not None and isinstance(target, nn.Linear):
            parent_path, _, leaf = layer.rpartition(".")
            fp8 = Fp8Linear(target.in_features, target.out_features, bias=target.bias is not None, mode=mode,
                            per_channel=scale.dim() == 1, kernel=kernel, device="meta")
            setattr(model.get_submodule(parent_path) if parent_path else model, leaf, fp8)
            state[key] = tensor
            state[f"{layer}.weight_scale"] = scale
        else:
            state[key] = dequantize_e4m3(tensor, scale.reshape(-1, *([1] * (tensor.dim() - 1))) if scale.dim() else scale, dtype)
    return state


#: Final-video PSNR floor (dB) against the native path for every fp8 path of a Wan card: above
#: 30 dB the difference is below what 8-bit video coding of the same clip already loses (H.264
#: at ordinary quality is 30-40 dB), so the path serves the same video.
WAN_FP8_MIN_PSNR_DB = 30.0
#: On a card with the toy judge (wan-toy): each judge score within this many points of native (issue 34).
WAN_FP8_MAX_JUDGE_DELTA = 2.0


def wan_precision_contract(
    base: PrecisionContract, components: tuple[str, ...], *, judged: bool = False,
) -> PrecisionContract:
    """``base`` with the fp8 paths a Wan card allows: ``fp8_targets`` on each transformer in
    ``components``, and every path under the same quality contract (``judged``: the toy judge's
    scores too)."""
    why = (f"final video >= {WAN_FP8_MIN_PSNR_DB:g} dB PSNR against the native path over the card's default trajectory"
           + (f", and the toy judge's colour and direction within {WAN_FP8_MAX_JUDGE_DELTA:g} points (issue 34)" if judged else "")
           + "; measured by bench/bench_precision_quality.py")
    paths = {
        path: PrecisionPathContract(path=path, min_psnr_db=WAN_FP8_MIN_PSNR_DB,
                                    max_judge_delta=WAN_FP8_MAX_JUDGE_DELTA if judged else None, justification=why)
        for path in ("fp8_weights", "fp8_dynamic", "fp8_attention", "fp8_all")
    }
    return PrecisionContract.model_validate(
        {**dict(base), "paths": paths, "fp8_targets": {c: WAN_FP8_TARGETS for c in components}})
