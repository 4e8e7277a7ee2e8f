"""Loading from disk: the diffusers layout (transformer/, vae/, sound_tokenizer/) and the unified
layout's transformers-style reasoner names both load into the resident instance; the plugin maps a
local diffusers checkpoint folder to its card."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from fv_cosmos3.cards import cosmos3_card
from fv_cosmos3.models import to_transformers_reasoner_state_dict
from fv_cosmos3.models.state_dict import is_generator_key
from fv_cosmos3.plugin import fv_resolve_model_source
from fv_kernel.api import CheckpointKeyError, InstanceOptions, TaskType, build_instance


def _write(folder, tensors, config=None):
    folder.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "diffusion_pytorch_model.safetensors"))
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("reasoner_names", ["diffusers", "transformers"])
def test_diffusers_layout_loads_into_instance(tmp_path, reasoner_names):
    seeded = build_instance(cosmos3_card("cosmos3-tiny"))
    seeded.load_for_task(TaskType.TEXT_TO_VIDEO_AUDIO)
    mot_state = seeded.component("transformer").state_dict()
    if reasoner_names == "transformers":
        # The unified checkpoint's reasoner as transformers names it, plus the generator tower.
        generator = {k: v for k, v in mot_state.items() if is_generator_key(k)}
        mot_state = {**to_transformers_reasoner_state_dict(mot_state), **generator}
    _write(tmp_path / "transformer", mot_state, {"_class_name": "Cosmos3OmniTransformer", "hidden_size": 48})
    _write(tmp_path / "vae", seeded.component("vae").state_dict())
    sound = dict(seeded.component("sound_decoder").state_dict())
    _write(tmp_path / "sound_tokenizer", {**sound, "encoder.stem.weight": torch.zeros(2)})
    card = cosmos3_card("cosmos3-tiny")
    # The tiny card's byte tokenizer is built in (no files): no text_tokenizer/ folder to check for.
    on_disk = card.model_copy(update={"checkpoint": card.checkpoint.model_copy(update={
        "layout": "diffusers",
        "components": {
            k: c.model_copy(update={"random_init_seed": None, **({"subfolder": ""} if k == "tokenizer" else {})})
            for k, c in card.checkpoint.components.items()
        },
    })})
    loaded = build_instance(on_disk, InstanceOptions(source=str(tmp_path)))
    loaded.load_for_task(TaskType.TEXT_TO_VIDEO_AUDIO)
    for name in ("transformer", "vae", "sound_decoder"):
        ours, ref = loaded.component(name).state_dict(), seeded.component(name).state_dict()
        assert ours.keys() == ref.keys()
        assert all(torch.equal(ours[k], ref[k]) for k in ref), name
    assert loaded.weights_version.startswith("source:")


def test_missing_keys_are_named(tmp_path):
    seeded = build_instance(cosmos3_card("cosmos3-tiny"))
    state = dict(seeded.component("transformer").state_dict())
    del state["proj_out.bias"]
    _write(tmp_path / "transformer", state)
    card = cosmos3_card("cosmos3-tiny")
    on_disk = card.model_copy(update={"checkpoint": card.checkpoint.model_copy(update={
        "components": {k: c.model_copy(update={"random_init_seed": None}) for k, c in card.checkpoint.components.items()},
    })})
    with pytest.raises(CheckpointKeyError, match="proj_out.bias"):
        build_instance(on_disk, InstanceOptions(source=str(tmp_path))).component("transformer")


def test_resolve_model_source(tmp_path):
    assert fv_resolve_model_source(str(tmp_path)) is None
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text(json.dumps({"_class_name": "Cosmos3OmniTransformer", "hidden_size": 5120}))
    assert fv_resolve_model_source(str(tmp_path)) == "cosmos3-super"
