"""The ComfyUI nodes fv covers, described as ComfyUI describes them (``INPUT_TYPES``, ``RETURN_TYPES``).

Names, input order, types, defaults and ranges follow ComfyUI's ``nodes.py``,
``comfy_extras/nodes_wan.py`` (``WanImageToVideo``, ``Wan22ImageToVideoLatent``), ``nodes_video.py`` and ``nodes_model_advanced.py``. Only
values fv can run are listed for ``sampler_name`` and ``scheduler`` (:mod:`fv_comfyui.samplers`),
so a value fv cannot reproduce is ``value_not_in_list``, exactly as an unknown one is in
ComfyUI. Model file lists are filled from the user's mapping file (:mod:`fv_comfyui.models`).

The same table drives the UI→API converter (widget order), validation, ``/object_info``
and the compiler; nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

__all__ = ["InputSpec", "NodeSpec", "NODE_SPECS", "FRONTEND_ONLY", "node_spec", "object_info"]

MAX_RESOLUTION = 16384
#: ComfyUI allows seeds up to 2**64 - 1; fv's requests take seeds below 2**63, so the range says so
#: (a larger seed is ``value_bigger_than_max``, never silently wrapped).
MAX_SEED = 2**63 - 1

#: Widget types: literal values of these kinds live in ``widgets_values`` / API literals.
PRIMITIVE_TYPES = ("INT", "FLOAT", "STRING", "BOOLEAN")


@dataclass(frozen=True)
class InputSpec:
    """One input: ``kind`` is a type name (``"INT"``, ``"MODEL"``...) or ``"COMBO"`` with ``choices``."""

    name: str
    kind: str
    default: Any = None
    min: float | None = None
    max: float | None = None
    step: float | None = None
    choices: tuple[str, ...] | None = None
    #: ``choices`` come from a model folder (the mapping file), not a fixed list.
    folder: str | None = None
    control_after_generate: bool = False
    optional: bool = False
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def is_widget(self) -> bool:
        return self.kind in PRIMITIVE_TYPES or self.kind == "COMBO"

    def options(self) -> dict[str, Any]:
        """The options dict ``/object_info`` shows (second element of the input's tuple)."""
        out: dict[str, Any] = {}
        if self.default is not None:
            out["default"] = self.default
        for key in ("min", "max", "step"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        if self.control_after_generate:
            out["control_after_generate"] = True
        out.update(self.extra)
        return out


@dataclass(frozen=True)
class NodeSpec:
    class_type: str
    display_name: str
    inputs: tuple[InputSpec, ...]
    return_types: tuple[str, ...]
    return_names: tuple[str, ...]
    category: str
    output_node: bool = False
    description: str = ""
    #: A check ComfyUI's ``VALIDATE_INPUTS`` makes (e.g. ``LoadImage``: the file exists); returns
    #: an error message or ``None``. Receives the node's literal inputs and the validation context.
    validate: Callable[[Mapping[str, Any], Any], str | None] | None = None

    def input(self, name: str) -> InputSpec | None:
        return next((i for i in self.inputs if i.name == name), None)

    @property
    def widgets(self) -> tuple[InputSpec, ...]:
        return tuple(i for i in self.inputs if i.is_widget)


def _int(name: str, default: int, lo: int, hi: int, step: int = 1, **kw: Any) -> InputSpec:
    return InputSpec(name, "INT", default, lo, hi, step, **kw)


def _float(name: str, default: float, lo: float, hi: float, step: float, **kw: Any) -> InputSpec:
    return InputSpec(name, "FLOAT", default, lo, hi, step, **kw)


def _combo(name: str, choices: Sequence[str], default: str | None = None, **kw: Any) -> InputSpec:
    return InputSpec(name, "COMBO", default if default is not None else choices[0], choices=tuple(choices), **kw)


def _folder(name: str, folder: str) -> InputSpec:
    return InputSpec(name, "COMBO", folder=folder)


def _link(name: str, kind: str, optional: bool = False) -> InputSpec:
    return InputSpec(name, kind, optional=optional)


def _load_image_exists(inputs: Mapping[str, Any], context: Any) -> str | None:
    name = inputs.get("image")
    if not isinstance(name, str) or context is None or not context.image_exists(name):
        return f"Invalid image file: {name}"
    return None


def _specs(samplers: Sequence[str], schedulers: Sequence[str]) -> dict[str, NodeSpec]:
    sampler_inputs = (_combo("sampler_name", samplers), _combo("scheduler", schedulers))
    weight_dtypes = ("default", "fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2")
    clip_types = (
        "stable_diffusion", "stable_cascade", "sd3", "stable_audio", "mochi", "ltxv", "pixart", "cosmos", "lumina2",
        "wan", "hidream", "chroma", "ace", "omnigen2", "qwen_image", "hunyuan_image",
    )
    specs = [
        NodeSpec("UNETLoader", "Load Diffusion Model",
                 (_folder("unet_name", "diffusion_models"), _combo("weight_dtype", weight_dtypes)),
                 ("MODEL",), ("MODEL",), "advanced/loaders"),
        NodeSpec("CLIPLoader", "Load CLIP",
                 (_folder("clip_name", "text_encoders"), _combo("type", clip_types),
                  _combo("device", ("default", "cpu"), optional=True, extra={"advanced": True})),
                 ("CLIP",), ("CLIP",), "advanced/loaders"),
        NodeSpec("VAELoader", "Load VAE", (_folder("vae_name", "vae"),), ("VAE",), ("VAE",), "loaders"),
        NodeSpec("CLIPVisionLoader", "Load CLIP Vision", (_folder("clip_name", "clip_vision"),),
                 ("CLIP_VISION",), ("CLIP_VISION",), "loaders"),
        NodeSpec("CheckpointLoaderSimple", "Load Checkpoint", (_folder("ckpt_name", "checkpoints"),),
                 ("MODEL", "CLIP", "VAE"), ("MODEL", "CLIP", "VAE"), "loaders"),
        NodeSpec("LoraLoader", "Load LoRA",
                 (_link("model", "MODEL"), _link("clip", "CLIP"), _folder("lora_name", "loras"),
                  _float("strength_model", 1.0, -100.0, 100.0, 0.01), _float("strength_clip", 1.0, -100.0, 100.0, 0.01)),
                 ("MODEL", "CLIP"), ("MODEL", "CLIP"), "loaders"),
        NodeSpec("LoraLoaderModelOnly", "LoraLoaderModelOnly",
                 (_link("model", "MODEL"), _folder("lora_name", "loras"),
                  _float("strength_model", 1.0, -100.0, 100.0, 0.01)),
                 ("MODEL",), ("MODEL",), "loaders"),
        NodeSpec("ModelSamplingSD3", "ModelSamplingSD3",
                 (_link("model", "MODEL"), _float("shift", 3.0, 0.0, 100.0, 0.01)),
                 ("MODEL",), ("MODEL",), "advanced/model"),
        NodeSpec("CLIPTextEncode", "CLIP Text Encode (Prompt)",
                 (InputSpec("text", "STRING", extra={"multiline": True, "dynamicPrompts": True}), _link("clip", "CLIP")),
                 ("CONDITIONING",), ("CONDITIONING",), "conditioning"),
        NodeSpec("CLIPVisionEncode", "CLIP Vision Encode",
                 (_link("clip_vision", "CLIP_VISION"), _link("image", "IMAGE"), _combo("crop", ("center", "none"))),
                 ("CLIP_VISION_OUTPUT",), ("CLIP_VISION_OUTPUT",), "conditioning"),
        NodeSpec("LoadImage", "Load Image",
                 (InputSpec("image", "COMBO", folder="input", extra={"image_upload": True}),),
                 ("IMAGE", "MASK"), ("IMAGE", "MASK"), "image", validate=_load_image_exists),
        NodeSpec("EmptyHunyuanLatentVideo", "EmptyHunyuanLatentVideo",
                 (_int("width", 848, 16, MAX_RESOLUTION, 16), _int("height", 480, 16, MAX_RESOLUTION, 16),
                  _int("length", 25, 1, MAX_RESOLUTION, 4), _int("batch_size", 1, 1, 4096)),
                 ("LATENT",), ("LATENT",), "latent/video"),
        NodeSpec("WanImageToVideo", "WanImageToVideo",
                 (_link("positive", "CONDITIONING"), _link("negative", "CONDITIONING"), _link("vae", "VAE"),
                  _int("width", 832, 16, MAX_RESOLUTION, 16), _int("height", 480, 16, MAX_RESOLUTION, 16),
                  _int("length", 81, 1, MAX_RESOLUTION, 4), _int("batch_size", 1, 1, 4096),
                  _link("clip_vision_output", "CLIP_VISION_OUTPUT", optional=True),
                  _link("start_image", "IMAGE", optional=True)),
                 ("CONDITIONING", "CONDITIONING", "LATENT"), ("positive", "negative", "latent"), "conditioning/video_models"),
        NodeSpec("Wan22ImageToVideoLatent", "Wan22ImageToVideoLatent",
                 (_link("vae", "VAE"), _int("width", 1280, 32, MAX_RESOLUTION, 32), _int("height", 704, 32, MAX_RESOLUTION, 32),
                  _int("length", 49, 1, MAX_RESOLUTION, 4), _int("batch_size", 1, 1, 4096, step=None),  # type: ignore[arg-type]
                  _link("start_image", "IMAGE", optional=True)),
                 ("LATENT",), ("LATENT",), "conditioning/inpaint"),
        NodeSpec("KSampler", "KSampler",
                 (_link("model", "MODEL"), _int("seed", 0, 0, MAX_SEED, control_after_generate=True),
                  _int("steps", 20, 1, 10000), _float("cfg", 8.0, 0.0, 100.0, 0.1, extra={"round": 0.01}),
                  *sampler_inputs, _link("positive", "CONDITIONING"), _link("negative", "CONDITIONING"),
                  _link("latent_image", "LATENT"), _float("denoise", 1.0, 0.0, 1.0, 0.01)),
                 ("LATENT",), ("LATENT",), "sampling"),
        NodeSpec("KSamplerAdvanced", "KSampler (Advanced)",
                 (_link("model", "MODEL"), _combo("add_noise", ("enable", "disable")),
                  _int("noise_seed", 0, 0, MAX_SEED, control_after_generate=True),
                  _int("steps", 20, 1, 10000), _float("cfg", 8.0, 0.0, 100.0, 0.1, extra={"round": 0.01}),
                  *sampler_inputs, _link("positive", "CONDITIONING"), _link("negative", "CONDITIONING"),
                  _link("latent_image", "LATENT"), _int("start_at_step", 0, 0, 10000), _int("end_at_step", 10000, 0, 10000),
                  _combo("return_with_leftover_noise", ("disable", "enable"))),
                 ("LATENT",), ("LATENT",), "sampling"),
        NodeSpec("VAEDecode", "VAE Decode", (_link("samples", "LATENT"), _link("vae", "VAE")),
                 ("IMAGE",), ("IMAGE",), "latent"),
        NodeSpec("SaveAnimatedWEBP", "SaveAnimatedWEBP",
                 (_link("images", "IMAGE"), InputSpec("filename_prefix", "STRING", "ComfyUI"),
                  _float("fps", 6.0, 0.01, 1000.0, 0.01), InputSpec("lossless", "BOOLEAN", True),
                  _int("quality", 80, 0, 100), _combo("method", ("default", "fastest", "slowest"))),
                 (), (), "image/animation", output_node=True),
        NodeSpec("SaveWEBM", "SaveWEBM",
                 (_link("images", "IMAGE"), InputSpec("filename_prefix", "STRING", "ComfyUI"),
                  _combo("codec", ("vp9", "av1")), _float("fps", 24.0, 0.01, 1000.0, 0.01),
                  _float("crf", 32.0, 0, 63.0, 1)),
                 (), (), "image/video", output_node=True),
        NodeSpec("CreateVideo", "Create Video",
                 (_link("images", "IMAGE"), _float("fps", 30.0, 1.0, 120.0, 1.0), _link("audio", "AUDIO", optional=True)),
                 ("VIDEO",), ("VIDEO",), "image/video"),
        NodeSpec("SaveVideo", "Save Video",
                 (_link("video", "VIDEO"), InputSpec("filename_prefix", "STRING", "video/ComfyUI"),
                  _combo("format", ("auto", "mp4")), _combo("codec", ("auto", "h264"))),
                 (), (), "image/video", output_node=True),
    ]
    return {s.class_type: s for s in specs}


#: Frontend-only node types: the UI draws them, the API prompt never holds them.
FRONTEND_ONLY = frozenset({"Note", "MarkdownNote", "Reroute", "PrimitiveNode"})


def node_specs(samplers: Sequence[str], schedulers: Sequence[str]) -> dict[str, NodeSpec]:
    """The covered nodes, with ``sampler_name`` / ``scheduler`` limited to the given lists."""
    return _specs(samplers, schedulers)


def _default_specs() -> dict[str, NodeSpec]:
    from fv_comfyui.samplers import SAMPLER_NAMES, SCHEDULER_NAMES

    return _specs(SAMPLER_NAMES, SCHEDULER_NAMES)


NODE_SPECS: dict[str, NodeSpec] = _default_specs()


def node_spec(class_type: str) -> NodeSpec | None:
    return NODE_SPECS.get(class_type)


def object_info(folders: Mapping[str, Sequence[str]], specs: Mapping[str, NodeSpec] = NODE_SPECS) -> dict[str, Any]:
    """ComfyUI's ``GET /object_info`` for the covered nodes; model lists from ``folders``."""
    info: dict[str, Any] = {}
    for spec in specs.values():
        required: dict[str, Any] = {}
        optional: dict[str, Any] = {}
        for item in spec.inputs:
            if item.kind == "COMBO":
                choices = list(item.choices) if item.choices is not None else sorted(folders.get(item.folder or "", ()))
                entry: list[Any] = [choices, item.options()] if item.options() else [choices]
            else:
                entry = [item.kind, item.options()] if item.options() else [item.kind]
            (optional if item.optional else required)[item.name] = entry
        inputs: dict[str, Any] = {"required": required}
        if optional:
            inputs["optional"] = optional
        info[spec.class_type] = {
            "input": inputs,
            "input_order": {
                "required": [i.name for i in spec.inputs if not i.optional],
                **({"optional": [i.name for i in spec.inputs if i.optional]} if optional else {}),
            },
            "output": list(spec.return_types),
            "output_is_list": [False] * len(spec.return_types),
            "output_name": list(spec.return_names),
            "name": spec.class_type,
            "display_name": spec.display_name,
            "description": spec.description,
            "python_module": "fv_comfyui",
            "category": spec.category,
            "output_node": spec.output_node,
        }
    return info
