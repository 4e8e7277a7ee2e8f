"""Model cards: ``cosmos3-nano`` and ``cosmos3-super`` (real configs, diffusers / unified checkpoints)
and ``cosmos3-tiny`` (seeded random weights reaching every path, CPU seconds)."""

from __future__ import annotations

from typing import Any

from fv_kernel.api import (
    BatchedVsAlone,
    CacheContract,
    CapabilityMatrix,
    CheckpointManifest,
    ComponentCheckpoint,
    ComponentSpec,
    FrameRule,
    GenerationDefaults,
    LoopSpec,
    ModelCard,
    ParitySpec,
    ParityTolerance,
    PrecisionContract,
    PrecisionPolicy,
    ProgramSpec,
    RecipeSpec,
    SamplerBinding,
    StepCostSpec,
    TaskType,
)
from fv_cosmos3.models.audio_vae import Cosmos3AudioDecoderConfig
from fv_cosmos3.models.config import Cosmos3Config
from fv_wan.models.vae import WanVAEConfig

__all__ = ["CARD_IDS", "cosmos3_card", "cosmos3_cards", "tiny_vae_config"]

CARD_IDS = ("cosmos3-tiny", "cosmos3-nano", "cosmos3-super")
_PKG = "fv_cosmos3"
_PROGRAM = f"{_PKG}.program:Cosmos3Program"
#: Weight elements of a component, counted on the meta device when the pre-flight asks (not at card build).
_COUNT = f"{_PKG}.footprint:parameter_count"

T = TaskType
_VIDEO_TASKS = frozenset({T.TEXT_TO_VIDEO, T.TEXT_TO_IMAGE, T.IMAGE_TO_VIDEO, T.TEXT_TO_VIDEO_AUDIO})
_ACTION_TASKS = frozenset({T.ACTION_POLICY, T.FORWARD_DYNAMICS, T.INVERSE_DYNAMICS})
_GEN_TASKS = _VIDEO_TASKS | _ACTION_TASKS
_ALL_TASKS = _GEN_TASKS | {T.TEXT_GENERATION}

#: What throughput batching may change on cosmos3-tiny (the kit's throughput gate checks it).
_BATCHED_FP32_TINY = BatchedVsAlone(
    precision="fp32", max_abs=1e-5,
    justification=(
        "decoded frames in [0, 1], fp32 on CPU, 4 text-to-video requests fused vs run alone: measured 6.0e-7 "
        "(bench/bench_batched_vs_alone.py --card cosmos3-tiny); the generator's fused GEMMs block differently "
        "from one row (generator_batched_vs_one_row). 1e-5 leaves >10x"
    ),
)


#: cosmos3-nano's promise at bf16: its token steps fuse; its video and action steps run each request alone.
_BATCHED_BF16_NANO_TOKENS = BatchedVsAlone(
    precision="bf16", max_abs=0.0, ops=("ar_token",), text="may_diverge",
    justification=(
        "token steps only, bf16, random weights at Nano's size on one H100, 2026-12-05 (bench/bench_cosmos3.py "
        "--card cosmos3-nano --sections decode; bench/records/h100_2026-12-05b/cosmos3_decode.json): one graphed "
        "step of 8 rows fused vs each row alone moved the logits by at most 0.07 (max |logit| 5.12) and kept 8 of 8 "
        "greedy tokens, but over 64-token chats all 8 texts diverged from their runs alone (random weights' "
        "near-uniform logits tie often), so text may diverge. The video and action ops stay unfused: a request "
        "whose text did not diverge gets the tensors it gets alone (max_abs 0); one whose upsampled prompt "
        "diverged gets the video of that prompt. Fused, 8 chats decoded 299 tok/s against 95 one row at a time"
    ),
)


def tiny_vae_config() -> WanVAEConfig:
    """A Wan-2.2-shaped VAE (residual, patch 2, 16x spatial, 4x temporal) with 4 latent channels."""
    return WanVAEConfig(
        base_dim=4, decoder_base_dim=6, z_dim=4, dim_mult=(1, 2, 2, 2), num_res_blocks=1, is_residual=True,
        in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=16,
        latents_mean=(0.1, -0.2, 0.05, 0.3), latents_std=(0.9, 1.2, 0.7, 1.1),
    )


def _dump(config: Any) -> dict[str, Any]:
    data = config.model_dump(mode="json")
    return {k: list(v) if isinstance(v, tuple) else v for k, v in data.items()}


def cosmos3_card(model_id: str) -> ModelCard:
    if model_id not in CARD_IDS:
        raise ValueError(f"unknown Cosmos 3 card {model_id!r}; allowed: {list(CARD_IDS)}")
    tiny = model_id == "cosmos3-tiny"
    if tiny:
        mot = Cosmos3Config.tiny()
        vae = tiny_vae_config()
        sound = Cosmos3AudioDecoderConfig(
            sampling_rate=150, vocoder_input_dim=4, dec_dim=4, dec_c_mults=(1, 2), dec_strides=(2, 3), dec_out_channels=2
        )
        tokenizer: dict[str, Any] = {"kind": "byte", "vocab_size": mot.vocab_size, "max_sequence_tokens": 512,
                                     "upsample_max_tokens": 24}
        defaults = GenerationDefaults(height=32, width=64, frames=5, fps=24.0, steps=3, guidance=2.0, shift=3.0)
        budget = 4 * 2**20
    else:
        mot = Cosmos3Config.nano() if model_id == "cosmos3-nano" else Cosmos3Config.super_()
        vae = WanVAEConfig.wan22()
        sound = Cosmos3AudioDecoderConfig()
        tokenizer = {"kind": "hf", "max_sequence_tokens": 8192, "upsample_max_tokens": 512}
        # The reference T2V recipe: 35 UniPC steps, guidance 6, shift 10, 189 frames at 24 fps, at 1280x720. 720 is
        # not a multiple of this card's spatial_multiple (16x VAE x patch 2 = 32), so the default height is the
        # nearest multiple below it, 704 (as Wan 2.2 TI2V-5B's 1280x704); a request may still ask for 736.
        defaults = GenerationDefaults(height=704, width=1280, frames=189, fps=24.0, steps=35, guidance=6.0, shift=10.0)
        budget = 8 * 2**30

    def seed(n: int) -> int | None:
        return n if tiny else None

    components = {
        "transformer": ComponentSpec(
            component_id="transformer", kind="transformer", builder=f"{_PKG}.models.mot:Cosmos3MoT", config=_dump(mot),
            precision_policy=PrecisionPolicy(keep_fp32_modules=("time_embedder",)), parameters=_COUNT,
            parity_tests=("tests/test_parity_reasoner.py", "tests/test_parity_generator.py", "tests/test_c1_text.py",
                          "tests/test_c1_video.py"),
        ),
        "tokenizer": ComponentSpec(component_id="tokenizer", kind="tokenizer", builder=f"{_PKG}.models.tokenizer:ByteTokenizer",
                                   config=tokenizer, parameters=0),
        "vae": ComponentSpec(component_id="vae", kind="vae", builder="fv_wan.models.vae:WanVAE", config=_dump(vae),
                             parameters=_COUNT),
        "sound_decoder": ComponentSpec(
            component_id="sound_decoder", kind="audio_decoder", builder=f"{_PKG}.models.audio_vae:Cosmos3AudioDecoder",
            config=_dump(sound), parity_tests=("tests/test_parity_audio.py",), parameters=_COUNT,
        ),
    }
    checkpoint = CheckpointManifest(
        layout="embedded" if tiny else "diffusers",
        source=None,
        components={
            "transformer": ComponentCheckpoint(subfolder="transformer", required_for=_ALL_TASKS, random_init_seed=seed(0)),
            "tokenizer": ComponentCheckpoint(subfolder="text_tokenizer", required_for=_ALL_TASKS),
            "vae": ComponentCheckpoint(subfolder="vae", required_for=_GEN_TASKS, random_init_seed=seed(1)),
            # Declared, not guessed: only the joint video+sound task needs the sound decoder.
            "sound_decoder": ComponentCheckpoint(subfolder="sound_tokenizer", required_for=frozenset({T.TEXT_TO_VIDEO_AUDIO}),
                                                 random_init_seed=seed(2)),
        },
    )
    token_cost = StepCostSpec(unit="tokens", fixed_seconds=2e-3 if tiny else 2e-2, per_unit_seconds=1e-6 if tiny else 2e-5)
    loops = {
        "ar_decode": LoopSpec(
            loop_id="ar_decode", kind="ar_decode", implementation=f"{_PKG}.loops:Cosmos3ARDecodeLoop",
            state_schema=f"{_PKG}.loops:ARDecodeState", causal=True, step_cost=token_cost,
        ),
        "denoise": LoopSpec(
            loop_id="denoise", kind="diffusion_denoise", implementation=f"{_PKG}.loops:Cosmos3DenoiseLoop",
            state_schema=f"{_PKG}.loops:DenoiseState", sampler=SamplerBinding(name="unipc", config={"shift": defaults.shift}),
            guidance="cfg", step_cost=StepCostSpec(unit="tokens", fixed_seconds=5e-3 if tiny else 0.05,
                                                   per_unit_seconds=2e-5 if tiny else 2e-4),
            valid_parallel_axes=("cfgp",),
        ),
        "denoise_euler": LoopSpec(
            loop_id="denoise_euler", kind="diffusion_denoise", implementation=f"{_PKG}.loops:Cosmos3DenoiseLoop",
            state_schema=f"{_PKG}.loops:DenoiseState", sampler=SamplerBinding(name="euler", config={"shift": defaults.shift}),
            guidance="cfg", step_cost=StepCostSpec(unit="tokens", fixed_seconds=5e-3 if tiny else 0.05),
        ),
        "decode_video": LoopSpec(loop_id="decode_video", kind="vae_decode", implementation=f"{_PKG}.loops:VideoDecodeLoop",
                                 step_cost=StepCostSpec(fixed_seconds=1e-2 if tiny else 2.0), batchable=False),
        "decode_sound": LoopSpec(loop_id="decode_sound", kind="audio_decode", implementation=f"{_PKG}.loops:SoundDecodeLoop",
                                 step_cost=StepCostSpec(fixed_seconds=1e-2 if tiny else 0.5), batchable=False),
    }
    # What Cosmos3Program returns per task; "text" is the rewritten prompt (with prompt_upsampling)
    # or, for text_generation, the answer; "tensor" is the action of the action tasks.
    returns: dict[TaskType, frozenset[str]] = {
        T.TEXT_GENERATION: frozenset({"text"}),
        T.TEXT_TO_VIDEO_AUDIO: frozenset({"video", "audio", "text"}),
        T.ACTION_POLICY: frozenset({"video", "tensor", "text"}),
        T.INVERSE_DYNAMICS: frozenset({"video", "tensor", "text"}),
    }
    programs = {
        task: ProgramSpec(implementation=_PROGRAM, returns=returns.get(task, frozenset({"video", "text"})))
        for task in _ALL_TASKS
    }
    return ModelCard(
        model_id=model_id,
        family="cosmos3",
        summary=(
            "Cosmos 3 omni two-tower MoT on one resident instance: reasoner ar_decode (prompt upsampling, text) and "
            "multimodal diffusion (video, image, sound, action) share the reasoner weights"
            + (" (tiny seeded random weights for CPU tests)" if tiny else "")
        ),
        components=components,
        loops=loops,
        programs=programs,  # type: ignore[arg-type]
        capabilities=CapabilityMatrix(
            tasks=_ALL_TASKS, defaults=defaults,
            spatial_multiple=vae.spatial_compression * mot.latent_patch_size,
            frame_rule=FrameRule(modulus=vae.temporal_compression, remainder=1),
            # The schedule has 1000 training timesteps; fps labels the video and times its sound.
            max_steps=1000, min_fps=1.0, max_fps=120.0,
        ),
        recipe=RecipeSpec(method="base"),
        parity=ParitySpec(
            level="C1", reference="diffusers==0.42.1:Cosmos3OmniPipeline; transformers>=5.24:Cosmos3OmniForConditionalGeneration",
            tolerances=(
                ParityTolerance(name="c0_components", metric="max_abs", value=1e-5,
                                justification="same fp32 math; summation order differs in attention"),
                ParityTolerance(name="c1_t2v_trajectory", metric="max_abs", value=1e-4,
                                justification="3 UniPC steps compound C0 differences"),
                ParityTolerance(name="interleaved_vs_serial", metric="bit_identical", value=0.0,
                                justification="exact batching runs non-batch-invariant ops per sample"),
                ParityTolerance(name="generator_batched_vs_one_row", metric="max_abs", value=5e-5,
                                justification="fp32 GEMMs over B x N rows block differently from N rows; measured "
                                              "<= 1e-5 on cosmos3-tiny outputs of magnitude ~5"),
            ),
            tests=("tests/test_c1_text.py", "tests/test_c1_video.py", "tests/test_shared_weights.py",
                   "tests/test_interleave_gate.py", "tests/test_generator_batching.py"),
            batched_vs_alone=(_BATCHED_FP32_TINY,) if tiny else
            (_BATCHED_BF16_NANO_TOKENS,) if model_id == "cosmos3-nano" else (),  # super: not measured
        ),
        caches={"text_kv": CacheContract(cache_class="paged_kv", key_fields=("request_id",), budget_bytes=budget)},
        precision=PrecisionContract(default="fp32" if tiny else "bf16",
                                    supported=frozenset({"fp32"}) if tiny else frozenset({"fp32", "bf16"})),
        checkpoint=checkpoint,
        factory=f"{_PKG}.instance:build_cosmos3_instance",
    )


def cosmos3_cards() -> list[ModelCard]:
    return [cosmos3_card(m) for m in CARD_IDS]
