"""Exporting a Wan card's weights as a diffusers ``WanPipeline`` directory, and checking it against diffusers.

``export_checkpoint`` writes ``model_index.json``, ``transformer/``, ``vae/``,
``text_encoder/``, ``tokenizer/`` and ``scheduler/`` exactly as ``WanPipeline.save_pretrained``
lays them out (fv's module state dicts already carry diffusers' key names), without
needing diffusers. ``check_parity`` runs the card's ``ParitySpec`` check on such a
directory: fv's trajectory (text encode, denoise, streamed decode) against
``diffusers.WanPipeline`` loaded from the same directory -- its own tokenizer, encoder,
scheduler and noise from the seed -- compared frame by frame within the card's fp32
tolerance. ``fv cards export`` and ``fv train`` call both (through the plugin hooks).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors.torch import save_file

from fv_kernel.api import (
    DiffusionParams,
    ExportError,
    InstanceOptions,
    ModelCard,
    ParityResult,
    Request,
    TaskType,
    TextPart,
    build_instance,
    read_safetensors,
    resolve_source,
    run_local,
)
from fv_wan.checkpoint import seed_of
from fv_wan.loops import text_context_length
from fv_wan.models.encoders import WanTextEncoder
from fv_wan.models.transformer import WanTransformer
from fv_wan.models.vae import WanVAE, WanVAEConfig

__all__ = ["DIFFUSERS_VERSION", "PARITY_PROMPT", "PARITY_SEED", "full_vae", "export_checkpoint", "check_parity", "scheduler_config"]

#: The diffusers release the directories are written for (and the parity reference).
DIFFUSERS_VERSION = "0.42.1"
PARITY_PROMPT = "a red circle moves left on a blue background"
PARITY_SEED = 7
_SAFE = {"format": "pt"}


def _seeded(seed: int, build: Any) -> Any:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def full_vae(card: ModelCard, options: InstanceOptions, component_id: str = "vae_decoder") -> WanVAE:
    """Both halves of the card's VAE in fp32 (serving loads only the half a component needs).

    Embedded cards: the seeded VAE (encoder and decoder come from one seeded construction,
    so they are the halves ``vae_encoder`` / ``vae_decoder`` load); else the checkpoint's ``vae/``.
    """
    spec = card.components[component_id]
    config = WanVAEConfig.from_diffusers_config(spec.config)
    ckpt = card.checkpoint.components[component_id]
    source = options.source or card.checkpoint.source
    seed = seed_of(card, component_id, options)
    if seed is not None:  # always so without a source
        vae = _seeded(seed, lambda: WanVAE(config))
    else:
        assert source is not None
        folder = resolve_source(source, subfolder=ckpt.subfolder, local_files_only=options.local_files_only)
        found = WanVAEConfig.from_diffusers_config(json.loads((folder / "config.json").read_text()))
        with torch.device("meta"):
            vae = WanVAE(found)
        vae.load_state_dict(read_safetensors(folder, device="cpu"), strict=True, assign=True)
    return vae.to(device=torch.device(options.device), dtype=torch.float32)


def scheduler_config(card: ModelCard) -> dict[str, Any]:
    """The diffusers scheduler config equal to the card's denoise sampler (UniPC or Euler, flow, shift)."""
    loop = card.loops.get("denoise")
    if loop is None or loop.sampler is None or loop.sampler.fixed_steps is not None:
        raise ExportError(f"card {card.model_id!r} has no multi-step 'denoise' loop to write a scheduler for", param="model")
    sampler = loop.sampler
    defaults = card.capabilities.defaults
    shift = float(sampler.config.get("shift", defaults.shift if defaults and defaults.shift else 1.0))
    if sampler.name == "unipc":
        return {
            "_class_name": "UniPCMultistepScheduler", "_diffusers_version": DIFFUSERS_VERSION, "num_train_timesteps": 1000,
            "prediction_type": "flow_prediction", "use_flow_sigmas": True, "flow_shift": shift,
            "solver_order": int(sampler.config.get("solver_order", 2)), "solver_type": sampler.config.get("solver_type", "bh2"),
            "predict_x0": True, "thresholding": False, "lower_order_final": True, "final_sigmas_type": "zero",
            "disable_corrector": list(sampler.config.get("disable_corrector", [])),
        }  # fmt: skip
    if sampler.name == "euler":
        return {"_class_name": "FlowMatchEulerDiscreteScheduler", "_diffusers_version": DIFFUSERS_VERSION,
                "num_train_timesteps": 1000, "shift": shift}
    raise ExportError(f"card {card.model_id!r} samples with {sampler.name!r}; diffusers directories hold unipc or euler",
                      param="model", )


def _write_model(folder: Path, class_name: str, config: Mapping[str, Any], module: torch.nn.Module) -> None:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"_class_name": class_name, "_diffusers_version": DIFFUSERS_VERSION, **config}, indent=2))
    state = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in module.state_dict().items()}
    save_file(state, folder / "diffusion_pytorch_model.safetensors", metadata=_SAFE)


def _module(card: ModelCard, modules: Mapping[str, Any], component_id: str, options: InstanceOptions) -> Any:
    if component_id in modules:
        return modules[component_id]
    if component_id == "vae":
        return full_vae(card, options)
    return build_instance(card, options).component(component_id)


def export_checkpoint(card: ModelCard, modules: Mapping[str, Any], directory: Path) -> ModelCard:
    """Write ``card`` (``modules`` replacing loaded components; ``vae`` is the whole VAE) as a WanPipeline directory.

    Returns the card serving the directory: the same card, its component configs taken from
    what was written, its checkpoint a diffusers-layout ``source=directory``.
    """
    if set(card.capabilities.tasks) - {TaskType.TEXT_TO_VIDEO, TaskType.TEXT_TO_IMAGE} or "transformer_2" in card.components:
        raise ExportError(f"card {card.model_id!r}: fv-wan exports text-to-video single-expert cards (WanPipeline) only",
                          param="model")
    options = InstanceOptions(device="cpu", precision="fp32", local_files_only=True)
    transformer: WanTransformer = _module(card, modules, "transformer", options)
    vae: WanVAE = _module(card, modules, "vae", options)
    text: WanTextEncoder = _module(card, modules, "text_encoder", options)
    if vae.encoder is None or vae.decoder is None:
        raise ExportError("the 'vae' module must hold both encoder and decoder", param="model")
    if not hasattr(text.tokenizer, "save_pretrained"):
        raise ExportError(
            f"card {card.model_id!r}: its tokenizer ({type(text.tokenizer).__name__}) is not a Hugging Face tokenizer "
            "and cannot be saved for diffusers", param="model",
        )
    directory.mkdir(parents=True)
    tcfg = transformer.config.to_diffusers_config()
    vcfg = vae.config.to_diffusers_config()
    _write_model(directory / "transformer", "WanTransformer3DModel", tcfg, transformer)
    _write_model(directory / "vae", "AutoencoderKLWan", vcfg, vae)
    text.model.to(torch.float32).save_pretrained(directory / "text_encoder", safe_serialization=True)
    text.tokenizer.save_pretrained(directory / "tokenizer")
    (directory / "scheduler").mkdir()
    (directory / "scheduler" / "scheduler_config.json").write_text(json.dumps(scheduler_config(card), indent=2))
    index = {
        "_class_name": "WanPipeline", "_diffusers_version": DIFFUSERS_VERSION, "boundary_ratio": None, "expand_timesteps": False,
        "scheduler": ["diffusers", "UniPCMultistepScheduler" if scheduler_config(card)["_class_name"].startswith("UniPC") else "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "UMT5EncoderModel"], "tokenizer": ["transformers", getattr(text.tokenizer, "transformers_class", type(text.tokenizer).__name__)],
        "transformer": ["diffusers", "WanTransformer3DModel"], "transformer_2": [None, None], "vae": ["diffusers", "AutoencoderKLWan"],
    }  # fmt: skip
    (directory / "model_index.json").write_text(json.dumps(index, indent=2))

    components = dict(card.components)
    components["transformer"] = components["transformer"].model_copy(update={"config": tcfg})
    for cid in ("vae_decoder", "vae_encoder", "vae"):
        if cid in components:
            components[cid] = components[cid].model_copy(update={"config": vcfg})
    components["text_encoder"] = components["text_encoder"].model_copy(update={"config": {"d_model": int(text.model.config.d_model)}})
    checkpoint = card.checkpoint.model_copy(update={
        "layout": "diffusers", "source": str(directory),
        "components": {k: v.model_copy(update={"random_init_seed": None}) for k, v in card.checkpoint.components.items()},
    })  # fmt: skip
    return ModelCard.model_validate(card.model_copy(update={"components": components, "checkpoint": checkpoint}).model_dump())


def _diffusers_model(cls: Any, folder: Path) -> Any:
    # from_config + state dict: ``from_pretrained`` of models with _keep_in_fp32_modules needs accelerate.
    from safetensors.torch import load_file

    model = cls.from_config(cls.load_config(folder))
    model.load_state_dict(load_file(folder / "diffusion_pytorch_model.safetensors"), strict=True)
    return model.eval()


def _tolerance(card: ModelCard) -> Any:
    found = [t for t in card.parity.tolerances if t.name == "loop_vs_diffusers" and t.dtype == "fp32"]
    if not found:
        raise ExportError(f"card {card.model_id!r} declares no fp32 'loop_vs_diffusers' parity tolerance", param="model")
    return found[0]


def check_parity(card: ModelCard, directory: Path, *, prompt: str = PARITY_PROMPT, seed: int = PARITY_SEED) -> ParityResult:
    """fv's video for ``card`` served from ``directory`` vs ``WanPipeline.from_pretrained(directory)`` (CPU, fp32).

    Same prompt, seed, size, frames, steps and guidance (the card's defaults); nothing shared
    but the directory. The max abs difference of the decoded frames is held to the card's
    ``loop_vs_diffusers`` fp32 tolerance.
    """
    tolerance = _tolerance(card)
    reference = card.parity.reference
    try:
        import diffusers
        from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel
    except ImportError:
        return ParityResult(reference, tolerance.name, tolerance.metric, float("inf"), tolerance.value,
                            detail=f"diffusers is not installed (pip install diffusers=={DIFFUSERS_VERSION})")
    d = card.capabilities.defaults
    assert d is not None
    served = card.model_copy(update={"checkpoint": card.checkpoint.model_copy(update={"source": str(directory)})})
    instance = build_instance(served, InstanceOptions(device="cpu", precision="fp32", local_files_only=True))
    request = Request(model=served.model_id, task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text=prompt),),
                      diffusion=DiffusionParams(seed=seed))
    (video,) = run_local(request, instance)
    fv = video.frames.float()
    pipe = WanPipeline.from_pretrained(
        directory, transformer=_diffusers_model(WanTransformer3DModel, directory / "transformer"),
        vae=_diffusers_model(AutoencoderKLWan, directory / "vae"),
    )
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        ref = pipe(prompt=prompt, height=d.height, width=d.width, num_frames=d.frames, num_inference_steps=d.steps,
                   guidance_scale=d.guidance, generator=torch.Generator().manual_seed(seed), output_type="pt",
                   max_sequence_length=text_context_length(card)).frames[0]
    if ref.shape != fv.shape:
        return ParityResult(reference, tolerance.name, tolerance.metric, float("inf"), tolerance.value,
                            detail=f"shapes differ: fv {tuple(fv.shape)} vs diffusers {tuple(ref.shape)}")
    value = (fv - ref.float()).abs().max().item()
    return ParityResult(reference, tolerance.name, tolerance.metric, value, tolerance.value,
                        detail=f"diffusers {diffusers.__version__}, {d.steps} steps, guidance {d.guidance}, seed {seed}, "
                               f"{d.frames}x{d.height}x{d.width}; fv frames std {fv.std().item():.3f}")
