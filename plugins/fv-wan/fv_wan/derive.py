"""A model card for any Wan checkpoint directory that diffusers' Wan pipelines load.

``fv generate --model DIR`` on a diffusers-layout Wan checkpoint (``model_index.json`` naming
``WanPipeline`` or ``WanImageToVideoPipeline``) resolves here. fv-wan reads the pipeline's
configs -- ``model_index.json``, each component's ``config.json``, the scheduler's
``scheduler_config.json`` -- and derives a card from them: the transformer(s) and VAE exactly
as configured, the text (and image) encoder widths, the tasks the pipeline class runs, and the
denoise loop's sampler from the scheduler. When that card runs the same computation as a
built-in card (same architecture, tasks, loop options, sampler and shift), the built-in card
is used; otherwise the derived one, named ``wan-local-<folder>-<hash>`` and recording where it
came from (``recipe.data_contract``: the directory and a sha256 of its configs).

Everything fv-wan cannot reproduce is refused up front with a :class:`WanCheckpointError`
naming the file, the field and its value (and the allowed values): another pipeline class or
component class, a scheduler option fv's samplers do not implement, inconsistent widths.
Only configs are read here; weights load when the card is built.

``python -m fv_wan.derive DIR`` prints the derived card as JSON: a card file to keep, edit
(defaults, say) and run with ``fv generate --model card.json``.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from pydantic import ValidationError

from fv_kernel.api import (
    FvError,
    GenerationDefaults,
    InvalidRequest,
    ModelCard,
    PrecisionContract,
    RecipeSpec,
    SamplerBinding,
    StepCostSpec,
    TaskType,
    bound_sampler,
    builtin_samplers,
)
from fv_wan.cards import COST_1_3B, _card, wan_cards
from fv_wan.checkpoint import same_architecture, transformer_config_from_disk
from fv_wan.models.transformer import WanTransformerConfig
from fv_wan.models.vae import WanVAEConfig

__all__ = [
    "WanCheckpointError",
    "CheckpointConfigs",
    "SUPPORTED_PIPELINES",
    "is_wan_checkpoint",
    "read_checkpoint",
    "sampler_from_scheduler",
    "derive_card",
    "builtin_equivalent",
    "resolve_checkpoint_dir",
    "RESEARCH_WIDTH",
    "main",
]

T2V, I2V = TaskType.TEXT_TO_VIDEO, TaskType.IMAGE_TO_VIDEO

#: The pipeline classes fv-wan serves, and the tasks each runs.
SUPPORTED_PIPELINES: Mapping[str, frozenset[TaskType]] = {
    "WanPipeline": frozenset({T2V}),
    "WanImageToVideoPipeline": frozenset({I2V}),
}
#: ``model_index.json`` component entries: (library, the classes fv-wan loads; None: any).
_COMPONENTS: Mapping[str, tuple[str, tuple[str, ...] | None]] = {
    "transformer": ("diffusers", ("WanTransformer3DModel",)),
    "transformer_2": ("diffusers", ("WanTransformer3DModel",)),
    "vae": ("diffusers", ("AutoencoderKLWan",)),
    "text_encoder": ("transformers", ("UMT5EncoderModel",)),
    "tokenizer": ("transformers", None),  # whatever AutoTokenizer loads
    "scheduler": ("diffusers", ("UniPCMultistepScheduler", "FlowMatchEulerDiscreteScheduler")),
    "image_encoder": ("transformers", ("CLIPVisionModel",)),
    "image_processor": ("transformers", None),  # whatever CLIPImageProcessor.from_pretrained reads
}
_REQUIRED = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")
#: Pipeline options stored in ``model_index.json`` beside the components.
_PIPELINE_OPTIONS = ("boundary_ratio", "expand_timesteps")
_CONFIG_FILE = {
    "transformer": "config.json", "transformer_2": "config.json", "vae": "config.json", "text_encoder": "config.json",
    "tokenizer": "tokenizer_config.json", "scheduler": "scheduler_config.json", "image_encoder": "config.json",
    "image_processor": "preprocessor_config.json",
}  # fmt: skip
#: Weights fv-wan reads itself (safetensors only) vs those transformers' ``from_pretrained`` reads.
_SAFETENSORS_ONLY = ("transformer", "transformer_2", "vae")
_TRANSFORMERS_WEIGHTS = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin")

#: Transformers narrower than the smallest release (Wan 2.1 1.3B: 12 heads x 128) are research/test
#: sizes: their derived cards default to fp32 and CPU-sized shapes; wider ones to the release defaults.
RESEARCH_WIDTH = 12 * 128


class WanCheckpointError(InvalidRequest):
    """A Wan checkpoint directory fv-wan cannot serve: a missing file, or a config value it does not support.

    The message names the file (and the field and value, and the allowed values where there is a set).
    """

    error_type = "unsupported_checkpoint"

    def __init__(self, where: Path, message: str, *, field: str | None = None, allowed: Iterable[Any] | str | None = None) -> None:
        super().__init__("model", f"{where}: {message}", allowed=allowed)
        self.where = where
        self.field = field


def _show(value: Any) -> str:
    return json.dumps(value, default=str)


def _unsupported(file: Path, field: str, value: Any, *, why: str = "", allowed: Iterable[Any] | str | None = None) -> WanCheckpointError:
    reason = f" ({why})" if why else ""
    return WanCheckpointError(file, f"{field}={_show(value)} is not supported{reason}", field=field, allowed=allowed)


def _parse_config(file: Path, raw: dict[str, Any], schema: Any, diffusers_class: str) -> Any:
    """``raw`` (a diffusers config.json, ``_``-keys dropped) through fv's config ``schema``; an unknown
    or invalid field is a :class:`WanCheckpointError` naming it."""
    fields = {k: v for k, v in raw.items() if not k.startswith("_")}
    unknown = sorted(set(fields) - set(schema.model_fields))
    if unknown:
        raise _unsupported(file, unknown[0], fields[unknown[0]], why=f"not a {diffusers_class} field",
                           allowed=sorted(schema.model_fields))
    try:
        return schema.from_diffusers_config(fields)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"])
        if field:
            raise _unsupported(file, field, fields.get(field.split(".")[0]), why=err["msg"]) from None
        raise WanCheckpointError(file, err["msg"]) from None


def _read_json(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise WanCheckpointError(file, f"is not a readable JSON file ({' '.join(str(exc).split())})") from None
    if not isinstance(data, dict):
        raise WanCheckpointError(file, f"holds a {type(data).__name__}, not a JSON object")
    return data


# --------------------------------------------------------------------------- recognising


def is_wan_checkpoint(root: Path) -> bool:
    """Whether ``root`` is meant as a Wan checkpoint (so fv-wan answers for it, and errors are fv-wan's).

    True when ``model_index.json`` names a ``Wan*`` pipeline, or, lacking one, when
    ``transformer/config.json`` names a Wan transformer (diffusers' or the original release's).
    """
    index = root / "model_index.json"
    if index.is_file():
        try:
            name = json.loads(index.read_text(encoding="utf-8")).get("_class_name")
        except (OSError, UnicodeDecodeError, ValueError, AttributeError):
            return False
        return isinstance(name, str) and name.startswith("Wan")
    transformer = root / "transformer" / "config.json"
    if transformer.is_file():
        try:
            name = json.loads(transformer.read_text(encoding="utf-8")).get("_class_name")
        except (OSError, UnicodeDecodeError, ValueError, AttributeError):
            return False
        return name in ("WanTransformer3DModel", "WanModel")
    return False


# --------------------------------------------------------------------------- reading configs


@dataclass(frozen=True)
class CheckpointConfigs:
    """What a Wan checkpoint directory's configs say, parsed and checked for consistency."""

    root: Path
    pipeline: str
    transformer: WanTransformerConfig
    transformer_2: WanTransformerConfig | None
    original_layout: bool
    vae: WanVAEConfig
    text_encoder_width: int
    image_encoder_width: int | None
    has_image_processor: bool
    sampler: SamplerBinding
    scheduler: str
    boundary_ratio: float | None
    expand_timesteps: bool
    #: sha256 over every config file read (canonical JSON), in file order.
    fingerprint: str


def _components(root: Path, index: Mapping[str, Any]) -> tuple[dict[str, str], dict[str, Any]]:
    """The components ``model_index.json`` names (name -> class) and its pipeline options."""
    file = root / "model_index.json"
    present: dict[str, str] = {}
    options: dict[str, Any] = {}
    for key, value in index.items():
        if key.startswith("_"):
            continue
        if key in _PIPELINE_OPTIONS:
            options[key] = value
            continue
        if key not in _COMPONENTS:
            raise _unsupported(file, key, value, why="not a component or option of a Wan pipeline",
                               allowed=[*_COMPONENTS, *_PIPELINE_OPTIONS])
        if not (isinstance(value, list) and len(value) == 2):
            raise _unsupported(file, key, value, why="expected [library, class] or [null, null]")
        if value == [None, None]:
            continue
        library, classes = _COMPONENTS[key]
        if classes is not None and value[1] not in classes:
            raise _unsupported(file, key, value, why="fv-wan loads another class here", allowed=[[library, c] for c in classes])
        present[key] = str(value[1])
    for key in _REQUIRED:
        if key not in present:
            raise WanCheckpointError(file, f"names no {key!r} component; fv-wan needs {', '.join(_REQUIRED)}", field=key)
    return present, options


def _check_files(root: Path, present: Iterable[str]) -> None:
    for name in present:
        config = root / name / _CONFIG_FILE[name]
        if not config.is_file():
            raise WanCheckpointError(root, f"not a complete Wan checkpoint: {name}/{_CONFIG_FILE[name]} is missing", field=name)
        folder = root / name
        if name in _SAFETENSORS_ONLY and not any(folder.glob("*.safetensors")):
            raise WanCheckpointError(
                root, f"not a complete Wan checkpoint: {name}/ has no *.safetensors weights (fv-wan reads safetensors)", field=name
            )
        if name in ("text_encoder", "image_encoder") and not any(any(folder.glob(p)) for p in _TRANSFORMERS_WEIGHTS):
            raise WanCheckpointError(root, f"not a complete Wan checkpoint: {name}/ has no weights (model.safetensors)", field=name)


def _transformer(root: Path, name: str) -> tuple[WanTransformerConfig, bool, dict[str, Any]]:
    file = root / name / "config.json"
    raw = _read_json(file)
    original = "dim" in raw and "num_heads" in raw
    if original:
        model_type = raw.get("model_type", "t2v")
        if model_type not in ("t2v", "i2v", "ti2v"):
            raise _unsupported(file, "model_type", model_type, allowed=["t2v", "i2v", "ti2v"])
        if raw.get("window_size", [-1, -1]) not in ([-1, -1], (-1, -1)):
            raise _unsupported(file, "window_size", raw["window_size"], why="local attention", allowed=[[-1, -1]])
        if raw.get("qk_norm", True) is not True:
            raise _unsupported(file, "qk_norm", raw["qk_norm"], allowed=[True])
        missing = [k for k in ("num_layers", "ffn_dim", "in_dim", "out_dim") if k not in raw]
        if missing:
            raise WanCheckpointError(file, f"the original Wan layout needs field {missing[0]!r}; it is missing", field=missing[0])
    config = _parse_config(file, transformer_config_from_disk(raw), WanTransformerConfig, "WanTransformer3DModel")
    if config.patch_size[0] != 1 or config.patch_size[1] != config.patch_size[2]:
        raise _unsupported(file, "patch_size", list(config.patch_size), why="fv-wan patches 1 frame and square tiles",
                           allowed="[1, p, p]")
    if config.pos_embed_seq_len is not None:
        raise _unsupported(file, "pos_embed_seq_len", config.pos_embed_seq_len,
                           why="first-last-frame checkpoints; fv has no first-last-frame task", allowed=[None])
    return config, original, raw


def _vae(root: Path) -> tuple[WanVAEConfig, dict[str, Any]]:
    file = root / "vae" / "config.json"
    raw = _read_json(file)
    return _parse_config(file, raw, WanVAEConfig, "AutoencoderKLWan"), raw


# Scheduler fields: (diffusers 0.42's default, what fv's sampler reproduces). ``_MAPPED`` fields become the
# sampler's config; ``_IRRELEVANT`` ones do not change the schedule under the required settings (beta tables
# are unused with flow sigmas; thresholding options without thresholding; dynamic-shift options without it).
_UNIPC_REQUIRED: Mapping[str, tuple[Any, Any]] = {
    "num_train_timesteps": (1000, 1000), "prediction_type": ("epsilon", "flow_prediction"), "use_flow_sigmas": (False, True),
    "predict_x0": (True, True), "thresholding": (False, False), "lower_order_final": (True, True),
    "final_sigmas_type": ("zero", "zero"), "use_karras_sigmas": (False, False), "use_exponential_sigmas": (False, False),
    "use_beta_sigmas": (False, False), "use_dynamic_shifting": (False, False), "solver_p": (None, None),
    "shift_terminal": (None, None),
}  # fmt: skip
_UNIPC_MAPPED = {"flow_shift": ("shift", 1.0), "solver_order": ("solver_order", 2), "solver_type": ("solver_type", "bh2"),
                 "disable_corrector": ("disable_corrector", [])}
_UNIPC_IRRELEVANT = frozenset({
    "beta_start", "beta_end", "beta_schedule", "trained_betas", "rescale_betas_zero_snr", "timestep_spacing", "steps_offset",
    "dynamic_thresholding_ratio", "sample_max_value", "time_shift_type", "sigma_min", "sigma_max",
})  # fmt: skip
_EULER_REQUIRED: Mapping[str, tuple[Any, Any]] = {
    "num_train_timesteps": (1000, 1000), "use_dynamic_shifting": (False, False), "invert_sigmas": (False, False),
    "shift_terminal": (None, None), "use_karras_sigmas": (False, False), "use_exponential_sigmas": (False, False),
    "use_beta_sigmas": (False, False), "stochastic_sampling": (False, False),
}  # fmt: skip
_EULER_MAPPED = {"shift": ("shift", 1.0)}
_EULER_IRRELEVANT = frozenset({"base_shift", "max_shift", "base_image_seq_len", "max_image_seq_len", "time_shift_type"})
_SCHEDULERS = {
    "UniPCMultistepScheduler": ("unipc", _UNIPC_REQUIRED, _UNIPC_MAPPED, _UNIPC_IRRELEVANT),
    "FlowMatchEulerDiscreteScheduler": ("euler", _EULER_REQUIRED, _EULER_MAPPED, _EULER_IRRELEVANT),
}
#: diffusers maps these legacy UniPC solver types to "bh2" (``UniPCMultistepScheduler.__init__``).
_UNIPC_LEGACY_SOLVERS = ("midpoint", "heun", "logrho")


def sampler_from_scheduler(file: Path, scheduler_class: str, config: Mapping[str, Any]) -> SamplerBinding:
    """The kernel sampler binding equal to a diffusers scheduler config, or a typed error naming the field.

    Fields absent from the file take diffusers' defaults (as ``from_pretrained`` does), so a file that
    leaves out ``prediction_type`` is an epsilon-prediction scheduler, which fv does not run.
    """
    if scheduler_class not in _SCHEDULERS:
        raise _unsupported(file, "_class_name", scheduler_class, allowed=sorted(_SCHEDULERS))
    name, required, mapped, irrelevant = _SCHEDULERS[scheduler_class]
    fields = {k: v for k, v in config.items() if not k.startswith("_")}
    unknown = sorted(set(fields) - set(required) - set(mapped) - irrelevant)
    if unknown:
        raise _unsupported(file, unknown[0], fields[unknown[0]], why=f"not a {scheduler_class} field fv-wan knows (diffusers 0.42)")
    for key, (default, wanted) in required.items():
        value = fields.get(key, default)
        if value != wanted and not (wanted is None and not value):
            why = "diffusers' default; the file does not set it" if key not in fields else ""
            raise _unsupported(file, key, value, why=why, allowed=[wanted])
    sampler_config = {target: fields.get(key, default) for key, (target, default) in mapped.items()}
    if name == "unipc" and sampler_config["solver_type"] in _UNIPC_LEGACY_SOLVERS:
        sampler_config["solver_type"] = "bh2"
    try:
        builtin_samplers()[name](**sampler_config)
    except ValidationError as exc:
        err = exc.errors()[0]
        target = str(err["loc"][0]) if err["loc"] else ""
        key = next((k for k, (t, _) in mapped.items() if t == target), target)
        raise _unsupported(file, key, fields.get(key, sampler_config.get(target)), why=err["msg"]) from None
    return SamplerBinding(name=name, config=sampler_config)


def _fingerprint(files: Mapping[str, Mapping[str, Any]]) -> str:
    canonical = json.dumps({name: files[name] for name in sorted(files)}, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def read_checkpoint(root: Path) -> CheckpointConfigs:
    """Parse and cross-check a Wan checkpoint directory's configs; typed errors name what is wrong."""
    index_file = root / "model_index.json"
    if not index_file.is_file():
        raise WanCheckpointError(root, "not a complete Wan checkpoint: model_index.json is missing", field="model_index.json")
    index = _read_json(index_file)
    pipeline = index.get("_class_name")
    if pipeline not in SUPPORTED_PIPELINES:
        raise _unsupported(index_file, "_class_name", pipeline, allowed=sorted(SUPPORTED_PIPELINES))
    present, options = _components(root, index)
    _check_files(root, present)
    read: dict[str, Mapping[str, Any]] = {"model_index.json": index}

    transformer, original, raw = _transformer(root, "transformer")
    read["transformer/config.json"] = raw
    boundary = options.get("boundary_ratio")
    expand = options.get("expand_timesteps", False)
    if expand not in (True, False):
        raise _unsupported(index_file, "expand_timesteps", expand, allowed=[True, False])
    transformer_2 = None
    if boundary is not None:
        if isinstance(boundary, bool) or not isinstance(boundary, (int, float)) or not 0 < boundary < 1:
            raise _unsupported(index_file, "boundary_ratio", boundary, allowed="a number in (0, 1), or null")
        if "transformer_2" not in present:
            raise _unsupported(index_file, "boundary_ratio", boundary, why="it switches to transformer_2, which is null")
        transformer_2, original_2, raw_2 = _transformer(root, "transformer_2")
        read["transformer_2/config.json"] = raw_2
        original = original or original_2
        for field in ("in_channels", "out_channels", "patch_size", "text_dim", "image_dim"):
            if getattr(transformer_2, field) != getattr(transformer, field):
                raise _unsupported(root / "transformer_2" / "config.json", field, getattr(transformer_2, field),
                                   why=f"transformer/config.json has {_show(getattr(transformer, field))}; both experts see the same inputs")

    vae, raw_vae = _vae(root)
    read["vae/config.json"] = raw_vae
    t_file = root / "transformer" / "config.json"
    if transformer.out_channels != vae.z_dim:
        raise _unsupported(t_file, "out_channels", transformer.out_channels, why=f"the VAE's z_dim is {vae.z_dim}", allowed=[vae.z_dim])
    concat = pipeline == "WanImageToVideoPipeline" and not expand
    in_channels = 2 * vae.z_dim + 4 if concat else vae.z_dim
    if transformer.in_channels != in_channels:
        layout = "noise + 4-channel frame mask + image latent" if concat else "the noisy latent"
        raise _unsupported(t_file, "in_channels", transformer.in_channels, why=f"{pipeline} feeds {layout}", allowed=[in_channels])
    if concat and vae.temporal_compression != 4:
        raise _unsupported(root / "vae" / "config.json", "temperal_downsample", list(vae.temperal_downsample),
                           why="the image-to-video frame mask groups 4 frames per latent frame", allowed="two True entries (4x)")

    text_file = root / "text_encoder" / "config.json"
    text_config = _read_json(text_file)
    read["text_encoder/config.json"] = text_config
    text_width = text_config.get("d_model")
    if text_width != transformer.text_dim:
        raise _unsupported(text_file, "d_model", text_width, why=f"transformer/config.json has text_dim {transformer.text_dim}",
                           allowed=[transformer.text_dim])

    image_width = None
    if "image_encoder" in present:
        image_file = root / "image_encoder" / "config.json"
        image_config = _read_json(image_file)
        read["image_encoder/config.json"] = image_config
        image_width = image_config.get("hidden_size")
        if transformer.image_dim is None:
            raise _unsupported(t_file, "image_dim", None, why="the checkpoint has an image_encoder, whose tokens need the image branch")
        if image_width != transformer.image_dim:
            raise _unsupported(image_file, "hidden_size", image_width, why=f"transformer/config.json has image_dim {transformer.image_dim}",
                               allowed=[transformer.image_dim])
    elif transformer.image_dim is not None:
        raise _unsupported(t_file, "image_dim", transformer.image_dim, why="the checkpoint has no image_encoder to feed it", allowed=[None])
    if "image_processor" in present:
        read["image_processor/preprocessor_config.json"] = _read_json(root / "image_processor" / "preprocessor_config.json")

    scheduler_file = root / "scheduler" / "scheduler_config.json"
    scheduler_config = _read_json(scheduler_file)
    read["scheduler/scheduler_config.json"] = scheduler_config
    scheduler = str(scheduler_config.get("_class_name", present["scheduler"]))
    if scheduler != present["scheduler"]:
        raise _unsupported(scheduler_file, "_class_name", scheduler, why=f"model_index.json names {present['scheduler']}")
    sampler = sampler_from_scheduler(scheduler_file, scheduler, scheduler_config)
    return CheckpointConfigs(
        root=root, pipeline=pipeline, transformer=transformer, transformer_2=transformer_2, original_layout=original, vae=vae,
        text_encoder_width=int(text_width), image_encoder_width=image_width, has_image_processor="image_processor" in present,
        sampler=sampler, scheduler=scheduler, boundary_ratio=None if boundary is None else float(boundary),
        expand_timesteps=bool(expand), fingerprint=_fingerprint(read),
    )


# --------------------------------------------------------------------------- the card


def _cost(t: WanTransformerConfig) -> StepCostSpec:
    """The 1.3B measured cost, scaled by linear FLOPs per token and attention width (an estimate for admission)."""
    ref = WanTransformerConfig.wan21_t2v_1_3b()

    def linear(c: WanTransformerConfig) -> int:
        return c.num_layers * (4 * c.inner_dim**2 + 2 * c.inner_dim * c.ffn_dim)

    return COST_1_3B.model_copy(update={
        "per_unit_seconds": COST_1_3B.per_unit_seconds * linear(t) / linear(ref),
        "per_unit_sq_seconds": COST_1_3B.per_unit_sq_seconds * (t.num_layers * t.inner_dim) / (ref.num_layers * ref.inner_dim),
    })  # fmt: skip


def _defaults(c: CheckpointConfigs, spatial: int) -> GenerationDefaults:
    """Release-size models: WanPipeline's call defaults (480x832, 81 frames, 50 steps, guidance 5.0), rounded to the
    size and frame multiples; research-size ones: 4x6 spatial multiples, 2 latent frames after the first, 8 steps."""
    temporal = c.vae.temporal_compression
    shift = float(c.sampler.config["shift"])
    guidance_2 = 5.0 if c.boundary_ratio is not None else None  # WanPipeline: guidance_scale_2 defaults to guidance_scale
    if c.transformer.inner_dim < RESEARCH_WIDTH:
        return GenerationDefaults(height=4 * spatial, width=6 * spatial, frames=2 * temporal + 1, fps=8.0, steps=8,
                                  guidance=5.0, guidance_2=guidance_2, shift=shift)
    height, width = (max(spatial, spatial * round(v / spatial)) for v in (480, 832))
    return GenerationDefaults(height=height, width=width, frames=temporal * round(80 / temporal) + 1,
                              fps=24.0 if c.vae.is_residual else 16.0, steps=50, guidance=5.0, guidance_2=guidance_2, shift=shift)


def _model_id(root: Path, fingerprint: str) -> str:
    absolute = root.resolve()
    slug = re.sub(r"[^a-z0-9._-]+", "-", absolute.name.lower()).strip("-._")[:40] or "checkpoint"
    digest = hashlib.sha256(f"{absolute}\n{fingerprint}".encode()).hexdigest()[:8]
    return f"wan-local-{slug}-{digest}"


def derive_card(root: Path) -> ModelCard:
    """The card for the Wan checkpoint at ``root`` (configs read, no weights), or a typed error."""
    c = read_checkpoint(root)
    t, vae = c.transformer, c.vae
    absolute = root.resolve()
    tasks = SUPPORTED_PIPELINES[c.pipeline]
    i2v_mode: str | None = None
    if c.pipeline == "WanImageToVideoPipeline":
        i2v_mode = "first_frame" if c.expand_timesteps else "concat"
    elif c.expand_timesteps:  # a TI2V checkpoint: WanImageToVideoPipeline(expand_timesteps=True) runs it from the same folder
        tasks, i2v_mode = tasks | {I2V}, "first_frame"
    denoise_config: dict[str, Any] = {}
    if c.boundary_ratio is not None:
        denoise_config["boundary_ratio"] = c.boundary_ratio
    if c.expand_timesteps:
        denoise_config["expand_timesteps"] = True
    spatial = vae.spatial_compression * t.patch_size[1]
    research = t.inner_dim < RESEARCH_WIDTH
    experts = f"; two experts switched at t >= {c.boundary_ratio} x 1000" if c.boundary_ratio is not None else ""
    layout = " (transformer in the original Wan layout)" if c.original_layout else ""
    summary = (
        f"Derived from the Wan checkpoint at {absolute}{layout}: {c.pipeline}, {t.num_layers} layers x "
        f"{t.num_attention_heads} heads x {t.attention_head_dim}, ffn {t.ffn_dim}, text_dim {t.text_dim}; "
        f"VAE z_dim {vae.z_dim} ({'Wan 2.2' if vae.is_residual else 'Wan 2.1'} layout, {spatial // t.patch_size[1]}x); "
        f"{c.scheduler} -> sampler {c.sampler.name} (shift {c.sampler.config['shift']}){experts}"
    )
    card = _card(
        _model_id(root, c.fingerprint), summary=summary, transformer=t, vae=vae, tasks=tasks,
        defaults=_defaults(c, spatial), source=str(absolute), cost=_cost(t),
        recipe=RecipeSpec(method="base", data_contract=(
            f"the checkpoint directory {absolute}; card derived by fv-wan from its configs (sha256 {c.fingerprint})"
        )),
        image_encoder=c.image_encoder_width is not None, i2v_mode=i2v_mode, second_expert=c.boundary_ratio is not None,
        sampler=c.sampler, denoise_config=denoise_config,
        max_frames=vae.temporal_compression * (t.rope_max_seq_len - 1) + 1,
    )  # fmt: skip
    components = dict(card.components)
    components["text_encoder"] = components["text_encoder"].model_copy(update={"config": {"d_model": c.text_encoder_width}})
    if c.transformer_2 is not None:
        components["transformer_2"] = components["transformer_2"].model_copy(update={"config": c.transformer_2.to_diffusers_config()})
    if "image_encoder" in components:
        components["image_encoder"] = components["image_encoder"].model_copy(update={"config": {"hidden_size": c.image_encoder_width}})
    loops = dict(card.loops)
    if c.sampler.name == "euler":
        loops.pop("denoise_euler", None)  # the card's own loop is already Euler
    reference = "WanImageToVideoPipeline" if c.pipeline == "WanImageToVideoPipeline" else "WanPipeline"
    parity = card.parity.model_copy(update={
        "reference": f"diffusers==0.42.1:{reference}",
        "tests": (*card.parity.tests, "plugins/fv-wan/tests/test_any_checkpoint.py"),
    })  # fmt: skip
    precision = PrecisionContract(default="fp32" if research else "bf16", supported=frozenset({"fp32", "bf16"}))
    data = card.model_copy(update={
        "version": f"derived-{c.fingerprint[:12]}", "components": components, "loops": loops, "parity": parity,
        "precision": precision,
    }).model_dump()  # fmt: skip
    return ModelCard.model_validate(data)  # re-validated whole: the patched card is a valid card


# --------------------------------------------------------------------------- built-in equivalence


def _denoise(card: ModelCard) -> Any:
    return card.loops.get("denoise")


def _sampler(card: ModelCard) -> Any:
    loop = _denoise(card)
    if loop is None or loop.sampler is None or loop.sampler.fixed_steps is not None:
        return None
    # What the loop runs for a request at the card's default shift.
    return bound_sampler(loop.sampler, shift=card.capabilities.defaults.shift if card.capabilities.defaults else None)


def _transformer_config(card: ModelCard, component_id: str) -> WanTransformerConfig | None:
    spec = card.components.get(component_id)
    return None if spec is None else WanTransformerConfig.from_diffusers_config(spec.config)


def builtin_equivalent(derived: ModelCard) -> str | None:
    """The id of the built-in card that runs exactly what ``derived`` runs, or None.

    Equal: transformer(s) (up to the RoPE table bound), VAE, tasks, denoise loop options, image
    encoder presence, and the sampler at the default shift. Defaults such as size may differ.
    """
    found = {cid: _transformer_config(derived, cid) for cid in ("transformer", "transformer_2")}
    vae = WanVAEConfig.from_diffusers_config(derived.components["vae_decoder"].config)
    for card in wan_cards():
        if card.recipe.method != "base" or card.capabilities.tasks != derived.capabilities.tasks:
            continue
        experts = {cid: _transformer_config(card, cid) for cid in ("transformer", "transformer_2")}
        if any((experts[k] is None) != (found[k] is None) for k in found):
            continue
        if not all(found[k] is None or same_architecture(found[k], experts[k]) for k in found):  # type: ignore[arg-type]
            continue
        if WanVAEConfig.from_diffusers_config(card.components["vae_decoder"].config) != vae:
            continue
        if ("image_encoder" in card.components) != ("image_encoder" in derived.components):
            continue
        loop, mine = _denoise(card), _denoise(derived)
        if loop is None or mine is None or loop.config != mine.config or _sampler(card) != _sampler(derived):
            continue
        return card.model_id
    return None


def resolve_checkpoint_dir(root: Path) -> str | ModelCard | None:
    """fv-wan's answer for a directory: None if it is not a Wan checkpoint, a built-in card's id when one
    runs exactly this computation, else the derived card. A Wan checkpoint fv-wan cannot serve raises
    :class:`WanCheckpointError`."""
    if not is_wan_checkpoint(root):
        return None
    derived = derive_card(root)
    return builtin_equivalent(derived) or derived


def main(argv: list[str] | None = None) -> int:
    """``python -m fv_wan.derive CHECKPOINT_DIR``: the card fv-wan derives for the directory, as JSON on stdout."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m fv_wan.derive CHECKPOINT_DIR  (prints the derived card as JSON)", file=sys.stderr)
        return 2
    root = Path(args[0]).expanduser()
    if not root.is_dir():
        print(f"error: model: no such directory: {args[0]!r}", file=sys.stderr)
        return 2
    try:
        card = derive_card(root)
    except FvError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    builtin = builtin_equivalent(card)
    if builtin is not None:
        print(f"note: 'fv generate --model {args[0]}' runs the built-in card {builtin!r}, which computes the same", file=sys.stderr)
    print(card.model_dump_json(indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
