"""A Wan transformer from one file of its own (``component_sources``: ComfyUI's diffusion_models files).

The file is ComfyUI's single-file layout (original Wan names under ``model.diffusion_model.``, e4m3
weights with ``scale_weight``, no ``config.json`` beside it), written by the fp8 checkpoint tests'
own writer. It must load as the same layers as the folder that holds it, with the card's config,
while the card's other components stay seeded; and a file of another model is a typed error."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from fv_wan.instance import load_transformer
from safetensors.torch import load_file, save_file
from test_precision_fp8_checkpoints import CARD, _inputs, _native, _original, _write
from typer.testing import CliRunner

from fv_kernel.api import (
    CheckpointNotFound,
    Fp8Linear,
    InstanceOptions,
    InvalidRequest,
    build_instance,
    load,
    preflight,
)


def _file(tmp_path: Path, card) -> Path:
    """wan-tiny's transformer as ComfyUI's ``*_fp8_scaled.safetensors`` file, alone in a folder."""
    root, _ = _write(tmp_path / "written", card, "scaled_fp8")
    folder = tmp_path / "diffusion_models"
    folder.mkdir()
    target = folder / "wan2.1_t2v_tiny_fp8_scaled.safetensors"
    shutil.move(root / "transformer" / "wan_tiny_fp8.safetensors", target)
    return target


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("path", ["fp8_weights", "native"])
def test_a_single_file_loads_as_the_folder_that_holds_it(tmp_path, wan_card, path) -> None:
    card = wan_card(CARD)
    file = _file(tmp_path, card)
    from_file = load_transformer(card, "transformer", InstanceOptions(precision="fp32", component_sources={"transformer": file}),
                                 precision_path=path)
    # The same bytes in a checkpoint folder, with the config.json the file lacks.
    root, _ = _write(tmp_path / "folder", card, "scaled_fp8")
    from_folder = load_transformer(card, "transformer", InstanceOptions(precision="fp32", source=str(root)), precision_path=path)
    assert (path == "fp8_weights") == any(isinstance(m, Fp8Linear) for m in from_file.modules())
    got, want = _state(from_file), _state(from_folder)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    with torch.no_grad():
        assert torch.equal(from_file(*_inputs(from_file)), from_folder(*_inputs(from_folder)))


def test_the_instance_loads_the_file_and_keeps_the_other_components_seeded(tmp_path, wan_card) -> None:
    card = wan_card(CARD)
    file = _file(tmp_path, card)
    options = InstanceOptions(precision="fp32", precision_path="fp8_weights", component_sources={"transformer": file})
    instance = build_instance(card, options)
    seeded = build_instance(card, InstanceOptions(precision="fp32", precision_path="fp8_weights"))
    stored = load_file(str(file))
    layer = instance.component("transformer").blocks[0].attn1.to_q
    assert torch.equal(layer.weight.view(torch.uint8), stored[_original("blocks.0.attn1.to_q.weight")].view(torch.uint8))
    # Negative control: without the source the seeded transformer runs, which is other weights.
    assert not torch.equal(seeded.component("transformer").blocks[0].attn1.to_q.weight.float(), layer.weight.float())
    for other in ("vae_decoder", "text_encoder"):  # the card's own (seeded) components, untouched
        a, b = instance.component(other).state_dict(), seeded.component(other).state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a)
    # The file is part of the weights' identity: caches and captured graphs never mix the two.
    assert instance.weights_version.startswith(seeded.weights_version + "+transformer=wan2.1_t2v_tiny_fp8_scaled.safetensors@")
    before = instance.weights_version
    os.utime(file, ns=(1, 1))  # the file rewritten (another modification time): another version
    assert build_instance(card, options).weights_version != before


def test_the_preflight_charges_the_files_fp8_weights_at_one_byte(tmp_path, wan_card) -> None:
    card = wan_card(CARD)
    file = _file(tmp_path, card)
    report = preflight(card, InstanceOptions(precision="fp32", component_sources={"transformer": file}))
    stored = load_file(str(file))
    fp8 = sum(t.numel() for t in stored.values() if t.dtype == torch.float8_e4m3fn)
    charged = {(c.component_id, c.precision): c.elements for c in report.components}
    assert charged[("transformer", "fp8_e4m3")] == fp8
    plain = preflight(card, InstanceOptions(precision="fp32"))
    assert [c for c in report.components if c.component_id != "transformer"] == \
        [c for c in plain.components if c.component_id != "transformer"]


def test_a_file_of_another_model_is_a_typed_error_naming_the_tensor(tmp_path, wan_card) -> None:
    card = wan_card(CARD)
    native = _native(card)
    wider = {_original(k): torch.cat([v, v], dim=0) if k == "blocks.0.attn1.to_q.weight" else v for k, v in native.items()}
    file = tmp_path / "other.safetensors"
    save_file({k: v.contiguous() for k, v in wider.items()}, str(file))
    width = native["blocks.0.attn1.to_q.weight"].shape[1]
    with pytest.raises(CheckpointNotFound, match=rf"^component_sources.transformer: .*blocks.0.attn1.to_q.weight is "
                                                 rf"\[{2 * width}, {width}\], the card's is \[{width}, {width}\]$") as caught:
        load_transformer(card, "transformer", InstanceOptions(component_sources={"transformer": file}))
    assert caught.value.param == "component_sources.transformer"
    truncated = tmp_path / "truncated.safetensors"
    save_file({k: v.contiguous() for k, v in list(native.items())[:-3]}, str(truncated))
    from fv_kernel.api import CheckpointKeyError

    with pytest.raises(CheckpointKeyError):
        load_transformer(card, "transformer", InstanceOptions(component_sources={"transformer": truncated}))


def test_only_the_transformers_take_a_file(tmp_path, wan_card) -> None:
    card = wan_card(CARD)
    file = _file(tmp_path, card)
    with pytest.raises(InvalidRequest, match=r"component_sources.vae_decoder: .*allowed: transformer$"):
        build_instance(card, InstanceOptions(component_sources={"vae_decoder": file}))
    a14b = wan_card("wan-tiny-a14b")
    assert sorted(c for c, e in a14b.checkpoint.components.items() if e.single_file) == ["transformer", "transformer_2"]


def test_fv_generate_and_fv_load_run_the_file(tmp_path, wan_card) -> None:
    from fv_kernel.cli.app import app

    card = wan_card(CARD)
    file = _file(tmp_path, card)
    out = tmp_path / "a.mp4"
    result = CliRunner().invoke(app, ["generate", "--model", CARD, "--prompt", "a red ball", "--steps", "2", "-q",
                                      "--component-source", f"transformer={file}", "-o", str(out)])
    assert result.exit_code == 0, result.output
    generator = load(CARD, component_sources={"transformer": file})
    assert generator.instance.options.component_sources == {"transformer": file}
    frames = generator.generate("a red ball", steps=2).frames
    assert not torch.equal(frames, load(CARD).generate("a red ball", steps=2).frames)
    bad = CliRunner().invoke(app, ["generate", "--model", CARD, "--prompt", "x", "--component-source",
                                   f"text_encoder={file}", "-o", str(out)])
    assert bad.exit_code == 2 and "component_sources.text_encoder" in bad.output and "allowed: transformer" in bad.output
