"""The Wan family's model cards: each a (recipe, runtime) pair with a parity contract.

Real cards name their diffusers-layout Hugging Face repo and the real architecture;
``*-tiny`` cards are embedded (seeded random weights, no download) and run every
code path of their real counterpart on CPU in seconds.
"""

from __future__ import annotations

from typing import Any

from fv_kernel.api import (
    AttentionAssumption,
    BatchedVsAlone,
    CapabilityMatrix,
    CheckpointManifest,
    ComponentCheckpoint,
    ComponentSpec,
    FrameRule,
    GenerationDefaults,
    LoopSpec,
    ModelCard,
    ParallelismContract,
    ParityLevel,
    ParitySpec,
    ParityTolerance,
    PrecisionContract,
    PrecisionPolicy,
    ProgramSpec,
    RecipeSpec,
    TrainedEnvelope,
    SamplerBinding,
    StepCostSpec,
    TaskType,
    TokenGridRule,
)
from fv_wan.fp8 import wan_precision_contract
from fv_wan.models.transformer import WanTransformerConfig
from fv_wan.models.vae import WanVAEConfig

__all__ = ["wan_cards", "causal_wan_cards", "SELF_FORCING_1_3B_SOURCE", "TINY_CARD_IDS", "WAN_FP32_MODULES"]

_PKG = "fv_wan"
T2V, I2V, T2I = TaskType.TEXT_TO_VIDEO, TaskType.IMAGE_TO_VIDEO, TaskType.TEXT_TO_IMAGE
#: diffusers' ``_keep_in_fp32_modules`` for WanTransformer3DModel.
WAN_FP32_MODULES = ("rope", "time_embedder", "scale_shift_table", "norm1", "norm2", "norm3")

_PARITY_FP32 = ParityTolerance(
    name="loop_vs_diffusers", metric="max_abs", dtype="fp32", value=1e-5,
    justification=(
        "decoded frames in [0, 1], fp32 on CPU, same weights, seed and scheduler settings. Components match "
        "diffusers to <=1e-5 (C0). Over whole tiny trajectories (T2V, I2V, TI2V, A14B, DMD) fv measured "
        "<=1.2e-6 (T2V 9.5e-7 with CFG batched into one forward, 8.3e-7 with diffusers' two sequential "
        "forwards): the residue is kernel reduction order (batched vs single GEMMs, unaligned safetensors "
        "buffers), not math. 1e-5 leaves ~8x margin for other CPUs' kernels."
    ),
)
_PARITY_BF16 = ParityTolerance(
    name="eager_bf16_vs_diffusers", metric="max_abs", dtype="bf16", value=0.0,
    justification="the DiT forward is bitwise identical to diffusers in bf16 (measured on CPU and H200)",
)

#: What throughput batching may change on the tiny cards (the kit's throughput gate checks it).
_BATCHED_FP32_TINY = BatchedVsAlone(
    precision="fp32", max_abs=1e-5,
    justification=(
        "decoded frames in [0, 1], fp32 on CPU, each request fused with 3 others vs run alone: measured <=1.5e-6 on "
        "wan-tiny, wan-tiny-a14b, wan-tiny-ti2v and fastwan-tiny, concurrent and staggered arrivals "
        "(bench/bench_batched_vs_alone.py): batched GEMMs and convolutions reduce in another order than batch 1. "
        "1e-5 leaves ~7x; a request reading another row's timestep moves its frames by ~1e-2"
    ),
)

#: What throughput batching may change on the 1.3B cards in bf16, where it was measured (the other real-size
#: cards declare nothing until measured, so their steps run unfused).
_BATCHED_BF16_1_3B = BatchedVsAlone(
    precision="bf16", max_abs=0.05,
    justification=(
        "decoded frames in [0, 1], bf16 on one H200 (torch 2.11, random weights at real size), 4 requests fused vs run "
        "alone, concurrent and staggered: measured 0.0117 on single 480x832 frames (3 bf16 ulps at 1.0) for both 1.3B "
        "cards, 0.0273 on fastwan2.1 videos (448x832x61, 3 steps) and 0.0234 on wan2.1 videos (480x832x17, 50 steps) "
        "(bench/bench_batched_vs_alone.py, 2026-12-04). 0.05 leaves ~2x"
    ),
)

#: The tiny Wan 2.1 VAE of the embedded cards: real latent statistics, small widths.
TINY_VAE21 = WanVAEConfig(base_dim=8, z_dim=16, dim_mult=(1, 2, 2, 2), num_res_blocks=1)
TINY_VAE22 = WanVAEConfig(
    base_dim=8, decoder_base_dim=8, z_dim=8, dim_mult=(1, 2, 2, 2), num_res_blocks=1, is_residual=True,
    in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=16,
    latents_mean=tuple(0.05 * i for i in range(8)), latents_std=tuple(0.8 + 0.05 * i for i in range(8)),
)

#: How each component's ``config`` parses (``ComponentSpec.config_schema``): ``fv cards validate`` and the
#: loaders in ``fv_wan.instance`` both parse through these.
TRANSFORMER_SCHEMA = "fv_wan.models.transformer:WanTransformerConfig.from_diffusers_config"
VAE_SCHEMA = "fv_wan.models.vae:WanVAEConfig.from_diffusers_config"
TEXT_ENCODER_SCHEMA = "fv_wan.component_configs:WanTextEncoderConfig"
IMAGE_ENCODER_SCHEMA = "fv_wan.component_configs:WanImageEncoderConfig"
#: ``ComponentSpec.parameters`` of every component: its weight elements, counted on the meta device.
PARAMETER_COUNT = "fv_wan.footprint:parameter_count"

#: The attention FastWan's sparse distillation trained under (FastVideo's published inference setting).
FASTWAN_VSA = AttentionAssumption(kind="vsa", sparsity=0.8, tile=(4, 4, 4))

TINY_CARD_IDS = ("wan-tiny", "wan-tiny-i2v", "wan-tiny-ti2v", "wan-tiny-a14b", "fastwan-tiny")


def _cost(tokens_linear_s: float, tokens_sq_s: float, fixed: float = 2e-3) -> StepCostSpec:
    # Measured on one H200 in bf16 (docs/benchmarks.md); fp32 on a GPU runs ~8x slower.
    return StepCostSpec(
        unit="tokens", fixed_seconds=fixed, per_unit_seconds=tokens_linear_s, per_unit_sq_seconds=tokens_sq_s,
        precision_factor={"bf16": 1.0, "fp16": 1.0, "fp32": 8.0},
    )


# 1.3B: 30 x 3.1 ms linear at 32,760 tokens, 30 x 11.6 ms attention (cuDNN) -> per token / token^2.
COST_1_3B = _cost(30 * 3.1e-3 / 32760, 30 * 11.6e-3 / 32760**2)
COST_5B = _cost(COST_1_3B.per_unit_seconds * 5.0 / 1.42, COST_1_3B.per_unit_sq_seconds * 2.0)
COST_14B = _cost(COST_1_3B.per_unit_seconds * 14.0 / 1.42, COST_1_3B.per_unit_sq_seconds * 40 / 30 * 40 / 12)
COST_TINY = StepCostSpec(unit="tokens", fixed_seconds=2e-3, per_unit_seconds=2e-5, precision_factor={"fp32": 1.0})


def _loops(
    *, sampler: SamplerBinding, cost: StepCostSpec, image: bool, denoise_config: dict[str, Any] | None = None,
    guidance: str = "cfg", rejects: frozenset[str] = frozenset(), extra_samplers: bool = True,
    decode_config: dict[str, Any] | None = None,
) -> dict[str, LoopSpec]:
    loops = {
        "text_encode": LoopSpec(loop_id="text_encode", kind="text_encode", implementation=f"{_PKG}.loops:WanTextEncodeLoop",
                                step_cost=StepCostSpec(fixed_seconds=0.02)),
        "denoise": LoopSpec(
            loop_id="denoise", kind="diffusion_denoise", implementation=f"{_PKG}.loops:WanDenoiseLoop",
            state_schema=f"{_PKG}.loops:WanDenoiseState", sampler=sampler, guidance=guidance, step_cost=cost,
            config=denoise_config or {}, valid_parallel_axes=("cfgp", "sp"), rejects_interceptors=rejects,  # type: ignore[arg-type]
        ),
        "decode": LoopSpec(loop_id="decode", kind="vae_decode", implementation=f"{_PKG}.loops:WanDecodeLoop",
                           step_cost=StepCostSpec(fixed_seconds=0.02), config=decode_config or {},
                           valid_parallel_axes=("vae",)),
    }
    if extra_samplers:
        shift = sampler.config.get("shift", 1.0)
        loops["denoise_euler"] = LoopSpec(
            loop_id="denoise_euler", kind="diffusion_denoise", implementation=f"{_PKG}.loops:WanDenoiseLoop",
            sampler=SamplerBinding(name="euler", config={"shift": shift}), guidance=guidance, step_cost=cost,
            config=denoise_config or {},
        )
    if image:
        loops["image_encode"] = LoopSpec(
            loop_id="image_encode", kind="image_encode", implementation=f"{_PKG}.loops:WanImageEncodeLoop",
            step_cost=StepCostSpec(fixed_seconds=0.05), config=denoise_config or {},
        )
    return loops


def _programs(tasks: frozenset[TaskType], image_loop: bool) -> dict[TaskType, ProgramSpec]:
    programs = {}
    for task in tasks:
        with_image = image_loop and task is I2V
        chain = ("text_encode", "image_encode", "denoise", "decode") if with_image else ("text_encode", "denoise", "decode")
        programs[task] = ProgramSpec(loops=chain, returns=frozenset({"video"}))
    return programs


def _components(
    *, transformer: WanTransformerConfig, vae: WanVAEConfig, tiny: bool, image_encoder: bool, tasks: frozenset[TaskType],
    second_expert: bool = False, vae_encoder_tasks: frozenset[TaskType] = frozenset(),
) -> tuple[dict[str, ComponentSpec], dict[str, ComponentCheckpoint]]:
    fp32 = PrecisionPolicy(keep_fp32_modules=WAN_FP32_MODULES)
    tcfg = transformer.to_diffusers_config()
    vcfg = vae.to_diffusers_config()
    components = {
        "transformer": ComponentSpec(component_id="transformer", kind="dit", builder=f"{_PKG}.instance:load_transformer",
                                     config=tcfg, config_schema=TRANSFORMER_SCHEMA, precision_policy=fp32),
        # Decode runs in the card's precision (bf16 on GPU, as FastVideo decodes); encode stays fp32.
        "vae_decoder": ComponentSpec(component_id="vae_decoder", kind="vae", builder=f"{_PKG}.instance:load_vae",
                                     config=vcfg, config_schema=VAE_SCHEMA),
        "text_encoder": ComponentSpec(component_id="text_encoder", kind="text_encoder", builder=f"{_PKG}.instance:load_text_encoder",
                                      config={"tiny": {"d_model": 32, "num_layers": 2}} if tiny else {},
                                      config_schema=TEXT_ENCODER_SCHEMA, precision_policy=PrecisionPolicy(dtype="fp32")),
    }
    checkpoint = {
        # single_file: ComfyUI's diffusion_models files (and the original release's) load as this component.
        "transformer": ComponentCheckpoint(subfolder="transformer", required_for=tasks, random_init_seed=1 if tiny else None,
                                           single_file=True),
        "vae_decoder": ComponentCheckpoint(subfolder="vae", required_for=tasks, random_init_seed=2 if tiny else None),
        "text_encoder": ComponentCheckpoint(subfolder="text_encoder", required_for=tasks, random_init_seed=3 if tiny else None),
    }
    if second_expert:
        components["transformer_2"] = components["transformer"].model_copy(update={"component_id": "transformer_2"})
        checkpoint["transformer_2"] = ComponentCheckpoint(subfolder="transformer_2", required_for=tasks,
                                                          random_init_seed=4 if tiny else None, single_file=True)
    if vae_encoder_tasks:
        components["vae_encoder"] = ComponentSpec(component_id="vae_encoder", kind="vae", builder=f"{_PKG}.instance:load_vae",
                                                  config=vcfg, config_schema=VAE_SCHEMA, precision_policy=PrecisionPolicy(dtype="fp32"))
        checkpoint["vae_encoder"] = ComponentCheckpoint(subfolder="vae", required_for=vae_encoder_tasks, random_init_seed=2 if tiny else None)
    if image_encoder:
        components["image_encoder"] = ComponentSpec(component_id="image_encoder", kind="image_encoder",
                                                    builder=f"{_PKG}.instance:load_image_encoder",
                                                    config={"tiny": {"hidden_size": 16}} if tiny else {},
                                                    config_schema=IMAGE_ENCODER_SCHEMA, precision_policy=PrecisionPolicy(dtype="fp32"))
        checkpoint["image_encoder"] = ComponentCheckpoint(subfolder="image_encoder", required_for=frozenset({I2V}),
                                                          random_init_seed=5 if tiny else None)
    # Every component's weight count, for the kernel's pre-flight memory check (counted when it asks).
    components = {k: c.model_copy(update={"parameters": PARAMETER_COUNT}) for k, c in components.items()}
    return components, checkpoint


#: Bounds every Wan card declares: steps up to the schedule's 1000 training timesteps, and
#: the frame rates an MP4 of it may be labelled with.
WAN_MAX_STEPS = 1000
WAN_FPS_RANGE = (1.0, 120.0)


def _card(
    model_id: str, *, summary: str, transformer: WanTransformerConfig, vae: WanVAEConfig, tasks: frozenset[TaskType],
    defaults: GenerationDefaults, source: str | None, recipe: RecipeSpec | None = None, cost: StepCostSpec = COST_1_3B,
    image_encoder: bool = False, i2v_mode: str | None = None, second_expert: bool = False,
    sampler: SamplerBinding | None = None, denoise_loop_id: str = "denoise", guidance: str = "cfg",
    denoise_config: dict[str, Any] | None = None, rejects: frozenset[str] = frozenset(), uses_guidance: bool = True,
    max_frames: int | None = None, batched_bf16: BatchedVsAlone | None = None,
) -> ModelCard:
    tiny = source is None
    if T2V in tasks:
        # A text-to-video card makes single frames too (frames = 1 is 4k+1 with k = 0), as WanPipeline does.
        tasks = tasks | {T2I}
    vae_encoder_tasks = frozenset({I2V}) & tasks if i2v_mode is not None else frozenset()
    components, checkpoint = _components(
        transformer=transformer, vae=vae, tiny=tiny, image_encoder=image_encoder, tasks=tasks,
        second_expert=second_expert, vae_encoder_tasks=vae_encoder_tasks,
    )
    config = dict(denoise_config or {})
    if i2v_mode is not None:
        config["i2v_mode"] = i2v_mode
    sampler = sampler or SamplerBinding(name="unipc", config={"shift": defaults.shift or 3.0})
    loops = _loops(sampler=sampler, cost=COST_TINY if tiny else cost, image=bool(vae_encoder_tasks),
                   denoise_config=config, guidance=guidance, rejects=rejects, extra_samplers=sampler.fixed_steps is None)
    if denoise_loop_id != "denoise":
        loops[denoise_loop_id] = loops.pop("denoise").model_copy(update={"loop_id": denoise_loop_id})
    programs = _programs(tasks, image_loop=bool(vae_encoder_tasks))
    if denoise_loop_id != "denoise":
        programs = {
            t: p.model_copy(update={"loops": tuple(denoise_loop_id if l == "denoise" else l for l in p.loops)})
            for t, p in programs.items()
        }
    spatial = vae.spatial_compression * transformer.patch_size[1]
    precision = wan_precision_contract(
        PrecisionContract(default="fp32", supported=frozenset({"fp32", "bf16"})) if tiny
        else PrecisionContract(default="bf16", supported=frozenset({"bf16", "fp32"})),
        tuple(c for c in components if components[c].kind == "dit"),
    )
    parity = ParitySpec(
        level=ParityLevel.C1, reference="diffusers==0.42.1:WanPipeline",
        tolerances=(_PARITY_FP32, _PARITY_BF16),
        batched_vs_alone=(_BATCHED_FP32_TINY,) if tiny else ((batched_bf16,) if batched_bf16 is not None else ()),
        tests=("plugins/fv-wan/tests/test_parity_transformer.py", "plugins/fv-wan/tests/test_parity_vae.py",
               "plugins/fv-wan/tests/test_parity_pipeline.py", "plugins/fv-wan/tests/test_checkpoint.py"),
    )
    return ModelCard(
        model_id=model_id, family="wan", summary=summary, components=components, loops=loops, programs=programs,
        capabilities=CapabilityMatrix(
            tasks=tasks, defaults=defaults, spatial_multiple=spatial,
            frame_rule=FrameRule(modulus=vae.temporal_compression, remainder=1), max_frames=max_frames,
            uses_guidance=uses_guidance,
            # The schedule has 1000 training timesteps; fps only labels the written video.
            max_steps=WAN_MAX_STEPS, min_fps=WAN_FPS_RANGE[0], max_fps=WAN_FPS_RANGE[1],
            # The RoPE table holds rope_max_seq_len positions per axis of the token grid.
            token_grid=TokenGridRule(
                max_per_axis=transformer.rope_max_seq_len, frames_per_latent=vae.temporal_compression,
                latent_frames_per_token=transformer.patch_size[0], pixels_per_token=spatial,
            ),
        ),
        recipe=recipe or RecipeSpec(method="base", data_contract="Wan-AI release"),
        parity=parity,
        precision=precision,
        # Sequence parallel within one node (Ulysses also needs the degree to divide the heads:
        # fv_wan.parallel checks it per plan); CFG-parallel only where there is guidance; the
        # row-strip VAE decode only for the Wan 2.1 VAE.
        parallelism=ParallelismContract(
            max_degree={"sp": 8, "cfgp": 2 if uses_guidance else 1, "vae": 1 if vae.is_residual else 8},
            implementation=f"{_PKG}.parallel:WAN_PARALLEL",
        ),
        checkpoint=CheckpointManifest(layout="embedded" if tiny else "diffusers", source=source, components=checkpoint),
        factory=f"{_PKG}.instance:build_wan_instance",
        # Every Wan LoRA format in the wild (diffusers/PEFT, original/ComfyUI, kohya/Musubi, full deltas).
        adapter_format=WAN_ADAPTER_FORMAT,
    )


#: What the Wan 2.1 releases were trained to make (the Wan2.1 repo's configs: ``frame_num`` 81,
#: ``sample_fps`` 16): at most 81 frames, at 16 fps. Sizes are not declared: fv's benches and RL
#: rollouts run these cards at reduced sizes on purpose (upstream's SUPPORTED_SIZES are in docs/cards.md).
WAN21_RECIPE = RecipeSpec(method="base", data_contract="Wan-AI release", envelope=TrainedEnvelope(max_frames=81, fps=(16.0,)))


#: The converter every Wan card names (``ModelCard.adapter_format``).
WAN_ADAPTER_FORMAT = f"{_PKG}.lora:convert_wan_lora"


def wan_cards() -> list[ModelCard]:
    """Every card fv-wan contributes (built fresh on each call: cards are immutable values)."""
    t2v, both = frozenset({T2V}), frozenset({T2V, I2V})
    d480 = dict(height=480, width=832, frames=81, fps=16.0, steps=50, guidance=5.0)
    cards = [
        _card("wan2.1-t2v-1.3b", recipe=WAN21_RECIPE, summary="Wan 2.1 text-to-video, 1.3B (12 heads x 128, 30 layers, ffn 8960)",
              transformer=WanTransformerConfig.wan21_t2v_1_3b(), vae=WanVAEConfig.wan21(), tasks=t2v,
              defaults=GenerationDefaults(**d480, shift=3.0), source="Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
              batched_bf16=_BATCHED_BF16_1_3B),
        _card("wan2.1-t2v-14b", recipe=WAN21_RECIPE, summary="Wan 2.1 text-to-video, 14B (40 heads, 40 layers, ffn 13824)",
              transformer=WanTransformerConfig.wan21_t2v_14b(), vae=WanVAEConfig.wan21(), tasks=t2v, cost=COST_14B,
              defaults=GenerationDefaults(height=720, width=1280, frames=81, fps=16.0, steps=50, guidance=5.0, shift=5.0),
              source="Wan-AI/Wan2.1-T2V-14B-Diffusers"),
        _card("wan2.1-i2v-14b-480p", recipe=WAN21_RECIPE, summary="Wan 2.1 image-to-video 480p, 14B; CLIP image tokens via added K/V",
              transformer=WanTransformerConfig.wan21_i2v_14b(), vae=WanVAEConfig.wan21(), tasks=frozenset({I2V}),
              cost=COST_14B, image_encoder=True, i2v_mode="concat",
              defaults=GenerationDefaults(**d480, shift=3.0), source="Wan-AI/Wan2.1-I2V-14B-480P-Diffusers"),
        _card("wan2.1-i2v-14b-720p", recipe=WAN21_RECIPE, summary="Wan 2.1 image-to-video 720p, 14B; CLIP image tokens via added K/V",
              transformer=WanTransformerConfig.wan21_i2v_14b(), vae=WanVAEConfig.wan21(), tasks=frozenset({I2V}),
              cost=COST_14B, image_encoder=True, i2v_mode="concat",
              defaults=GenerationDefaults(height=720, width=1280, frames=81, fps=16.0, steps=50, guidance=5.0, shift=5.0),
              source="Wan-AI/Wan2.1-I2V-14B-720P-Diffusers"),
        _card("wan2.2-ti2v-5b", summary="Wan 2.2 text/image-to-video, 5B; Wan 2.2 VAE (z 48, 16x); per-token timesteps",
              transformer=WanTransformerConfig.wan22_ti2v_5b(), vae=WanVAEConfig.wan22(), tasks=both, cost=COST_5B,
              i2v_mode="first_frame", denoise_config={"expand_timesteps": True},
              defaults=GenerationDefaults(height=704, width=1280, frames=121, fps=24.0, steps=50, guidance=5.0, shift=5.0),
              source="Wan-AI/Wan2.2-TI2V-5B-Diffusers"),
        _card("wan2.2-t2v-a14b", summary="Wan 2.2 text-to-video A14B: high/low-noise experts switched at t >= 875",
              transformer=WanTransformerConfig.wan21_t2v_14b(), vae=WanVAEConfig.wan21(), tasks=t2v, cost=COST_14B,
              second_expert=True, denoise_config={"boundary_ratio": 0.875},
              defaults=GenerationDefaults(height=720, width=1280, frames=81, fps=16.0, steps=40, guidance=4.0, guidance_2=3.0, shift=12.0),
              source="Wan-AI/Wan2.2-T2V-A14B-Diffusers"),
        # Sparse distillation: DMD2 and VSA (sparsity 0.8, 4x4x4 tiles) trained jointly; the checkpoint
        # carries each self-attention's to_gate_compress, loaded strictly. Deploy with attention_backend: vsa.
        _card("fastwan2.1-t2v-1.3b", summary="FastWan 2.1 1.3B: DMD2 + VSA sparse-distilled, 3 steps at shift 8, no CFG",
              transformer=WanTransformerConfig.wan21_t2v_1_3b().model_copy(update={"has_gate_compress": True}),
              vae=WanVAEConfig.wan21(), tasks=t2v,
              defaults=GenerationDefaults(height=448, width=832, frames=61, fps=16.0, steps=3, guidance=1.0, shift=8.0),
              source="FastVideo/FastWan2.1-T2V-1.3B-Diffusers",
              recipe=RecipeSpec(method="dmd2", parents=("wan2.1-t2v-1.3b",), data_contract="FastVideo DMD2 + VSA recipe",
                                assumes_loop="dmd_3step", consistency_required=ParityLevel.C1,
                                assumes_attention=FASTWAN_VSA),
              sampler=SamplerBinding(name="dmd", config={"denoising_timesteps": [1000, 757, 522], "shift": 8.0}, fixed_steps=3),
              denoise_loop_id="dmd_3step", guidance="none", rejects=frozenset({"step_skip"}), uses_guidance=False,
              batched_bf16=_BATCHED_BF16_1_3B),
        # -- embedded tiny cards: seeded random weights, every path, CPU seconds --------------
        _card("wan-tiny", summary="Embedded tiny Wan 2.1 T2V (seeded random weights): the default, no download",
              transformer=WanTransformerConfig.tiny(), vae=TINY_VAE21, tasks=t2v,
              defaults=GenerationDefaults(height=64, width=96, frames=9, fps=8.0, steps=8, guidance=5.0, shift=3.0),
              source=None, max_frames=33),
        _card("wan-tiny-i2v", summary="Embedded tiny Wan 2.1 I2V: CLIP image tokens, 36-channel input",
              transformer=WanTransformerConfig.tiny(image=True, in_channels=36), vae=TINY_VAE21, tasks=frozenset({I2V}),
              image_encoder=True, i2v_mode="concat",
              defaults=GenerationDefaults(height=64, width=64, frames=9, fps=8.0, steps=6, guidance=5.0, shift=3.0),
              source=None, max_frames=33),
        _card("wan-tiny-ti2v", summary="Embedded tiny Wan 2.2 TI2V: Wan 2.2 VAE layout, per-token timesteps",
              transformer=WanTransformerConfig.tiny(in_channels=8, out_channels=8), vae=TINY_VAE22, tasks=both,
              i2v_mode="first_frame", denoise_config={"expand_timesteps": True},
              defaults=GenerationDefaults(height=64, width=64, frames=9, fps=8.0, steps=6, guidance=5.0, shift=5.0),
              source=None, max_frames=33),
        _card("wan-tiny-a14b", summary="Embedded tiny Wan 2.2 A14B layout: two experts, boundary 0.875",
              transformer=WanTransformerConfig.tiny(), vae=TINY_VAE21, tasks=t2v, second_expert=True,
              denoise_config={"boundary_ratio": 0.875},
              defaults=GenerationDefaults(height=64, width=64, frames=9, fps=8.0, steps=8, guidance=4.0, guidance_2=3.0, shift=12.0),
              source=None, max_frames=33),
        _card("fastwan-tiny", summary="Embedded tiny DMD2 card: 3-step DMD loop, no CFG",
              transformer=WanTransformerConfig.tiny(), vae=TINY_VAE21, tasks=t2v,
              defaults=GenerationDefaults(height=64, width=64, frames=9, fps=8.0, steps=3, guidance=1.0, shift=8.0),
              source=None, max_frames=33,
              recipe=RecipeSpec(method="dmd2", parents=("wan-tiny",), assumes_loop="dmd_3step"),
              sampler=SamplerBinding(name="dmd", config={"denoising_timesteps": [1000, 757, 522], "shift": 8.0}, fixed_steps=3),
              denoise_loop_id="dmd_3step", guidance="none", rejects=frozenset({"step_skip"}), uses_guidance=False),
    ]
    return cards


#: The Self-Forcing causal 1.3B's checkpoint: the diffusers layout (plain Wan transformer weights; its
#: ``scheduler/`` is SF's ``SelfForcingFlowMatchScheduler``, shift 5.0, which the card's recipe carries).
SELF_FORCING_1_3B_SOURCE = "wlsaidhi/SFWan2.1-T2V-1.3B-Diffusers"


def causal_wan_cards() -> list[ModelCard]:
    """fv-wan's causal (streaming) cards on real checkpoints: ``wan2.1-t2v-1.3b-causal``."""
    from fv_wan.causal import CausalRecipe, causal_card

    base = next(card for card in wan_cards() if card.model_id == "wan2.1-t2v-1.3b")
    # SF's shipped inference config: steps [1000, 750, 500, 250] warped at shift 5, 3 latent frames per
    # chunk, a 21-frame window (7 chunks, rolling past it), no sink, the KV refresh at context_noise 0.
    recipe = CausalRecipe(frames_per_chunk=3, sink_chunks=0, local_chunks=7, context_noise=0.0, max_height=480, max_width=832)
    return [causal_card(
        base, model_id="wan2.1-t2v-1.3b-causal", source=SELF_FORCING_1_3B_SOURCE, recipe=recipe, sessions=4,
        summary="Self-Forcing Wan 2.1 T2V 1.3B: block-causal, chunk-wise streaming (4-step DMD, KV cache)",
        recipe_spec=RecipeSpec(method="self_forcing_dmd", parents=("wan2.1-t2v-1.3b",), assumes_loop="realtime",
                               data_contract="Self-Forcing DMD distillation (guandao/Self-Forcing, VidProM prompts)",
                               envelope=TrainedEnvelope(fps=(16.0,))),
        defaults=GenerationDefaults(height=480, width=832, frames=81, fps=16.0, steps=4, guidance=1.0, shift=5.0),
    )]
