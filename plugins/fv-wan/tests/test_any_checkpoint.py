"""Any Wan checkpoint that diffusers' Wan pipelines load runs under ``fv generate --model DIR``.

Each checkpoint here is written by diffusers' ``save_pretrained`` from diffusers' and transformers'
own classes with seeded random weights, in sizes and settings no built-in card has. fv-wan
derives a card from the directory's configs; ``fv generate`` then must equal
``<pipeline>.from_pretrained(DIR)`` for the same seed within the card's tolerance. Only the
weights are shared: the reference uses its own tokenizer, encoders and scheduler from the
directory. Unsupported checkpoints and bad paths are one ``error:`` line naming what is wrong.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler, WanImageToVideoPipeline
from typer.testing import CliRunner

from fv_kernel.api import CheckpointNotFound, ModelCard, TaskType, build_instance, check_card_builds
from fv_kernel.cli.app import app
from fv_wan.cards import TINY_VAE21, wan_cards
from fv_wan.derive import RESEARCH_WIDTH, WanCheckpointError, derive_card, resolve_checkpoint_dir
from fv_wan.models.transformer import WanTransformerConfig
from doc_blocks import REPO, doc_blocks, run_doc_block
from tiny_wan_checkpoints import (
    reference_pipeline,
    tiny_transformer_config,
    tiny_vae_config,
    to_original_layout,
    write_checkpoint,
)

SEED = 5
PROMPT = "a red fox runs through fresh snow"
T2V, I2V, T2I = TaskType.TEXT_TO_VIDEO, TaskType.IMAGE_TO_VIDEO, TaskType.TEXT_TO_IMAGE


def _unipc(**config: Any) -> UniPCMultistepScheduler:
    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, **config)


def _tolerance(card: ModelCard) -> float:
    (tolerance,) = [t for t in card.parity.tolerances if t.name == "loop_vs_diffusers" and t.dtype == "fp32"]
    return tolerance.value


def _generate(root: Path, out: Path, *extra: str, seed: int = SEED) -> Any:
    return CliRunner().invoke(app, ["generate", "--quiet", "--model", str(root), "--prompt", PROMPT, "--seed", str(seed),
                                    "--output", str(out), *extra])


def _fv_video(root: Path, tmp_path: Path, *extra: str) -> torch.Tensor:
    out = tmp_path / "fv.pt"
    result = _generate(root, out, *extra)
    assert result.exit_code == 0, result.output
    return torch.load(out)


def _reference(pipe: Any, card: ModelCard, seed: int = SEED, **kwargs: Any) -> torch.Tensor:
    d = card.capabilities.defaults
    assert d is not None
    frames = pipe(prompt=PROMPT, height=d.height, width=d.width, num_frames=d.frames, num_inference_steps=d.steps,
                  guidance_scale=d.guidance, generator=torch.Generator().manual_seed(seed), output_type="pt", **kwargs).frames
    return frames[0]


def _assert_equal_within_tolerance(card: ModelCard, fv: torch.Tensor, reference: torch.Tensor) -> float:
    assert fv.shape == reference.shape, (fv.shape, reference.shape)
    assert fv.std() > 0.02 and 0.0 <= fv.min() and fv.max() <= 1.0  # content, not a constant clip
    diff = (fv - reference).abs().max().item()
    assert diff <= _tolerance(card), f"max abs diff {diff:.3g} > {_tolerance(card):.1g}"
    return diff


# --------------------------------------------------------------------------- checkpoints


@pytest.fixture(scope="module")
def t2v_dir(tmp_path_factory) -> Path:
    """3 layers x 3 heads x 8 (no built-in has it), UMT5 d_model 48, VAE base_dim 12, Euler at shift 7."""
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "My Wan-T2V", transformer=tiny_transformer_config(),
                            vae=tiny_vae_config(), scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0))


@pytest.fixture(scope="module")
def experts_dir(tmp_path_factory) -> Path:
    """Two experts switched at boundary_ratio 0.9 (A14B-style), UniPC order 3 at flow_shift 4."""
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "experts", transformer=tiny_transformer_config(),
                            transformer_2=tiny_transformer_config(), boundary_ratio=0.9, vae=tiny_vae_config(),
                            scheduler=_unipc(flow_shift=4.0, solver_order=3), seed=10)


@pytest.fixture(scope="module")
def i2v_dir(tmp_path_factory) -> Path:
    """Wan 2.1-style image-to-video: 36 input channels, a CLIP tower of width 20 and its image processor."""
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "i2v",
                            transformer=tiny_transformer_config(in_channels=36, image_dim=20, added_kv_proj_dim=24),
                            vae=tiny_vae_config(), scheduler=_unipc(flow_shift=3.0), image_encoder_width=20, seed=20)


@pytest.fixture(scope="module")
def i2v_experts_dir(tmp_path_factory) -> Path:
    """Wan 2.2 I2V-A14B-style: image-to-video without a CLIP tower (frame mask + image latent only), two experts."""
    transformer = tiny_transformer_config(in_channels=36)
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "i2v-experts", transformer=transformer, transformer_2=transformer,
                            boundary_ratio=0.9, vae=tiny_vae_config(), scheduler=_unipc(flow_shift=5.0), seed=40)


@pytest.fixture(scope="module")
def ti2v_dir(tmp_path_factory) -> Path:
    """Wan 2.2 TI2V-style: a tiny Wan 2.2 VAE (z 8, patch 2, 16x) and per-token timesteps (expand_timesteps)."""
    vae = dict(base_dim=8, decoder_base_dim=8, z_dim=8, dim_mult=[1, 2, 2, 2], num_res_blocks=1, is_residual=True,
               in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=16, temperal_downsample=[False, True, True],
               latents_mean=[0.05 * i for i in range(8)], latents_std=[0.8 + 0.05 * i for i in range(8)])
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "ti2v", transformer=tiny_transformer_config(in_channels=8, out_channels=8),
                            vae=vae, scheduler=_unipc(flow_shift=5.0), expand_timesteps=True, seed=30)


# --------------------------------------------------------------------------- the derived card


def test_derived_card_records_provenance_and_follows_the_configs(t2v_dir: Path, tmp_path: Path) -> None:
    card = derive_card(t2v_dir)
    absolute = t2v_dir.resolve()
    # A stable, valid id: the folder's name (slugged) and a hash of the path and configs.
    assert re.fullmatch(r"wan-local-my-wan-t2v-[0-9a-f]{8}", card.model_id), card.model_id
    assert derive_card(t2v_dir).model_id == card.model_id
    assert card.model_id not in {c.model_id for c in wan_cards()}
    # Provenance: the directory and a sha256 of its configs; the weights load from the directory.
    assert card.checkpoint.source == str(absolute) and card.checkpoint.layout == "diffusers"
    (fingerprint,) = re.findall(r"sha256 ([0-9a-f]{64})", card.recipe.data_contract or "")
    assert str(absolute) in card.recipe.data_contract and card.version == f"derived-{fingerprint[:12]}"
    assert str(absolute) in card.summary and "3 layers x 3 heads x 8" in card.summary
    # The configs, as configured.
    t = WanTransformerConfig.from_diffusers_config(card.components["transformer"].config)
    assert (t.num_layers, t.num_attention_heads, t.attention_head_dim, t.ffn_dim, t.text_dim) == (3, 3, 8, 40, 48)
    assert card.components["vae_decoder"].config["base_dim"] == 12
    assert card.components["text_encoder"].config == {"d_model": 48}
    assert card.capabilities.tasks == {T2V, T2I}  # WanPipeline
    assert card.parity.reference == "diffusers==0.42.1:WanPipeline"
    # The scheduler became the denoise loop's sampler; Euler is the card's own loop, not an extra one.
    denoise = card.loops["denoise"]
    assert denoise.sampler is not None and denoise.sampler.name == "euler" and denoise.sampler.config == {"shift": 7.0}
    assert "denoise_euler" not in card.loops
    # Research-size defaults (narrower than 1.3B): fp32, 4x6 spatial multiples, 2 latent frames + 1, 8 steps.
    assert t.inner_dim < RESEARCH_WIDTH and card.precision.default == "fp32"
    d = card.capabilities.defaults
    assert (d.height, d.width, d.frames, d.steps, d.guidance, d.shift) == (64, 96, 9, 8, 5.0, 7.0)
    assert card.capabilities.max_frames == 4 * (32 - 1) + 1  # latent frames within the RoPE table (rope_max_seq_len 32)
    # Every builder and component config of the derived card builds (fv cards validate's check).
    assert check_card_builds(card) == []
    # Another config is another card: the fingerprint and id follow the configs.
    other = tmp_path / t2v_dir.name
    shutil.copytree(t2v_dir, other)
    scheduler = other / "scheduler" / "scheduler_config.json"
    scheduler.write_text(json.dumps({**json.loads(scheduler.read_text()), "shift": 6.0}))
    changed = derive_card(other)
    assert changed.model_id != card.model_id and changed.version != card.version
    assert changed.capabilities.defaults.shift == 6.0


def test_release_size_defaults_are_wan_pipelines(t2v_dir: Path, tmp_path: Path) -> None:
    """A transformer as wide as a release gets WanPipeline's call defaults and bf16 (configs only: no weights read)."""
    root = tmp_path / "wide"
    shutil.copytree(t2v_dir, root)
    config_file = root / "transformer" / "config.json"
    config = json.loads(config_file.read_text())
    # As a release has it: 12 x 128 wide, and a RoPE table that covers 480x832 (the tiny one's 32 does not).
    config_file.write_text(json.dumps({**config, "num_attention_heads": 12, "attention_head_dim": 128, "rope_max_seq_len": 1024}))
    card = derive_card(root)
    d = card.capabilities.defaults
    assert (d.height, d.width, d.frames, d.fps, d.steps, d.guidance) == (480, 832, 81, 16.0, 50, 5.0)
    assert card.precision.default == "bf16"


def test_built_in_architecture_resolves_to_the_built_in_card(t2v_dir: Path, tmp_path: Path, wan_card: Any) -> None:
    """A directory that runs exactly wan-tiny's computation is wan-tiny; any difference that changes the
    output (here the scheduler's flow_shift) gives a derived card instead."""
    root = tmp_path / "wan-tiny-configs"
    shutil.copytree(t2v_dir, root)
    wan_tiny = wan_card("wan-tiny")
    (root / "transformer" / "config.json").write_text(json.dumps(wan_tiny.components["transformer"].config))
    (root / "vae" / "config.json").write_text(json.dumps(TINY_VAE21.to_diffusers_config()))
    text_file = root / "text_encoder" / "config.json"
    text_file.write_text(json.dumps({**json.loads(text_file.read_text()), "d_model": 32}))
    index_file = root / "model_index.json"
    index = json.loads(index_file.read_text())
    index["scheduler"] = ["diffusers", "UniPCMultistepScheduler"]
    index_file.write_text(json.dumps(index))
    scheduler_file = root / "scheduler" / "scheduler_config.json"
    scheduler_file.write_text(json.dumps(dict(_unipc(flow_shift=3.0).config)))
    assert resolve_checkpoint_dir(root) == "wan-tiny"
    scheduler_file.write_text(json.dumps(dict(_unipc(flow_shift=4.0).config)))
    derived = resolve_checkpoint_dir(root)
    assert isinstance(derived, ModelCard) and derived.capabilities.defaults.shift == 4.0


def test_an_encoder_width_the_card_pins_is_checked_when_it_loads(t2v_dir: Path) -> None:
    """A card (e.g. an edited card file) whose text encoder width is not the checkpoint's fails at load, naming both."""
    data = derive_card(t2v_dir).model_dump()
    data["components"]["text_encoder"]["config"] = {"d_model": 32}
    instance = build_instance(ModelCard.model_validate(data))
    with pytest.raises(CheckpointNotFound, match=r"holds a text_encoder of d_model 48; card '.*' expects d_model 32"):
        instance.component("text_encoder")


# --------------------------------------------------------------------------- parity with diffusers


def test_non_built_in_t2v_checkpoint_equals_wan_pipeline(t2v_dir: Path, tmp_path: Path) -> None:
    card = derive_card(t2v_dir)
    fv = _fv_video(t2v_dir, tmp_path)
    pipe = reference_pipeline(t2v_dir)
    assert type(pipe.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler" and pipe.scheduler.config.shift == 7.0
    _assert_equal_within_tolerance(card, fv, _reference(pipe, card))
    # The comparison can fail: another seed is another video, far beyond the tolerance.
    assert (fv - _reference(pipe, card, seed=SEED + 1)).abs().max() > 50 * _tolerance(card)


def test_two_expert_checkpoint_equals_wan_pipeline(experts_dir: Path, tmp_path: Path) -> None:
    card = derive_card(experts_dir)
    assert card.loops["denoise"].config == {"boundary_ratio": 0.9} and "transformer_2" in card.components
    assert card.loops["denoise"].sampler.config["solver_order"] == 3
    fv = _fv_video(experts_dir, tmp_path)
    pipe = reference_pipeline(experts_dir)
    calls = {"transformer": 0, "transformer_2": 0}
    for name in calls:
        getattr(pipe, name).register_forward_pre_hook(lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
    reference = _reference(pipe, card)
    assert calls["transformer"] > 0 and calls["transformer_2"] > 0, calls  # both experts ran
    _assert_equal_within_tolerance(card, fv, reference)


def test_image_to_video_checkpoint_equals_wan_i2v_pipeline(i2v_dir: Path, tmp_path: Path, condition_image: Any) -> None:
    card = derive_card(i2v_dir)
    assert card.capabilities.tasks == {I2V} and card.components["image_encoder"].config == {"hidden_size": 20}
    assert card.parity.reference == "diffusers==0.42.1:WanImageToVideoPipeline"
    d = card.capabilities.defaults
    image, _ = condition_image(d.height, d.width, 3)
    image.save(tmp_path / "cond.png")
    fv = _fv_video(i2v_dir, tmp_path, "--image", str(tmp_path / "cond.png"))
    pipe = reference_pipeline(i2v_dir)
    assert type(pipe).__name__ == "WanImageToVideoPipeline" and pipe.image_processor is not None
    _assert_equal_within_tolerance(card, fv, _reference(pipe, card, image=image))


def test_image_to_video_experts_without_clip_equal_wan_i2v_pipeline(i2v_experts_dir: Path, tmp_path: Path, condition_image: Any) -> None:
    card = derive_card(i2v_experts_dir)
    assert card.capabilities.tasks == {I2V} and "image_encoder" not in card.components
    assert card.loops["denoise"].config == {"boundary_ratio": 0.9, "i2v_mode": "concat"}
    d = card.capabilities.defaults
    image, _ = condition_image(d.height, d.width, 3)
    image.save(tmp_path / "cond.png")
    fv = _fv_video(i2v_experts_dir, tmp_path, "--image", str(tmp_path / "cond.png"))
    pipe = reference_pipeline(i2v_experts_dir)
    assert pipe.image_encoder is None and pipe.transformer_2 is not None
    _assert_equal_within_tolerance(card, fv, _reference(pipe, card, image=image))


def test_ti2v_checkpoint_runs_image_to_video_as_the_expand_timesteps_pipeline(ti2v_dir: Path, tmp_path: Path, condition_image: Any) -> None:
    card = derive_card(ti2v_dir)
    # A WanPipeline with expand_timesteps is a TI2V checkpoint: WanImageToVideoPipeline(expand_timesteps=True)
    # runs image-to-video from the same folder, so the card offers it too.
    assert card.capabilities.tasks == {T2V, T2I, I2V} and card.loops["denoise"].config == {"expand_timesteps": True, "i2v_mode": "first_frame"}
    d = card.capabilities.defaults
    assert (d.height, d.width) == (128, 192)  # the Wan 2.2 VAE's 16x times the patch 2
    image, _ = condition_image(d.height, d.width, 3)
    image.save(tmp_path / "cond.png")
    fv = _fv_video(ti2v_dir, tmp_path, "--image", str(tmp_path / "cond.png"))
    loaded = reference_pipeline(ti2v_dir)
    pipe = WanImageToVideoPipeline(**loaded.components, expand_timesteps=True)
    pipe.set_progress_bar_config(disable=True)
    _assert_equal_within_tolerance(card, fv, _reference(pipe, card, image=image))


def test_original_layout_transformer_folder_equals_the_diffusers_layout(t2v_dir: Path, tmp_path: Path) -> None:
    """The same weights in the original Wan release's layout (config names and weight names) run the same video."""
    root = tmp_path / "original"
    shutil.copytree(t2v_dir, root)
    to_original_layout(root / "transformer")
    card = derive_card(root)
    assert "original Wan layout" in card.summary
    assert WanTransformerConfig.from_diffusers_config(card.components["transformer"].config).num_layers == 3
    fv = _fv_video(root, tmp_path)
    reference = _reference(reference_pipeline(t2v_dir), derive_card(t2v_dir))
    _assert_equal_within_tolerance(card, fv, reference)
    # Original-layout settings fv-wan does not run are named.
    config_file = root / "transformer" / "config.json"
    original = config_file.read_text()
    for changes, fragment in (({"model_type": "flf2v"}, "model_type=\"flf2v\" is not supported; allowed: t2v, i2v, ti2v"),
                              ({"window_size": [256, 256]}, "window_size=[256, 256] is not supported (local attention)")):
        config_file.write_text(original)
        _edit(config_file, **changes)
        with pytest.raises(WanCheckpointError, match=re.escape(fragment)):
            derive_card(root)


# --------------------------------------------------------------------------- what is refused, and how


def _copy(source: Path, tmp_path: Path, name: str = "ckpt") -> Path:
    root = tmp_path / name
    shutil.copytree(source, root)
    return root


def _edit(file: Path, **changes: Any) -> None:
    data = json.loads(file.read_text())
    for key, value in changes.items():
        if value is _DELETE:
            data.pop(key)
        else:
            data[key] = value
    file.write_text(json.dumps(data))


_DELETE = object()
_SCHED = "scheduler/scheduler_config.json"

#: (case, file to edit, changes, fragments of the one error line)
REFUSED = [
    ("euler dynamic shifting", _SCHED, {"use_dynamic_shifting": True},
     [f"{_SCHED}: use_dynamic_shifting=true is not supported", "allowed: False"]),
    ("euler unknown field", _SCHED, {"karras_rho": 7.0}, [f"{_SCHED}: karras_rho=7.0 is not supported", "FlowMatchEulerDiscreteScheduler"]),
    ("euler train steps", _SCHED, {"num_train_timesteps": 500}, ["num_train_timesteps=500 is not supported", "allowed: 1000"]),
    ("another scheduler class", _SCHED, {"_class_name": "DDIMScheduler"}, ["_class_name=\"DDIMScheduler\" is not supported"]),
    ("transformer qk_norm", "transformer/config.json", {"qk_norm": "rms_norm"},
     ["transformer/config.json: qk_norm=\"rms_norm\" is not supported", "rms_norm_across_heads"]),
    ("transformer num_layers", "transformer/config.json", {"num_layers": "two"},
     ["transformer/config.json: num_layers=\"two\" is not supported", "valid integer"]),
    ("transformer unknown field", "transformer/config.json", {"sliding_window": 8},
     ["transformer/config.json: sliding_window=8 is not supported (not a WanTransformer3DModel field)"]),
    ("temporal patch", "transformer/config.json", {"patch_size": [2, 2, 2]}, ["patch_size=[2, 2, 2] is not supported", "allowed: [1, p, p]"]),
    ("text width", "text_encoder/config.json", {"d_model": 64},
     ["text_encoder/config.json: d_model=64 is not supported (transformer/config.json has text_dim 48)", "allowed: 48"]),
    ("vae field", "vae/config.json", {"z_dim": "big"}, ["vae/config.json: z_dim=\"big\" is not supported"]),
    ("pipeline class", "model_index.json", {"_class_name": "WanVACEPipeline"},
     ["model_index.json: _class_name=\"WanVACEPipeline\" is not supported", "allowed: WanImageToVideoPipeline, WanPipeline"]),
    ("component class", "model_index.json", {"text_encoder": ["transformers", "T5EncoderModel"]},
     ["model_index.json: text_encoder=[\"transformers\", \"T5EncoderModel\"] is not supported", "UMT5EncoderModel"]),
    ("boundary without expert", "model_index.json", {"boundary_ratio": 0.9}, ["boundary_ratio=0.9 is not supported", "transformer_2, which is null"]),
]


@pytest.mark.parametrize("case, file, changes, fragments", REFUSED, ids=[c[0] for c in REFUSED])
def test_unsupported_config_is_one_line_naming_file_field_and_value(
    case: str, file: str, changes: dict[str, Any], fragments: list[str], t2v_dir: Path, tmp_path: Path
) -> None:
    root = _copy(t2v_dir, tmp_path)
    _edit(root / file, **changes)
    out = tmp_path / "never.pt"
    result = _generate(root, out)
    assert result.exit_code == 2, f"{case}: {result.output}"
    lines = [l for l in result.output.splitlines() if l.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    assert lines[0].startswith(f"error: model: {root}/")
    for fragment in fragments:
        assert fragment in lines[0], f"{case}: {fragment!r} not in {lines[0]!r}"
    assert not out.exists()
    with pytest.raises(WanCheckpointError):  # the typed error, also from Python
        derive_card(root)


#: (case, fixture, file, changes, fragment of the typed error) -- checked from Python (no CLI start-up per case).
REFUSED_FROM_PYTHON = [
    ("out_channels vs z_dim", "t2v_dir", "transformer/config.json", {"out_channels": 8},
     "out_channels=8 is not supported (the VAE's z_dim is 16); allowed: 16"),
    ("t2v in_channels", "t2v_dir", "transformer/config.json", {"in_channels": 36},
     "in_channels=36 is not supported (WanPipeline feeds the noisy latent); allowed: 16"),
    ("image_dim without an encoder", "t2v_dir", "transformer/config.json", {"image_dim": 20, "added_kv_proj_dim": 24},
     "image_dim=20 is not supported (the checkpoint has no image_encoder to feed it)"),
    ("first-last-frame", "t2v_dir", "transformer/config.json", {"pos_embed_seq_len": 514, "image_dim": 20, "added_kv_proj_dim": 24},
     "pos_embed_seq_len=514 is not supported (first-last-frame checkpoints"),
    ("image encoder width", "i2v_dir", "image_encoder/config.json", {"hidden_size": 16},
     "image_encoder/config.json: hidden_size=16 is not supported (transformer/config.json has image_dim 20); allowed: 20"),
    ("i2v in_channels", "i2v_dir", "transformer/config.json", {"in_channels": 16},
     "in_channels=16 is not supported (WanImageToVideoPipeline feeds noise + 4-channel frame mask + image latent); allowed: 36"),
    ("i2v VAE not 4x in time", "i2v_dir", "vae/config.json", {"temperal_downsample": [False, True, False], "scale_factor_temporal": None},
     "temperal_downsample=[false, true, false] is not supported (the image-to-video frame mask groups 4 frames"),
    ("experts disagree", "experts_dir", "transformer_2/config.json", {"text_dim": 32},
     "transformer_2/config.json: text_dim=32 is not supported (transformer/config.json has 48"),
    ("boundary out of range", "experts_dir", "model_index.json", {"boundary_ratio": 1.5},
     "boundary_ratio=1.5 is not supported; allowed: a number in (0, 1), or null"),
]


@pytest.mark.parametrize("case, fixture, file, changes, fragment", REFUSED_FROM_PYTHON, ids=[c[0] for c in REFUSED_FROM_PYTHON])
def test_inconsistent_checkpoints_are_refused_naming_the_field(
    case: str, fixture: str, file: str, changes: dict[str, Any], fragment: str, request: Any, tmp_path: Path
) -> None:
    root = _copy(request.getfixturevalue(fixture), tmp_path)
    _edit(root / file, **changes)
    with pytest.raises(WanCheckpointError) as info:
        derive_card(root)
    assert fragment in info.value.message and info.value.param == "model", info.value.message


def _bad_value(wanted: Any) -> Any:
    if isinstance(wanted, bool):
        return not wanted
    if wanted is None:
        return 1.0
    if isinstance(wanted, int):
        return 500
    return "something-else"


def test_every_scheduler_setting_fv_does_not_reproduce_is_refused(t2v_dir: Path, experts_dir: Path, tmp_path: Path) -> None:
    """Each field the samplers require a value for, set to another value, is named (Euler and UniPC tables)."""
    from fv_wan.derive import _SCHEDULERS

    for scheduler_class, source in (("FlowMatchEulerDiscreteScheduler", t2v_dir), ("UniPCMultistepScheduler", experts_dir)):
        required = _SCHEDULERS[scheduler_class][1]
        root = _copy(source, tmp_path, scheduler_class)
        original = (root / _SCHED).read_text()
        assert json.loads(original)["_class_name"] == scheduler_class
        for field, (_, wanted) in required.items():
            (root / _SCHED).write_text(original)
            _edit(root / _SCHED, **{field: _bad_value(wanted)})
            with pytest.raises(WanCheckpointError) as info:
                derive_card(root)
            assert f"{field}={json.dumps(_bad_value(wanted))} is not supported" in info.value.message, (field, info.value.message)


def test_unipc_options_fv_does_not_run_are_named(experts_dir: Path, tmp_path: Path) -> None:
    root = _copy(experts_dir, tmp_path)
    scheduler = root / _SCHED
    cases = [
        ({"thresholding": True}, "thresholding=true is not supported; allowed: False"),
        ({"use_karras_sigmas": True}, "use_karras_sigmas=true is not supported"),
        ({"prediction_type": _DELETE},
         "prediction_type=\"epsilon\" is not supported (diffusers' default; the file does not set it); allowed: flow_prediction"),
        ({"solver_order": 4}, "solver_order=4 is not supported"),
    ]
    original = scheduler.read_text()
    for changes, fragment in cases:
        scheduler.write_text(original)
        _edit(scheduler, **changes)
        with pytest.raises(WanCheckpointError) as info:
            derive_card(root)
        assert fragment in info.value.message and str(scheduler) in info.value.message, info.value.message


def test_missing_files_are_named(t2v_dir: Path, tmp_path: Path) -> None:
    cases = [
        ("transformer/config.json", "not a complete Wan checkpoint: transformer/config.json is missing"),
        ("transformer/diffusion_pytorch_model.safetensors", "transformer/ has no *.safetensors weights"),
        ("scheduler/scheduler_config.json", "scheduler/scheduler_config.json is missing"),
        ("tokenizer", "tokenizer/tokenizer_config.json is missing"),
        ("text_encoder/model.safetensors", "text_encoder/ has no weights"),
        ("model_index.json", "not a complete Wan checkpoint: model_index.json is missing"),
    ]
    for index, (remove, fragment) in enumerate(cases):
        root = _copy(t2v_dir, tmp_path, f"missing-{index}")
        target = root / remove
        shutil.rmtree(target) if target.is_dir() else target.unlink()
        out = tmp_path / "never.pt"
        result = _generate(root, out)
        assert result.exit_code == 2 and not out.exists(), result.output
        (line,) = [l for l in result.output.splitlines() if l.startswith("error:")]
        assert line == f"error: model: {root}: {fragment}" or (line.startswith(f"error: model: {root}:") and fragment in line), line


def test_paths_that_are_not_checkpoints_say_what_they_are(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    other = tmp_path / "other-pipeline"
    other.mkdir()
    (other / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    (tmp_path / "notes.txt").write_text("hello")
    cases = [
        (str(tmp_path / "no" / "such" / "dir"), f"error: model: no such file or directory: '{tmp_path}/no/such/dir'"),
        (str(tmp_path / "empty"), "is a directory but not a checkpoint: it has no model_index.json"),
        (str(other), "is a diffusers-layout checkpoint of pipeline 'FluxPipeline', which no installed plugin serves"),
        (str(tmp_path / "notes.txt"), "is a file but not a card file"),
        (str(tmp_path / "card.json"), f"error: model: no such card file: '{tmp_path}/card.json'"),
    ]
    for model, fragment in cases:
        out = tmp_path / "never.pt"
        result = CliRunner().invoke(app, ["generate", "--quiet", "--model", model, "--prompt", PROMPT, "--output", str(out)])
        assert result.exit_code == 2 and not out.exists(), result.output
        lines = [l for l in result.output.splitlines() if l.startswith("error:")]
        assert len(lines) == 1 and fragment in lines[0] and "Traceback" not in result.output, (model, result.output)


def test_the_examples_in_docs_models_wan_md_run_as_written(t2v_dir: Path, experts_dir: Path, tmp_path: Path) -> None:
    derived, refused = doc_blocks(REPO / "docs" / "models" / "wan.md", "plugins/fv-wan/tests/test_any_checkpoint.py")
    shutil.copytree(t2v_dir, tmp_path / "my-wan-checkpoint")
    run_doc_block(derived, tmp_path)
    assert torch.load(tmp_path / "fox.pt").shape == (9, 3, 64, 96) and (tmp_path / "fox4.mp4").stat().st_size > 0
    thresholded = _copy(experts_dir, tmp_path, "my-wan-checkpoint-thresholded")
    _edit(thresholded / _SCHED, thresholding=True)
    (_copy(t2v_dir, tmp_path, "my-wan-checkpoint-no-transformer-config") / "transformer" / "config.json").unlink()
    run_doc_block(refused, tmp_path)
    assert not (tmp_path / "x.mp4").exists()
