"""A validated ComfyUI API prompt → fv jobs: one request on one card per sampler chain.

Each output node is traced back through the graph; what the nodes mean becomes one fv
:class:`~fv_kernel.api.Request` (as :class:`ComfyJob`: a card, a prompt and the options
``fv generate`` / ``fv.load(...).generate`` take), run by the card's own program (its text
encode, image encode, denoise and decode loops):

- ``UNETLoader`` / ``CLIPLoader`` / ``VAELoader`` / ``CLIPVisionLoader`` /
  ``CheckpointLoaderSimple``: their file names go through the mapping file
  (:mod:`fv_comfyui.models`); all the loaders of a chain must resolve to one card, and a
  ``card:component`` mapping must name the component that loader loads;
- ``ModelSamplingSD3``: the flow shift (without it, ComfyUI's Wan default, 8.0);
- ``LoraLoaderModelOnly`` / ``LoraLoader`` (:mod:`fv_comfyui.loras`): the request's adapters.
  ``lora_name`` is a file in the LoRA folder, converted by the card's adapter converter;
  ``strength_model`` applies it to the diffusion model of the node's chain (on a Wan 2.2 A14B
  card: ``transformer`` on the first stage's chain, ``transformer_2`` on the second's),
  ``strength_clip`` to the text encoder when the node's CLIP output feeds the prompts and the
  file has text-encoder weights. Several nodes stack in chain order; a strength of 0 applies
  nothing and a node with both at 0 is skipped without reading its file, as in ComfyUI. One
  adapter applies one strength to all its file changes, so a node that would patch a file's
  parts at different strengths (``strength_model`` != ``strength_clip``, or a text-encoder
  part its CLIP output does not reach) is refused, naming the parts and strengths;
- ``KSampler`` (``denoise`` 1.0) and ``KSamplerAdvanced``: steps, CFG, seed and the sampler,
  mapped by :func:`fv_comfyui.samplers.fv_sampler_name`. The two-stage Wan 2.2 A14B chain
  (stage 1: ``add_noise`` on, steps 0→k, leftover noise returned; stage 2: ``add_noise`` off,
  steps k→end, the same schedule) is one denoise run on the two-expert card as it is installed
  (or served), with the request's ``switch_step`` k and stage 2's CFG as ``guidance_2``; the
  ComfyUI sampler restarts at step k as the second node does (``SamplerState.stage_starts``);
- ``EmptyHunyuanLatentVideo``: width, height, length (frames), batch 1;
- ``Wan22ImageToVideoLatent`` (the TI2V-5B templates): width, height, length, batch 1, on a card
  whose image-to-video encodes the start image into the first latent frame (``i2v_mode``
  ``first_frame``); with a ``start_image`` it is image-to-video, without one text-to-video;
- ``CLIPTextEncode``: the prompt and negative prompt;
- ``WanImageToVideo`` + ``LoadImage`` (+ ``CLIPVisionEncode``): image-to-video;
- ``VAEDecode``: the card's decode loop; ``SaveAnimatedWEBP`` / ``SaveWEBM`` / ``CreateVideo`` +
  ``SaveVideo``: the files written.

``UNETLoader.weight_dtype`` picks the instance's precision path (:data:`WEIGHT_DTYPE_PATHS`):
``default`` runs the file's own precision (the deployment's path for a name mapped to a card),
``fp8_e4m3fn`` the ``fp8_weights`` path, ``fp8_e4m3fn_fast`` the ``fp8_dynamic`` path (fp8 weights
and activations: ComfyUI's fast fp8 matmul); ``fp8_e5m2`` is refused (fv's fp8 paths store e4m3),
as is a path the card's precision contract does not list. The job carries the path
(``ComfyJob.precision_path``); both loaders of a two-stage chain must ask the same one.

With ComfyUI's ``models/diffusion_models`` folder set (:class:`WeightFiles`), a UNETLoader's file is
read from it as the diffusion model its mapping names (``ComfyJob.component_sources``), so a
``*_fp8_scaled.safetensors`` runs its own e4m3 weights and scales; ``fv serve`` instead checks the
name against the file it serves.

What does not map is refused before any compute, as a ``custom_validation_failed`` node
error whose details start with ``fv:`` and say why (a LoRA file that is missing, or whose keys
map to nothing of the card, or that has no weights for what the node patches; ``denoise`` < 1; a
batch > 1; a sampler chain fv cannot express; loaders resolving to several cards or none).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Collection, Mapping

import torch

from fv_kernel.api import AdapterRef, DiffusionParams, ImagePart, ModelCard, Request, TaskType, TextPart
from fv_comfyui.loras import LoraFileError, LoraLibrary, LoraUse, adapter_name
from fv_comfyui.models import ModelMap, ModelTarget
from fv_comfyui.paths import inside
from fv_comfyui.samplers import comfy_sigmas, fv_sampler_name

__all__ = ["CompileError", "SaveTarget", "ComfyJob", "CompileResult", "compile_prompt", "DEFAULT_SHIFT",
           "WEIGHT_DTYPE_PATHS", "NATIVE", "WeightFiles"]

#: fv's precision path of a card's own weights (the kernel's ``PrecisionPath`` "native").
NATIVE = "native"
#: ``UNETLoader.weight_dtype`` (ComfyUI's ``nodes.py``) -> the fv precision path it runs; ``default``:
#: None, the file's own (a name mapped to a card: the deployment's path). ``fp8_e5m2`` is not here:
#: fv has no e5m2 weights.
WEIGHT_DTYPE_PATHS: dict[str, str | None] = {
    "default": None,
    # ComfyUI: e4m3 storage, each layer upcast for its matmul = fv's fp8 weights, native activations.
    "fp8_e4m3fn": "fp8_weights",
    # ComfyUI: + fp8_optimizations, a real fp8 matmul with the activations cast to e4m3 = fv's fp8_dynamic.
    "fp8_e4m3fn_fast": "fp8_dynamic",
}
_WEIGHT_DTYPES = ("default", "fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2")
#: The latent nodes a sampler reads: class -> the slot of its LATENT output.
_LATENT_SOURCES = {"EmptyHunyuanLatentVideo": (0,), "WanImageToVideo": (2,), "Wan22ImageToVideoLatent": (0,)}
#: ComfyUI's Wan models sample with shift 8.0 when no ModelSamplingSD3 says otherwise.
DEFAULT_SHIFT = 8.0
_TEXT_ENCODER = "text_encoder"
_LOADER_COMPONENTS = {
    "unet": ("transformer", "transformer_2"),
    "clip": ("text_encoder",),
    "vae": ("vae_decoder", "vae_encoder"),
    "clip_vision": ("image_encoder",),
}


class CompileError(Exception):
    """A node fv cannot run as the prompt asks; ``details`` says why, ``input_name`` where."""

    def __init__(self, node_id: str, details: str, input_name: str | None = None) -> None:
        super().__init__(details)
        self.node_id = node_id
        self.details = details
        self.input_name = input_name


@dataclass(frozen=True)
class SaveTarget:
    """One save node: the file format and what it asks of it."""

    node_id: str
    class_type: str
    format: str
    filename_prefix: str
    fps: float
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class ComfyJob:
    """One fv request: ``fv.load(card).generate(prompt, **options)``, written to ``outputs``."""

    card: ModelCard
    prompt: str
    options: dict[str, Any]
    image_name: str | None
    outputs: list[SaveTarget]
    #: Node ids of the chain, in execution order (for ``executing`` messages).
    nodes: list[str]
    sampler_node: str
    #: The LoRA nodes as adapters, in chain order (first stage's, second stage's, then CLIP-only ones).
    loras: tuple[LoraUse, ...] = ()
    #: The instance's precision path its UNETLoader's ``weight_dtype`` asks for (``fv.load(...,
    #: precision_path=)``); None: ``default`` on a name mapped to a card, the deployment's own path.
    precision_path: str | None = None
    #: Component -> the ``unet_name`` file it loads from (``fv.load(..., component_sources=)``), when the
    #: diffusion_models folder is set (:class:`WeightFiles`); empty: the card's own weights.
    component_sources: dict[str, Path] = field(default_factory=dict)

    def request(self, image: torch.Tensor | None = None, adapters: tuple[AdapterRef, ...] = ()) -> Request:
        """The fv request this job runs (``image``: the start image, (3, H, W) in [0, 1]; ``adapters``:
        its LoRA uses as registered, :meth:`fv_comfyui.loras.LoraLibrary.register`)."""
        parts: list[Any] = [TextPart(text=self.prompt)]
        if self.options.get("negative_prompt"):
            parts.append(TextPart(text=self.options["negative_prompt"], role="negative_prompt"))
        if image is not None:
            parts.append(ImagePart(image=image))
        fields = ("height", "width", "frames", "steps", "guidance", "guidance_2", "switch_step", "shift", "sampler", "seed")
        return Request(
            model=self.card.model_id, task=self.task, inputs=tuple(parts), adapters=adapters,
            diffusion=DiffusionParams(**{k: self.options[k] for k in fields if self.options.get(k) is not None}),
        )

    @property
    def task(self) -> TaskType:
        return TaskType.IMAGE_TO_VIDEO if self.image_name is not None else TaskType.TEXT_TO_VIDEO

    def fv_generate_args(self, model: str, image_path: str | None = None) -> list[str]:
        """The ``fv generate`` arguments (after ``generate``) that run the same request."""
        if self.loras:
            raise ValueError("a job with LoRA nodes applies strengths per component, which `fv generate --lora` "
                             "does not express")
        args = ["--model", model, "--prompt", self.prompt]
        names = {"negative_prompt": "--negative-prompt", "height": "--height", "width": "--width", "frames": "--frames",
                 "steps": "--steps", "guidance": "--guidance", "guidance_2": "--guidance-2", "switch_step": "--switch-step",
                 "shift": "--shift", "sampler": "--sampler", "seed": "--seed"}
        for key, flag in names.items():
            if self.options.get(key) is not None:
                args += [flag, str(self.options[key])]
        if image_path is not None:
            args += ["--image", image_path]
        if self.precision_path is not None:
            args += ["--precision-path", self.precision_path]
        for component, path in self.component_sources.items():
            args += ["--component-source", f"{component}={path}"]
        return args


@dataclass
class CompileResult:
    jobs: list[ComfyJob]
    node_errors: dict[str, Any]


def _node_error(prompt: Mapping[str, Any], error: CompileError, output: str) -> dict[str, Any]:
    details = f"fv: {error.details}" if error.input_name is None else f"{error.input_name} - fv: {error.details}"
    return {
        "errors": [{
            "type": "custom_validation_failed", "message": "Custom validation failed for node", "details": details,
            "extra_info": {"input_name": error.input_name} if error.input_name else {},
        }],
        "dependent_outputs": [output],
        "class_type": prompt[error.node_id]["class_type"],
    }


@dataclass(frozen=True)
class WeightFiles:
    """Where a UNETLoader's ``unet_name`` file is read from (:func:`compile_prompt`).

    ``diffusion_models``: ComfyUI's ``models/diffusion_models`` folder. When set, a UNETLoader's file is
    read from it as the component its mapping names (``component_sources``): the job loads that file,
    with the card's config; a name not in the folder is refused. None: a mapped name stands for the
    card's own weights. ``served``: ``fv serve``'s cards -> the files their served components were loaded
    from (the deploy config's ``cards[].component_sources``); None: each job loads its own (``fv comfy run``).
    """

    diffusion_models: Path | None = None
    served: Mapping[str, Mapping[str, Path]] | None = None


class _Compiler:
    def __init__(self, prompt: Mapping[str, Any], models: ModelMap, cards: Mapping[str, ModelCard],
                 loras: LoraLibrary | None = None, adapters_off: Collection[str] = (),
                 served_paths: Mapping[str, str] | None = None, weight_files: WeightFiles | None = None) -> None:
        self.prompt = prompt
        self.weight_files = weight_files or WeightFiles()
        #: Card -> the precision path its served instance runs (``fv serve``); None: loaded per job.
        self.served_paths = served_paths
        self.models = models
        self.cards = cards
        self.loras = loras or LoraLibrary(None)
        #: Cards run with adapters disabled: their LoRA nodes cannot run.
        self.adapters_off = adapters_off
        self.visited: list[str] = []
        #: The CLIPVisionEncode of an image-to-video chain and its crop, when there is one.
        self.crop: tuple[str, str] | None = None
        #: UNETLoader id -> its weight_dtype.
        self.weight_dtypes: dict[str, str] = {}

    # -- graph helpers ----------------------------------------------------------------------
    def inputs(self, node_id: str) -> dict[str, Any]:
        return self.prompt[node_id]["inputs"]

    def class_of(self, node_id: str) -> str:
        return str(self.prompt[node_id]["class_type"])

    def source(self, node_id: str, name: str, allowed: Mapping[str, tuple[int, ...]]) -> tuple[str, int]:
        """The node and slot feeding ``name``; refused unless it is one of ``allowed`` (class → slots)."""
        link = self.inputs(node_id).get(name)
        if not isinstance(link, list):
            raise CompileError(node_id, f"input {name!r} is not linked", name)
        src, slot = str(link[0]), int(link[1])
        kind = self.class_of(src)
        if kind not in allowed or slot not in allowed[kind]:
            wanted = ", ".join(f"{k} (output {', '.join(map(str, v))})" for k, v in allowed.items())
            raise CompileError(node_id, f"{name!r} comes from {kind} #{src}; fv runs it only from {wanted}", name)
        if src not in self.visited:
            self.visited.append(src)
        return src, slot

    # -- pieces -----------------------------------------------------------------------------
    def loader_targets(self, node_id: str, name_input: str, role: str) -> tuple[str, tuple[ModelTarget, ...]]:
        file_name = self.inputs(node_id)[name_input]
        targets = self.models.targets(file_name)
        if not targets:  # validation lists only mapped names; a direct caller may still pass one
            raise CompileError(node_id, f"{file_name!r} maps to no card in the comfy models file", name_input)
        for target in targets:
            if target.component is not None and target.component not in _LOADER_COMPONENTS[role]:
                raise CompileError(
                    node_id, f"{file_name!r} maps to {target}, but a {self.class_of(node_id)} loads a "
                    f"{' or '.join(_LOADER_COMPONENTS[role])}", name_input,
                )
        return file_name, targets

    def model_chain(self, node_id: str, name: str) -> tuple[float, str, tuple[ModelTarget, ...], str, list[str]]:
        """(shift, unet loader id, its targets, file name, LoRA node ids from the loader out) behind a MODEL input."""
        model_sources = {"ModelSamplingSD3": (0,), "UNETLoader": (0,), "CheckpointLoaderSimple": (0,),
                         "LoraLoaderModelOnly": (0,), "LoraLoader": (0,)}
        src, _ = self.source(node_id, name, model_sources)
        shift: float | None = None
        loras: list[str] = []
        while True:
            kind = self.class_of(src)
            if kind == "ModelSamplingSD3":
                if shift is None:
                    shift = float(self.inputs(src)["shift"])  # the last one applied wins, as in ComfyUI
                src, _ = self.source(src, "model", model_sources)
                continue
            if kind in ("LoraLoaderModelOnly", "LoraLoader"):
                loras.insert(0, src)  # walked from the sampler back: the one nearest the loader patches first
                src, _ = self.source(src, "model", model_sources)
                continue
            if kind == "UNETLoader":
                dtype = self.inputs(src)["weight_dtype"]
                if dtype not in _WEIGHT_DTYPES:  # validation lists only these; a direct caller may pass another
                    raise CompileError(src, f"weight_dtype {dtype!r} is not one of {', '.join(_WEIGHT_DTYPES)}",
                                       "weight_dtype")
                self.weight_dtypes[src] = str(dtype)
                file_name, targets = self.loader_targets(src, "unet_name", "unet")
            else:
                file_name, targets = self.loader_targets(src, "ckpt_name", "unet")
            return (DEFAULT_SHIFT if shift is None else shift), src, targets, file_name, loras

    def text(self, node_id: str, name: str, i2v_node: str | None) -> tuple[str, tuple[ModelTarget, ...], list[str]]:
        """The text of a CONDITIONING input, the targets of its text encoder and the LoraLoaders on its CLIP."""
        if i2v_node is not None:
            slot = 0 if name == "positive" else 1
            src, got = self.source(node_id, name, {"WanImageToVideo": (0, 1)})
            if src != i2v_node or got != slot:
                raise CompileError(node_id, f"{name!r} must be output {slot} of the WanImageToVideo #{i2v_node} that "
                                            "makes the latent", name)
            node_id = src
        src, _ = self.source(node_id, name, {"CLIPTextEncode": (0,)})
        text = str(self.inputs(src)["text"])
        clip_sources = {"CLIPLoader": (0,), "CheckpointLoaderSimple": (1,), "LoraLoader": (1,)}
        clip, slot = self.source(src, "clip", clip_sources)
        loras: list[str] = []
        while self.class_of(clip) == "LoraLoader":
            loras.insert(0, clip)
            clip, slot = self.source(clip, "clip", clip_sources)
        if self.class_of(clip) == "CLIPLoader":
            if self.inputs(clip)["type"] != "wan":
                raise CompileError(clip, "fv's Wan cards encode text as ComfyUI's 'wan' CLIP type; set type to 'wan'", "type")
            return text, self.loader_targets(clip, "clip_name", "clip")[1], loras
        return text, self.loader_targets(clip, "ckpt_name", "clip")[1], loras

    def vae(self, node_id: str, name: str) -> tuple[ModelTarget, ...]:
        src, _ = self.source(node_id, name, {"VAELoader": (0,), "CheckpointLoaderSimple": (2,)})
        if self.class_of(src) == "VAELoader":
            return self.loader_targets(src, "vae_name", "vae")[1]
        return self.loader_targets(src, "ckpt_name", "vae")[1]

    # -- the sampler chain ------------------------------------------------------------------
    def sampler(self, decode: str) -> dict[str, Any]:
        src, _ = self.source(decode, "samples", {"KSampler": (0,), "KSamplerAdvanced": (0,)})
        inputs = self.inputs(src)
        if self.class_of(src) == "KSampler":
            if float(inputs["denoise"]) != 1.0:
                raise CompileError(src, "only denoise 1.0 (generation from noise) is supported", "denoise")
            return self.stage_plan(src, seed_input="seed", stages=[src])
        if inputs["add_noise"] == "enable" and int(inputs["start_at_step"]) == 0 and int(inputs["end_at_step"]) >= int(inputs["steps"]):
            return self.stage_plan(src, seed_input="noise_seed", stages=[src])  # one KSamplerAdvanced doing every step
        return self.two_stage(src)

    def two_stage(self, low: str) -> dict[str, Any]:
        li = self.inputs(low)
        if li["add_noise"] != "disable" or int(li["end_at_step"]) < int(li["steps"]):
            raise CompileError(low, "a KSamplerAdvanced fv runs either does every step from noise, or is the second stage "
                                    "of a two-stage chain (add_noise disable, end_at_step >= steps)", "add_noise")
        high, _ = self.source(low, "latent_image", {"KSamplerAdvanced": (0,)})
        hi = self.inputs(high)
        k = int(li["start_at_step"])
        checks = [
            (hi["add_noise"] == "enable", "add_noise", "the first stage must add noise (add_noise enable)"),
            (int(hi["start_at_step"]) == 0, "start_at_step", "the first stage must start at step 0"),
            (int(hi["end_at_step"]) == k, "end_at_step", f"the first stage must end where the second starts (step {k})"),
            (hi["return_with_leftover_noise"] == "enable", "return_with_leftover_noise",
             "the first stage must return its leftover noise"),
        ]
        for ok, name, why in checks:
            if not ok:
                raise CompileError(high, why, name)
        for name in ("steps", "sampler_name", "scheduler"):
            if hi[name] != li[name]:
                raise CompileError(low, f"both stages must use the same {name} ({hi[name]!r} != {li[name]!r})", name)
        for name in ("positive", "negative"):
            if hi[name] != li[name]:
                raise CompileError(low, f"both stages must take the same {name} conditioning", name)
        if not 0 < k < int(li["steps"]):
            raise CompileError(low, f"the switch step {k} must be inside 1..{int(li['steps']) - 1}", "start_at_step")
        plan = self.stage_plan(high, seed_input="noise_seed", stages=[high, low])
        low_shift, low_unet, low_targets, low_file, low_loras = self.model_chain(low, "model")
        plan.update(low_shift=low_shift, low_unet=low_unet, low_targets=low_targets, low_file=low_file, switch_step=k,
                    guidance_2=float(li["cfg"]), low_loras=low_loras)
        return plan

    def stage_plan(self, node: str, *, seed_input: str, stages: list[str]) -> dict[str, Any]:
        inputs = self.inputs(node)
        try:
            sampler = fv_sampler_name(inputs["sampler_name"], inputs["scheduler"])
        except ValueError as exc:
            raise CompileError(node, str(exc), "sampler_name") from None
        shift, unet, unet_targets, unet_file, loras = self.model_chain(node, "model")
        latent, _ = self.source(node, "latent_image", _LATENT_SOURCES)
        kind = self.class_of(latent)
        i2v = latent if kind == "WanImageToVideo" else None
        if kind == "Wan22ImageToVideoLatent" and isinstance(self.inputs(latent).get("start_image"), list):
            i2v = latent  # the start image is encoded into the first latent frame; no conditioning passes through it
        text_via = i2v if kind == "WanImageToVideo" else None
        positive, clip_targets, clip_loras = self.text(node, "positive", text_via)
        negative, neg_clip_targets, neg_clip_loras = self.text(node, "negative", text_via)
        if clip_loras != neg_clip_loras:  # fv encodes both prompts with one text encoder and one adapter stack
            raise CompileError(node, "the positive and negative prompts must be encoded through the same LoraLoader "
                                     f"nodes (positive: {clip_loras or 'none'}, negative: {neg_clip_loras or 'none'})",
                               "negative")
        size = self.inputs(latent)
        if int(size["batch_size"]) != 1:
            raise CompileError(latent, "fv runs one video per request; batch_size must be 1", "batch_size")
        return {
            "sampler_node": stages[-1], "stages": stages, "sampler": sampler, "shift": shift, "unet": unet,
            "unet_targets": unet_targets, "unet_file": unet_file, "steps": int(inputs["steps"]), "cfg": float(inputs["cfg"]),
            "seed": int(inputs[seed_input]), "scheduler": inputs["scheduler"], "latent": latent, "i2v": i2v,
            "latent_kind": kind, "loras": loras, "clip_loras": clip_loras,
            "positive": positive, "negative": negative, "clip_targets": (*clip_targets, *neg_clip_targets),
            "width": int(size["width"]), "height": int(size["height"]), "length": int(size["length"]),
        }

    # -- image to video ---------------------------------------------------------------------
    def image(self, i2v: str) -> tuple[str, tuple[ModelTarget, ...] | None, tuple[ModelTarget, ...]]:
        """(image file name, CLIP vision targets or None, the VAE's targets) of a WanImageToVideo or Wan22ImageToVideoLatent."""
        if not isinstance(self.inputs(i2v).get("start_image"), list):
            raise CompileError(i2v, "fv's image-to-video needs a start_image", "start_image")
        load, _ = self.source(i2v, "start_image", {"LoadImage": (0,)})
        vision: tuple[ModelTarget, ...] | None = None
        if isinstance(self.inputs(i2v).get("clip_vision_output"), list):
            enc, _ = self.source(i2v, "clip_vision_output", {"CLIPVisionEncode": (0,)})
            image_src, _ = self.source(enc, "image", {"LoadImage": (0,)})
            if image_src != load:
                raise CompileError(enc, "CLIPVisionEncode must encode the same LoadImage as the start_image", "image")
            loader, _ = self.source(enc, "clip_vision", {"CLIPVisionLoader": (0,)})
            vision = self.loader_targets(loader, "clip_name", "clip_vision")[1]
            self.crop = (enc, str(self.inputs(enc)["crop"]))
        return str(self.inputs(load)["image"]), vision, self.vae(i2v, "vae")

    # -- LoRA nodes -------------------------------------------------------------------------
    def lora_use(self, card: ModelCard, node: str, expert: str | None, clip: bool) -> LoraUse | None:
        """What LoRA ``node`` applies: ``strength_model`` to ``expert`` when its MODEL output is on that
        expert's chain, ``strength_clip`` to the text encoder when its CLIP output feeds the prompts.
        None when that is nothing (strengths 0, or only a CLIP strength on a file without text-encoder weights)."""
        inputs, kind = self.inputs(node), self.class_of(node)
        strength_model = float(inputs["strength_model"])
        strength_clip = float(inputs["strength_clip"]) if kind == "LoraLoader" else 0.0
        if strength_model == 0.0 and strength_clip == 0.0:
            return None  # ComfyUI returns the node's inputs unchanged, without reading the file
        if card.model_id in self.adapters_off:
            raise CompileError(node, f"card {card.model_id!r} runs with adapters disabled, so LoRA nodes cannot "
                                     "run; turn them on with an adapters: section in the deploy config", "lora_name")
        name = str(inputs["lora_name"])
        adapter = adapter_name(name, expert)
        try:
            path = self.loras.path(name)
            components = self.loras.components(card, path, adapter)
        except LoraFileError as exc:
            raise CompileError(node, str(exc), "lora_name") from None
        wanted: dict[str, float] = {}
        if expert is not None:
            wanted[expert] = strength_model
        if clip:
            wanted[_TEXT_ENCODER] = strength_clip
        if expert is not None and strength_model != 0.0 and expert not in components:
            experts = [c for c in components if c in _LOADER_COMPONENTS["unet"]]
            why = (f"its weights are for {experts[0]!r}, but the node is on the chain of {expert!r}" if experts else
                   f"it has no weights for the diffusion model (card {card.model_id!r} maps its keys to: "
                   f"{', '.join(components)})")
            raise CompileError(node, f"{name!r}: {why}", "lora_name")
        scales = {component: wanted.get(component, 0.0) for component in components}
        if len(set(scales.values())) > 1:
            # One adapter applies one strength to everything its file changes.
            listed = ", ".join(f"{component} at {scale:g}" for component, scale in scales.items())
            raise CompileError(node, f"{name!r} changes {', '.join(components)}; this node would apply {listed} "
                                     "(a strength is 0 where the node's output does not reach that model), and fv "
                                     "applies one strength to all of a file's weights: give them one strength", "lora_name")
        scale = next(iter(scales.values()))
        if scale == 0.0:
            return None
        return LoraUse(node, kind, name, path, adapter, components, scale)

    # -- the card ---------------------------------------------------------------------------
    def one_card(self, sampler_node: str, groups: list[tuple[str, tuple[ModelTarget, ...]]]) -> ModelCard:
        candidates: set[str] | None = None
        for _, targets in groups:
            cards = {t.card for t in targets}
            candidates = cards if candidates is None else candidates & cards
        if not candidates:
            listed = "; ".join(f"{what} -> {', '.join(sorted({t.card for t in ts}))}" for what, ts in groups)
            raise CompileError(sampler_node, f"the loaders do not resolve to one card ({listed})")
        if len(candidates) > 1:
            raise CompileError(sampler_node, f"the loaders resolve to several cards ({', '.join(sorted(candidates))}); "
                                             "map the diffusion model to one card")
        card_id = next(iter(candidates))
        if card_id not in self.cards:
            raise CompileError(sampler_node, f"card {card_id!r} is not installed; installed: {', '.join(sorted(self.cards))}")
        return self.cards[card_id]


def _component(targets: tuple[ModelTarget, ...], card_id: str) -> str | None:
    return next((t.component for t in targets if t.card == card_id), None)


def _save_target(prompt: Mapping[str, Any], compiler: _Compiler, output: str) -> tuple[SaveTarget, str]:
    inputs = prompt[output]["inputs"]
    kind = compiler.class_of(output)
    if kind == "SaveVideo":
        create, _ = compiler.source(output, "video", {"CreateVideo": (0,)})
        if isinstance(compiler.inputs(create).get("audio"), list):
            raise CompileError(create, "fv's Wan cards make no sound; remove the audio input", "audio")
        decode, _ = compiler.source(create, "images", {"VAEDecode": (0,)})
        return SaveTarget(output, kind, "mp4", str(inputs["filename_prefix"]), float(compiler.inputs(create)["fps"]),
                          {"codec": inputs["codec"], "format": inputs["format"]}), decode
    decode, _ = compiler.source(output, "images", {"VAEDecode": (0,)})
    if kind == "SaveAnimatedWEBP":
        options = {"lossless": bool(inputs["lossless"]), "quality": int(inputs["quality"]), "method": inputs["method"]}
        return SaveTarget(output, kind, "webp", str(inputs["filename_prefix"]), float(inputs["fps"]), options), decode
    options = {"codec": inputs["codec"], "crf": float(inputs["crf"])}
    return SaveTarget(output, kind, "webm", str(inputs["filename_prefix"]), float(inputs["fps"]), options), decode


def _job(compiler: _Compiler, decode: str, image_size: Callable[[str], tuple[int, int] | None]) -> ComfyJob:
    plan = compiler.sampler(decode)
    node = plan["sampler_node"]
    groups: list[tuple[str, tuple[ModelTarget, ...]]] = [
        (f"unet_name {plan['unet_file']!r}", plan["unet_targets"]),
        ("clip_name", plan["clip_targets"]),
        ("vae_name", compiler.vae(decode, "vae")),
    ]
    image_name = None
    vision = None
    if plan["i2v"] is not None:
        image_name, vision, i2v_vae = compiler.image(plan["i2v"])
        groups.append((f"vae_name ({plan['latent_kind']})", i2v_vae))
        if vision is not None:
            groups.append(("clip_vision", vision))
    elif plan["latent_kind"] == "Wan22ImageToVideoLatent":  # text-to-video: its VAE must still be the card's
        groups.append(("vae_name (Wan22ImageToVideoLatent)", compiler.vae(plan["latent"], "vae")))
    two_stage = "switch_step" in plan
    if two_stage:
        groups.append((f"unet_name {plan['low_file']!r}", plan["low_targets"]))
    card = compiler.one_card(node, groups)
    components = card.components
    task = TaskType.IMAGE_TO_VIDEO if plan["i2v"] is not None else TaskType.TEXT_TO_VIDEO
    if task not in card.capabilities.tasks:
        raise CompileError(node, f"card {card.model_id!r} cannot run {task.value!r} (its tasks: "
                                 f"{', '.join(sorted(t.value for t in card.capabilities.tasks))})")
    two_experts = "transformer_2" in components
    high_component = _component(plan["unet_targets"], card.model_id) or "transformer"
    if two_stage:
        low_component = _component(plan["low_targets"], card.model_id)
        if not two_experts:
            raise CompileError(node, f"card {card.model_id!r} has one diffusion model; the two-stage chain needs a "
                                     "two-expert card")
        if high_component != "transformer" or low_component != "transformer_2":
            raise CompileError(node, "map the first stage's diffusion model to the card's transformer and the second's "
                                     f"to '{card.model_id}:transformer_2'", "model")
        if not torch.equal(comfy_sigmas(plan["scheduler"], plan["shift"], plan["steps"]),
                           comfy_sigmas(plan["scheduler"], plan["low_shift"], plan["steps"])):
            raise CompileError(node, f"the stages' shifts ({plan['shift']} and {plan['low_shift']}) give different "
                                     "schedules; fv runs one schedule across the expert switch", "model")
    else:
        if two_experts:
            raise CompileError(node, f"card {card.model_id!r} switches between two experts, but this sampler runs one "
                                     "model for every step; use the two-stage KSamplerAdvanced chain")
        if high_component != "transformer":
            raise CompileError(node, f"{plan['unet_file']!r} maps to {card.model_id}:{high_component}, which is not the "
                                     "card's diffusion model", "model")
    if plan["latent_kind"] == "Wan22ImageToVideoLatent":
        first_frame = any(spec.kind == "diffusion_denoise" and spec.config.get("i2v_mode") == "first_frame"
                          for spec in card.loops.values())
        if plan["i2v"] is not None and not first_frame:
            raise CompileError(plan["latent"], f"card {card.model_id!r} does not encode the start image into the first "
                                               "latent frame (a Wan 2.2 TI2V card does); use WanImageToVideo for it",
                               "start_image")
    has_vision = "image_encoder" in components
    if plan["i2v"] is not None and has_vision != (vision is not None):
        raise CompileError(plan["i2v"], f"card {card.model_id!r} " + (
            "encodes the image with CLIP vision: connect a CLIPVisionEncode to clip_vision_output" if has_vision
            else "takes no CLIP vision embedding: disconnect clip_vision_output"), "clip_vision_output")
    crop = compiler.crop
    if crop is not None and crop[1] == "none":
        size = image_size(image_name or "")
        if size is not None and size[0] != size[1]:
            raise CompileError(crop[0], "fv's image encoder centre-crops (crop 'center'); crop 'none' is the same only "
                                        f"for a square image, and this one is {size[0]}x{size[1]}", "crop")
    roles: dict[str, tuple[str | None, bool]] = {}  # LoRA node -> (the expert its MODEL patches, CLIP patched?)
    for lora in plan["loras"]:
        roles[lora] = (high_component, False)
    for lora in plan.get("low_loras", []):
        roles[lora] = ("transformer_2", False)
    for lora in plan["clip_loras"]:
        roles[lora] = (roles.get(lora, (None, False))[0], True)
    uses = [use for lora, (expert, clip) in roles.items() if (use := compiler.lora_use(card, lora, expert, clip)) is not None]
    options: dict[str, Any] = {
        "height": plan["height"], "width": plan["width"], "frames": plan["length"], "steps": plan["steps"],
        "guidance": plan["cfg"], "shift": plan["shift"], "sampler": plan["sampler"], "seed": plan["seed"],
    }
    if plan["negative"]:
        options["negative_prompt"] = plan["negative"]
    if two_stage:
        options["guidance_2"] = plan["guidance_2"]
        options["switch_step"] = plan["switch_step"]
    loaders = [plan["unet"], *([plan["low_unet"]] if two_stage else [])]
    precision_path = _precision_path(compiler, card, loaders)
    experts = [(plan["unet"], plan["unet_file"], high_component),
               *([(plan["low_unet"], plan["low_file"], "transformer_2")] if two_stage else [])]
    sources = _component_sources(compiler, card, experts)
    nodes = execution_order(compiler.prompt, [decode])
    return ComfyJob(card=card, prompt=plan["positive"], options=options, image_name=image_name,
                    outputs=[], nodes=nodes, sampler_node=node, loras=tuple(uses), precision_path=precision_path,
                    component_sources=sources)


def _component_sources(compiler: _Compiler, card: ModelCard, experts: list[tuple[str, str, str]]) -> dict[str, Path]:
    """The files the UNETLoaders' ``unet_name`` load as the card's diffusion model(s) (:class:`WeightFiles`):
    component -> path, for ``fv comfy run``; refused where the file is not in the folder, the card cannot
    load the component from a file, or a server serves other weights than the workflow names."""
    files = compiler.weight_files
    sources: dict[str, Path] = {}
    for loader, file_name, component in experts:
        if compiler.class_of(loader) != "UNETLoader":  # a checkpoint file stands for the whole card
            continue
        folder = files.diffusion_models
        in_folder = inside(folder, file_name) if folder is not None else None
        if files.served is not None:  # fv serve: the weights were loaded at start-up
            served = files.served.get(card.model_id, {}).get(component)
            if served is not None and served.name != Path(file_name).name:
                raise CompileError(loader, f"this server serves card {card.model_id!r}'s {component} from "
                                           f"{served.name!r} (the deploy config's cards[].component_sources), not "
                                           f"{file_name!r}; unet_name may be {served.name!r}", "unet_name")
            if served is None and in_folder is not None and in_folder.is_file():
                raise CompileError(loader, f"{file_name!r} is in the diffusion_models folder, but this server serves card "
                                           f"{card.model_id!r}'s {component} from the card's checkpoint; serve the file "
                                           f"with the deploy config's cards[].component_sources.{component}", "unet_name")
            continue
        if folder is None:
            continue
        if in_folder is None or not in_folder.is_file():
            raise CompileError(loader, f"{file_name!r} is not a file in the diffusion_models folder {str(folder)!r}",
                               "unet_name")
        if not card.checkpoint.components[component].single_file:
            raise CompileError(loader, f"card {card.model_id!r} loads its {component} only from its own checkpoint, not "
                                       f"from a file of its own; unset the diffusion_models folder to run the card's "
                                       "weights", "unet_name")
        sources[component] = in_folder
    return sources


def _allowed_paths(card: ModelCard) -> tuple[str, ...]:
    """The precision paths ``card`` can be served at: native, and those its contract lists."""
    return (NATIVE, *(str(path) for path in card.precision.paths if path != NATIVE))


def _precision_path(compiler: _Compiler, card: ModelCard, loaders: list[str]) -> str | None:
    """The one precision path the diffusion-model loaders ask for; refused where the card's contract
    does not allow it, for ``fp8_e5m2``, or when two loaders ask different paths (one instance, one path)."""
    allowed = _allowed_paths(card)
    dtypes = [d for d, path in WEIGHT_DTYPE_PATHS.items() if path is None or path in allowed]
    asked: dict[str, str | None] = {}
    for loader in loaders:
        dtype = compiler.weight_dtypes.get(loader, "default")  # CheckpointLoaderSimple: the file's own
        if dtype not in WEIGHT_DTYPE_PATHS:
            raise CompileError(loader, f"weight_dtype {dtype!r}: fv has no e5m2 weights (its fp8 precision paths store "
                                       f"e4m3); on card {card.model_id!r} weight_dtype may be {', '.join(dtypes)}",
                               "weight_dtype")
        path = WEIGHT_DTYPE_PATHS[dtype]
        if path is not None and path not in allowed:
            raise CompileError(loader, f"weight_dtype {dtype!r} runs precision path {path!r}, which card "
                                       f"{card.model_id!r} does not allow (its precision paths: {', '.join(allowed)}); "
                                       f"weight_dtype may be {', '.join(dtypes)}", "weight_dtype")
        assumed = card.recipe.assumed_path  # a quantization-aware recipe runs only the path it was trained for
        if path is not None and assumed is not None and path != assumed:
            fits = [d for d, p in WEIGHT_DTYPE_PATHS.items() if p is None or p == assumed]
            raise CompileError(loader, f"weight_dtype {dtype!r} runs precision path {path!r}, but card {card.model_id!r}'s "
                                       f"recipe assumes {assumed!r} (recipe.assumes_precision); weight_dtype may be "
                                       f"{', '.join(fits)}", "weight_dtype")
        served = None if compiler.served_paths is None else compiler.served_paths.get(card.model_id)
        if path is not None and served is not None and path != served:
            fits = [d for d, p in WEIGHT_DTYPE_PATHS.items() if p is None or p == served]
            raise CompileError(loader, f"weight_dtype {dtype!r} runs precision path {path!r}, but this server serves card "
                                       f"{card.model_id!r} at {served!r} (the deploy config's cards[].precision_path); "
                                       f"weight_dtype may be {', '.join(fits)}", "weight_dtype")
        asked[loader] = path
    if len(set(asked.values())) > 1:
        own = "the file's own"
        listed = ", ".join(f"UNETLoader #{loader} {compiler.weight_dtypes.get(loader, 'default')!r} ({path or own})"
                           for loader, path in asked.items())
        raise CompileError(loaders[-1], f"fv runs both experts of card {card.model_id!r} at one precision path, and the "
                                        f"loaders ask for different ones ({listed}); give them one weight_dtype",
                           "weight_dtype")
    return next(iter(asked.values()))


def execution_order(prompt: Mapping[str, Any], roots: list[str]) -> list[str]:
    """``roots`` and every node they read, each after the nodes it reads (depth-first post-order)."""
    order: list[str] = []

    def visit(node_id: str) -> None:
        if node_id in order or node_id not in prompt:
            return
        for value in prompt[node_id].get("inputs", {}).values():
            if isinstance(value, list) and len(value) == 2:
                visit(str(value[0]))
        order.append(node_id)

    for root in roots:
        visit(root)
    return order


def compile_prompt(
    prompt: Mapping[str, Any],
    outputs: list[str],
    *,
    models: ModelMap,
    cards: Mapping[str, ModelCard],
    image_size: Callable[[str], tuple[int, int] | None] = lambda name: None,
    loras: LoraLibrary | None = None,
    adapters_off: Collection[str] = (),
    served_paths: Mapping[str, str] | None = None,
    weight_files: WeightFiles | None = None,
) -> CompileResult:
    """Compile the validated ``outputs`` of ``prompt``; an output that fv cannot run gets a node error instead.

    Outputs that read one ``VAEDecode`` share one job. ``image_size`` gives a ``LoadImage`` file's
    (width, height) when known; ``loras`` the LoRA folder (none: a LoRA node is refused);
    ``adapters_off`` the cards whose deployment has adapters disabled (a LoRA node on them is refused);
    ``served_paths`` the precision path each served card's instance runs (``fv serve``: a ``weight_dtype``
    asking another is refused; None: each job loads its card at the path it asks); ``weight_files`` where
    UNETLoader files are read from (:class:`WeightFiles`; None: names stand for the cards' own weights).
    """
    jobs: dict[str, ComfyJob] = {}
    node_errors: dict[str, Any] = {}
    for output in sorted(outputs, key=lambda o: (len(o), o)):
        compiler = _Compiler(prompt, models, cards, loras, adapters_off, served_paths, weight_files)
        try:
            target, decode = _save_target(prompt, compiler, output)
            if decode not in jobs:
                jobs[decode] = _job(compiler, decode, image_size)
            jobs[decode].outputs.append(target)
            if output not in jobs[decode].nodes:
                jobs[decode].nodes.append(output)
        except CompileError as error:
            if error.node_id in node_errors:
                node_errors[error.node_id]["dependent_outputs"].append(output)
            else:
                node_errors[error.node_id] = _node_error(prompt, error, output)
    return CompileResult(jobs=list(jobs.values()), node_errors=node_errors)
