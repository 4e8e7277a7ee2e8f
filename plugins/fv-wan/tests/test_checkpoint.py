"""Checkpoint loading: a diffusers-saved Wan checkpoint round-trips through fv's loader and reproduces
WanPipeline's output for the same seed (seed parity through ``fv generate``); sharded weights load;
bad keys and unreachable sources give the kernel's typed errors.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers import WanPipeline
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from fv_kernel.api import CheckpointKeyError, CheckpointNotFound, InstanceOptions, TaskType, build_instance
from fv_kernel.cli.app import app
from fv_kernel.runtime.local import run_local
from fv_wan.models.tokenizer import ByteTokenizer
from tiny_wan_checkpoints import byte_level_hf_tokenizer, diffusers_model, to_original_layout

SEED = 1234
PROMPT = "a red fox runs through fresh snow"


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory, wan_card, reference_modules, unipc_scheduler) -> Path:
    """``wan-tiny``'s weights written by ``WanPipeline.save_pretrained`` (diffusers layout, single shards)."""
    card = wan_card("wan-tiny")
    instance = build_instance(card)
    instance.load_for_task(TaskType.TEXT_TO_VIDEO)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # the VAE encoder half (unused by T2V) is diffusers' init: make it deterministic
        ref = reference_modules(instance)
    tokenizer = byte_level_hf_tokenizer()
    probe = ["a red fox é", ""]
    assert torch.equal(tokenizer(probe, padding="max_length", max_length=24, return_tensors="pt").input_ids,
                       ByteTokenizer()(probe, max_length=24).input_ids)
    pipe = WanPipeline(
        tokenizer=tokenizer, text_encoder=ref["text_encoder"], vae=ref["vae"],
        scheduler=unipc_scheduler(card.capabilities.defaults.shift), transformer=ref["transformer"],
    )
    root = tmp_path_factory.mktemp("wan-tiny-diffusers")
    pipe.save_pretrained(root, safe_serialization=True)
    return root


def _generate(args: list[str]) -> Any:
    return CliRunner().invoke(app, ["generate", "--quiet", *args])


def _reference_video(root: Path, seed: int) -> torch.Tensor:
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    # Everything else (text encoder, tokenizer, scheduler and its flow_shift) comes from the directory.
    pipe = WanPipeline.from_pretrained(
        root, transformer=diffusers_model(WanTransformer3DModel, root / "transformer"),
        vae=diffusers_model(AutoencoderKLWan, root / "vae"),
    )
    pipe.set_progress_bar_config(disable=True)
    d = _defaults()
    out = pipe(
        prompt=PROMPT, height=d.height, width=d.width, num_frames=d.frames, num_inference_steps=d.steps,
        guidance_scale=d.guidance, generator=torch.Generator().manual_seed(seed), output_type="pt",
    ).frames
    return out[0]


def _defaults() -> Any:
    from fv_wan.cards import wan_cards

    (card,) = [c for c in wan_cards() if c.model_id == "wan-tiny"]
    return card.capabilities.defaults


def test_layout_is_diffusers_save_pretrained(saved_checkpoint: Path) -> None:
    index = json.loads((saved_checkpoint / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline"
    for folder in ("transformer", "vae", "text_encoder", "tokenizer", "scheduler"):
        assert (saved_checkpoint / folder).is_dir(), folder
    assert (saved_checkpoint / "transformer" / "diffusion_pytorch_model.safetensors").is_file()


def test_fv_generate_on_saved_dir_equals_wan_pipeline_for_the_seed(saved_checkpoint: Path, tmp_path: Path, wan_card) -> None:
    out = tmp_path / "x.pt"
    result = _generate(["--model", str(saved_checkpoint), "--prompt", PROMPT, "--seed", str(SEED), "--output", str(out)])
    assert result.exit_code == 0, result.output
    fv = torch.load(out)
    d = _defaults()
    # .pt is float32 (frames, 3, H, W) in [0, 1].
    assert fv.dtype == torch.float32 and fv.shape == (d.frames, 3, d.height, d.width)
    assert 0.0 <= fv.min() and fv.max() <= 1.0
    reference = _reference_video(saved_checkpoint, SEED)
    tolerance = next(t.value for t in wan_card("wan-tiny").parity.tolerances if t.name == "loop_vs_diffusers")
    assert (fv - reference).abs().max().item() <= tolerance
    # The seed is what fixes the video: another seed is another video.
    assert (fv - _reference_video(saved_checkpoint, SEED + 1)).abs().max().item() > 50 * tolerance


def test_loaded_checkpoint_reproduces_the_embedded_card(saved_checkpoint: Path, wan_card, fv_request) -> None:
    """The directory was written from wan-tiny's seeded weights, so loading it is exactly wan-tiny."""
    card = wan_card("wan-tiny")
    request = fv_request(card, PROMPT, seed=SEED)
    loaded = build_instance(card, InstanceOptions(source=str(saved_checkpoint)))
    (from_disk,) = run_local(request, loaded)
    (embedded,) = run_local(request, build_instance(card))
    assert loaded.weights_version != build_instance(card).weights_version  # feature-cache keys differ
    for name, module in loaded.components.items():
        seeded = build_instance(card).component(name).state_dict()
        assert all(torch.equal(t, seeded[k]) for k, t in module.state_dict().items()), name
    # Equal weights, yet not bit-equal frames: safetensors hands back CPU tensors at unaligned addresses
    # (views into the file), and oneDNN picks other matmul kernels for them (~6e-7 per forward).
    tolerance = next(t.value for t in card.parity.tolerances if t.name == "loop_vs_diffusers")
    assert (from_disk.frames - embedded.frames).abs().max().item() <= tolerance
    # Lazy, per task: text-to-video never loaded the VAE encoder.
    assert set(loaded.components) == {"transformer", "vae_decoder", "text_encoder"}
    assert loaded.components["vae_decoder"].encoder is None


def test_sharded_transformer_loads_through_its_index(saved_checkpoint: Path, tmp_path: Path, wan_card, fv_request) -> None:
    from diffusers import WanTransformer3DModel

    root = tmp_path / "sharded"
    shutil.copytree(saved_checkpoint, root)
    shutil.rmtree(root / "transformer")
    diffusers_model(WanTransformer3DModel, saved_checkpoint / "transformer").save_pretrained(
        root / "transformer", max_shard_size="40KB", safe_serialization=True
    )
    index = json.loads((root / "transformer" / "diffusion_pytorch_model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # really sharded
    card = wan_card("wan-tiny")
    request = fv_request(card, PROMPT, seed=SEED)
    (sharded,) = run_local(request, build_instance(card, InstanceOptions(source=str(root))))
    (single,) = run_local(request, build_instance(card, InstanceOptions(source=str(saved_checkpoint))))
    tolerance = next(t.value for t in card.parity.tolerances if t.name == "loop_vs_diffusers")
    assert (sharded.frames - single.frames).abs().max().item() <= tolerance


def test_missing_and_unexpected_keys_are_named(saved_checkpoint: Path, tmp_path: Path, wan_card) -> None:
    root = tmp_path / "bad-keys"
    shutil.copytree(saved_checkpoint, root)
    weights = root / "transformer" / "diffusion_pytorch_model.safetensors"
    state = load_file(weights)
    state.pop("blocks.1.ffn.net.2.weight")
    state["blocks.1.ffn.extra.weight"] = torch.zeros(2)
    save_file(state, weights)
    instance = build_instance(wan_card("wan-tiny"), InstanceOptions(source=str(root)))
    with pytest.raises(CheckpointKeyError) as info:
        instance.load_for_task(TaskType.TEXT_TO_VIDEO)
    assert info.value.missing == ["blocks.1.ffn.net.2.weight"]
    assert info.value.unexpected == ["blocks.1.ffn.extra.weight"]
    assert "blocks.1.ffn.net.2.weight" in str(info.value) and "blocks.1.ffn.extra.weight" in str(info.value)
    # Through the CLI: one line naming them, exit 2, no file.
    out = tmp_path / "never.mp4"
    result = _generate(["--model", str(root), "--prompt", PROMPT, "--output", str(out)])
    assert result.exit_code == 2 and not out.exists()
    (line,) = [l for l in result.output.splitlines() if l.startswith("error:")]
    assert "missing key(s): blocks.1.ffn.net.2.weight" in line and "unexpected key(s): blocks.1.ffn.extra.weight" in line


def test_vae_key_mismatch_is_named(saved_checkpoint: Path, tmp_path: Path, wan_card) -> None:
    root = tmp_path / "bad-vae"
    shutil.copytree(saved_checkpoint, root)
    weights = root / "vae" / "diffusion_pytorch_model.safetensors"
    state = load_file(weights)
    state.pop("post_quant_conv.bias")
    save_file(state, weights)
    with pytest.raises(CheckpointKeyError, match="post_quant_conv.bias"):
        build_instance(wan_card("wan-tiny"), InstanceOptions(source=str(root))).load_for_task(TaskType.TEXT_TO_VIDEO)


def test_hub_id_offline_and_not_cached_is_checkpoint_not_found(monkeypatch, tmp_path: Path, wan_card) -> None:
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))
    instance = build_instance(wan_card("wan-tiny"), InstanceOptions(source="fv-tests/no-such-wan-checkpoint"))
    with pytest.raises(CheckpointNotFound) as info:
        instance.load_for_task(TaskType.TEXT_TO_VIDEO)
    message = str(info.value)
    assert "fv-tests/no-such-wan-checkpoint" in message and "offline" in message
    assert info.value.param == "model"
    # A real card whose hub repo is not cached fails the same way, before any weights are allocated.
    out = tmp_path / "never.mp4"
    result = _generate(["--model", "wan2.1-t2v-1.3b", "--prompt", PROMPT, "--output", str(out)])
    assert result.exit_code == 2 and not out.exists()
    assert "Wan-AI/Wan2.1-T2V-1.3B-Diffusers" in result.output and "offline" in result.output


def test_config_of_another_architecture_is_refused(saved_checkpoint: Path, tmp_path: Path, wan_card) -> None:
    root = tmp_path / "other-arch"
    shutil.copytree(saved_checkpoint, root)
    config_file = root / "transformer" / "config.json"
    config = json.loads(config_file.read_text())
    config["num_layers"] = 3
    config_file.write_text(json.dumps(config))
    with pytest.raises(CheckpointNotFound, match="wan-tiny"):
        build_instance(wan_card("wan-tiny"), InstanceOptions(source=str(root))).load_for_task(TaskType.TEXT_TO_VIDEO)
    # By path, no built-in card has that architecture, so a card is derived from the configs (3 layers):
    # the 2-layer weights do not fill it, and the missing keys are named in one line.
    result = _generate(["--model", str(root), "--prompt", PROMPT, "--output", str(tmp_path / "never.mp4")])
    assert result.exit_code == 2, result.output
    (line,) = [l for l in result.output.splitlines() if l.startswith("error:")]
    assert "component 'transformer'" in line and "missing key(s): blocks.2." in line


def test_original_wan_release_layout_loads_through_the_key_map(saved_checkpoint: Path, tmp_path: Path, wan_card, fv_request) -> None:
    """A transformer folder in the original release's layout (config and weight names) loads and matches."""
    root = tmp_path / "original"
    shutil.copytree(saved_checkpoint, root)
    folder = root / "transformer"
    # A ComfyUI-style prefix, and weights rounded through bf16 as releases ship.
    original = to_original_layout(folder, prefix="model.diffusion_model.", round_to=torch.bfloat16)
    card = wan_card("wan-tiny")
    request = fv_request(card, PROMPT, seed=SEED)
    # By path, the original config is recognised as wan-tiny's architecture...
    out = tmp_path / "orig.pt"
    result = _generate(["--model", str(root), "--prompt", PROMPT, "--seed", str(SEED), "--output", str(out)])
    assert result.exit_code == 0, result.output
    # ...and the renamed weights equal the diffusers-layout ones (rounded through bf16 here, as releases ship).
    rounded = build_instance(card, InstanceOptions(source=str(root)))
    rounded.load_for_task(TaskType.TEXT_TO_VIDEO)
    reference = load_file(saved_checkpoint / "transformer" / "diffusion_pytorch_model.safetensors")
    state = rounded.components["transformer"].state_dict()
    assert all(torch.equal(state[k], v.to(torch.bfloat16).float()) for k, v in reference.items())
    (expected,) = run_local(request, rounded)
    assert torch.equal(torch.load(out), expected.frames)
    # An unmapped original key is named.
    save_file({**original, "model.diffusion_model.blocks.0.mystery.weight": torch.zeros(1)}, folder / "wan2.1_tiny.safetensors")
    with pytest.raises(CheckpointNotFound, match="blocks.0.mystery.weight"):
        build_instance(card, InstanceOptions(source=str(root))).load_for_task(TaskType.TEXT_TO_VIDEO)
