"""LoraLoaderModelOnly / LoraLoader → the request's adapters: the LoRA folder, strengths, stacking,
per-expert routing on Wan 2.2 A14B, and the errors for files fv cannot use.

Files are tiny LoRAs these tests write (``lora_files``); the official template is
``fixtures/wan22_14B_t2v_lightx2v_lora.api.json`` (SOURCES.md)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from conftest import MODELS_FILE, load_api, load_pair, retarget
from fv_comfyui.compile import compile_prompt
from fv_comfyui.loras import LoraFolder, LoraLibrary, adapter_name, adapter_refs
from fv_comfyui.models import ModelMap
from fv_comfyui.nodes import object_info
from fv_comfyui.service import service_for
from lora_files import comfy_lora, text_encoder_weights

HIGH = "wan2.2_t2v_lightx2v_4steps_lora_v1.1_high_noise.safetensors"
LOW = "wan2.2_t2v_lightx2v_4steps_lora_v1.1_low_noise.safetensors"
WAN_FORMAT = "fv_wan.lora:convert_wan_lora"


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("loras")
    comfy_lora(root / HIGH, seed=1)
    comfy_lora(root / LOW, seed=2)
    comfy_lora(root / "style" / "ink.safetensors", seed=3)
    comfy_lora(root / "with_te.safetensors", seed=4, extra=text_encoder_weights(5))
    save_file({"text_encoder.encoder.block.0.layer.0.SelfAttention.q.lora_A.weight": torch.zeros(2, 32),
               "text_encoder.encoder.block.0.layer.0.SelfAttention.q.lora_B.weight": torch.zeros(32, 2)},
              str(root / "te_only.safetensors"))
    save_file({"diffusion_model.blocks.0.self_attn.q.lora_down.weight": torch.zeros(2, 24),
               "diffusion_model.blocks.0.self_attn.q.lora_up.weight": torch.zeros(24, 2),
               "some_vae.decoder.conv.lora_down.weight": torch.zeros(2, 24)}, str(root / "stray_keys.safetensors"))
    save_file({"transformer_2.blocks.0.attn1.to_q.lora_A.weight": torch.zeros(2, 24),
               "transformer_2.blocks.0.attn1.to_q.lora_B.weight": torch.zeros(24, 2)}, str(root / "low_expert_diffusers.safetensors"))
    (root / "garbage.safetensors").write_bytes(b"not a safetensors file")
    (root / "pickled.ckpt").write_bytes(b"never offered")
    return root


@pytest.fixture(scope="module")
def lora_service(host: Any, input_dir: Path, lora_dir: Path) -> Any:
    service = service_for(host, ModelMap.from_yaml(MODELS_FILE), input_dir, loras=lora_dir)
    # The cards read LoRA files with fv-wan's converter (the ComfyUI / original-Wan layouts).
    service.cards = {k: c.model_copy(update={"adapter_format": WAN_FORMAT}) for k, c in service.cards.items()}
    return service


def _template() -> dict[str, Any]:
    return retarget(load_api("wan22_14B_t2v_lightx2v_lora"))


def _t2v_with(*loras: tuple[str, str, dict[str, Any]]) -> dict[str, Any]:
    """The Wan 2.1 T2V fixture with LoRA nodes (id, class, inputs) chained between its UNETLoader (37) and ModelSamplingSD3 (48)."""
    prompt = retarget(load_pair("text_to_video_wan")[1])
    upstream = ["37", 0]
    for node_id, kind, inputs in loras:
        prompt[node_id] = {"class_type": kind, "inputs": {"model": upstream, **inputs}}
        upstream = [node_id, 0]
    prompt["48"]["inputs"]["model"] = upstream
    return prompt


def _error(answer: Any, node: str) -> tuple[str, str]:
    (error,) = answer.node_errors[node]["errors"]
    return error["type"], error["details"]


def test_the_official_lightx2v_template_puts_each_lora_on_its_expert(lora_service: Any) -> None:
    answer = lora_service.check(_template())
    assert answer.ok and answer.node_errors == {}, answer.body()
    (job,) = answer.jobs
    assert job.card.model_id == "wan-tiny-a14b" and job.options["switch_step"] == 2
    assert [(u.node_id, u.lora_name, u.adapter, u.components, u.scale) for u in job.loras] == [
        ("83", HIGH, "comfy.wan2.2_t2v_lightx2v_4steps_lora_v1.1_high_noise", ("transformer",), 1.0000000000000002),
        ("85", LOW, "comfy.wan2.2_t2v_lightx2v_4steps_lora_v1.1_low_noise.transformer_2", ("transformer_2",),
         1.0000000000000002),
    ]
    request = job.request(adapters=adapter_refs(job.loras))
    assert [(a.name, a.scale) for a in request.adapters] == [(u.adapter, u.scale) for u in job.loras]
    assert "83" in job.nodes and "85" in job.nodes  # reported as executing like the other loaders


def test_swapping_the_chains_swaps_the_experts(lora_service: Any) -> None:
    prompt = _template()
    prompt["83"]["inputs"]["lora_name"], prompt["85"]["inputs"]["lora_name"] = LOW, HIGH
    (job,) = lora_service.check(prompt).jobs
    assert [(u.lora_name, u.components) for u in job.loras] == [(LOW, ("transformer",)), (HIGH, ("transformer_2",))]


def test_lora_name_lists_the_folders_safetensors_files(lora_service: Any, lora_dir: Path) -> None:
    names = lora_service.validation_context().folders["loras"]
    assert HIGH in names and "style/ink.safetensors" in names and "pickled.ckpt" not in names
    assert "wan2.1_t2v_1.3B_fp16.safetensors" not in names  # model mapping names are not LoRAs
    info = object_info(lora_service.validation_context().folders)
    assert info["LoraLoaderModelOnly"]["input"]["required"]["lora_name"][0] == names
    assert list(info["LoraLoader"]["input"]["required"]) == ["model", "clip", "lora_name", "strength_model", "strength_clip"]
    assert info["LoraLoader"]["output"] == ["MODEL", "CLIP"] and info["LoraLoader"]["display_name"] == "Load LoRA"


def test_a_file_not_in_the_folder_is_value_not_in_list(lora_service: Any) -> None:
    prompt = _template()
    prompt["85"]["inputs"]["lora_name"] = "absent.safetensors"
    answer = lora_service.check(prompt)
    assert not answer.ok
    error = answer.node_errors["85"]["errors"][0]
    assert error["type"] == "value_not_in_list" and error["extra_info"]["input_name"] == "lora_name"


def test_a_missing_file_at_compile_is_an_error_naming_node_and_input(lora_service: Any, tmp_path: Path) -> None:
    # A direct compile (no validation first), or a file removed between validation and compile.
    empty = LoraLibrary(LoraFolder(tmp_path))
    result = compile_prompt(_template(), ["80"], models=lora_service.models, cards=lora_service.cards, loras=empty)
    assert result.jobs == []
    (error,) = result.node_errors["83"]["errors"]
    assert error["extra_info"] == {"input_name": "lora_name"}
    assert error["details"].startswith(f"lora_name - fv: {HIGH!r} is not a .safetensors file in the LoRA folder")
    none = compile_prompt(_template(), ["80"], models=lora_service.models, cards=lora_service.cards)
    assert "no LoRA folder is set" in none.node_errors["83"]["errors"][0]["details"]
    assert "--comfy-loras" in none.node_errors["83"]["errors"][0]["details"]


@pytest.mark.parametrize(("lora", "expected"), [
    ("stray_keys.safetensors", "some_vae.decoder.conv.lora_down.weight"),  # the key that maps to nothing is named
    ("garbage.safetensors", "not a safetensors file"),
    ("te_only.safetensors", "no weights for the diffusion model"),
])
def test_files_fv_cannot_use_are_refused_at_the_node(lora_service: Any, lora: str, expected: str) -> None:
    prompt = _t2v_with(("90", "LoraLoaderModelOnly", {"lora_name": lora, "strength_model": 1.0}))
    answer = lora_service.check(prompt)
    assert not answer.ok and answer.status == 400
    kind, details = _error(answer, "90")
    assert kind == "custom_validation_failed" and details.startswith("lora_name - fv: ")
    assert expected in details, details
    assert answer.node_errors["90"]["class_type"] == "LoraLoaderModelOnly"


def test_strength_zero_is_a_no_op_that_reads_no_file(lora_service: Any) -> None:
    # ComfyUI returns the node's inputs unchanged when both strengths are 0, before loading the file:
    # even an unreadable file is then no error.
    only = lora_service.check(_t2v_with(("90", "LoraLoaderModelOnly", {"lora_name": "garbage.safetensors", "strength_model": 0.0})))
    assert only.ok and only.jobs[0].loras == ()
    both = _t2v_with(("90", "LoraLoader", {"lora_name": "garbage.safetensors", "strength_model": 0.0, "strength_clip": 0.0}))
    both["90"]["inputs"]["clip"] = ["38", 0]
    answer = lora_service.check(both)
    assert answer.ok and answer.jobs[0].loras == ()
    # The negative control: the same node at a nonzero strength reads the file and is refused.
    both["90"]["inputs"]["strength_model"] = 0.5
    assert not lora_service.check(both).ok


def test_several_nodes_stack_in_chain_order_and_one_file_twice_adds_up(lora_service: Any) -> None:
    prompt = _t2v_with(("90", "LoraLoaderModelOnly", {"lora_name": "style/ink.safetensors", "strength_model": 0.5}),
                       ("91", "LoraLoaderModelOnly", {"lora_name": HIGH, "strength_model": -0.25}),
                       ("92", "LoraLoaderModelOnly", {"lora_name": "style/ink.safetensors", "strength_model": 0.25}))
    (job,) = lora_service.check(prompt).jobs
    assert job.card.model_id == "wan-tiny"
    assert [(u.node_id, u.adapter, u.scale) for u in job.loras] == [
        ("90", "comfy.style.ink", 0.5), ("91", "comfy.wan2.2_t2v_lightx2v_4steps_lora_v1.1_high_noise", -0.25),
        ("92", "comfy.style.ink", 0.25)]
    refs = adapter_refs(job.loras)
    assert [(r.name, r.scale) for r in refs] == [("comfy.style.ink", 0.75),
                                                ("comfy.wan2.2_t2v_lightx2v_4steps_lora_v1.1_high_noise", -0.25)]


def _lora_loader(lora: str, strength_model: float, strength_clip: float, *, model: bool = True, clip: bool = True) -> dict[str, Any]:
    """The T2V fixture with a LoraLoader whose MODEL output feeds the sampler (``model``) and whose
    CLIP output feeds both prompts (``clip``)."""
    prompt = retarget(load_pair("text_to_video_wan")[1])
    prompt["90"] = {"class_type": "LoraLoader", "inputs": {"model": ["37", 0], "clip": ["38", 0], "lora_name": lora,
                                                           "strength_model": strength_model, "strength_clip": strength_clip}}
    if model:
        prompt["48"]["inputs"]["model"] = ["90", 0]
    if clip:
        for encoder in ("6", "7"):
            prompt[encoder]["inputs"]["clip"] = ["90", 1]
    return prompt


def test_lora_loader_applies_strength_clip_to_the_text_encoder(lora_service: Any) -> None:
    (job,) = lora_service.check(_lora_loader("with_te.safetensors", 0.8, 0.8)).jobs
    assert [(u.adapter, u.components, u.scale) for u in job.loras] == [
        ("comfy.with_te", ("text_encoder", "transformer"), 0.8)]
    # CLIP only: a file's text-encoder weights alone, at strength_clip.
    (clip_only,) = lora_service.check(_lora_loader("te_only.safetensors", 0.0, 0.6)).jobs
    assert [(u.components, u.scale) for u in clip_only.loras] == [(("text_encoder",), 0.6)]
    # A file without text-encoder weights patches no CLIP (as in ComfyUI): strength_clip alone is nothing.
    (nothing,) = lora_service.check(_lora_loader("style/ink.safetensors", 0.0, 1.0)).jobs
    assert nothing.loras == ()
    (model_part,) = lora_service.check(_lora_loader("style/ink.safetensors", 0.7, 1.0)).jobs
    assert [(u.components, u.scale) for u in model_part.loras] == [(("transformer",), 0.7)]


@pytest.mark.parametrize(("strengths", "wiring", "listed"), [
    ((1.0, 0.5), {}, "text_encoder at 0.5, transformer at 1"),
    ((1.0, 1.0), {"clip": False}, "text_encoder at 0, transformer at 1"),  # its CLIP output feeds nothing
])
def test_one_file_at_two_strengths_is_refused_saying_why(lora_service: Any, strengths: tuple[float, float],
                                                         wiring: dict[str, bool], listed: str) -> None:
    answer = lora_service.check(_lora_loader("with_te.safetensors", *strengths, **wiring))
    kind, details = _error(answer, "90")
    assert kind == "custom_validation_failed" and listed in details and "one strength" in details, details
    # LoraLoaderModelOnly on a file with text-encoder weights: the same, naming both components.
    model_only = lora_service.check(_t2v_with(("91", "LoraLoaderModelOnly", {"lora_name": "with_te.safetensors",
                                                                          "strength_model": 1.0})))
    assert "text_encoder at 0, transformer at 1" in _error(model_only, "91")[1]


def test_positive_and_negative_through_different_lora_loaders_are_refused(lora_service: Any) -> None:
    prompt = _lora_loader("with_te.safetensors", 1.0, 1.0)
    prompt["7"]["inputs"]["clip"] = ["38", 0]  # the negative prompt skips the LoRA
    kind, details = _error(lora_service.check(prompt), "3")
    assert kind == "custom_validation_failed" and "same LoraLoader" in details


def test_a_lora_node_on_the_low_noise_chain_of_a_two_expert_card(lora_service: Any) -> None:
    prompt = retarget(load_pair("text_to_video_wan22_14B")[1])  # the A14B fixture without LoRA
    prompt["90"] = {"class_type": "LoraLoaderModelOnly", "inputs": {"model": ["56", 0], "lora_name": "style/ink.safetensors",
                                                                   "strength_model": 0.9}}
    prompt["55"]["inputs"]["model"] = ["90", 0]  # the low-noise UNETLoader's ModelSamplingSD3
    (job,) = lora_service.check(prompt).jobs
    assert [(u.adapter, u.components, u.scale) for u in job.loras] == [("comfy.style.ink.transformer_2", ("transformer_2",), 0.9)]


def test_adapter_names_are_registry_names() -> None:
    from fv_kernel.api import AdapterRef

    for name in (HIGH, "style/ink.safetensors", "odd name (v2).safetensors", "a" * 200 + ".safetensors"):
        for expert in (None, "transformer", "transformer_2"):
            made = adapter_name(name, expert)
            assert AdapterRef(name=made).name == made and made.startswith("comfy.")
            assert made.endswith(".transformer_2") == (expert == "transformer_2")
    # Two names that differ only in characters a registry name cannot hold stay two names.
    assert adapter_name("a b.safetensors", None) != adapter_name("a_b.safetensors", None)


def test_fv_generate_args_refuse_a_job_with_loras(lora_service: Any) -> None:
    (job,) = lora_service.check(_template()).jobs
    with pytest.raises(ValueError, match="per component"):
        job.fv_generate_args("wan-tiny-a14b")


def test_the_compile_keeps_converted_files_and_rereads_a_changed_one(lora_service: Any, lora_dir: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import fv_comfyui.loras as loras

    prompt = _t2v_with(("90", "LoraLoaderModelOnly", {"lora_name": "style/ink.safetensors", "strength_model": 1.0}))
    reads: list[Path] = []
    real = loras.read_adapter_file
    monkeypatch.setattr(loras, "read_adapter_file", lambda path, **kw: reads.append(path) or real(path, **kw))
    library = LoraLibrary(LoraFolder(lora_dir))
    service = copy.copy(lora_service)
    service.loras = library
    assert service.check(prompt).ok and service.check(prompt).ok
    assert len(reads) == 1
    comfy_lora(lora_dir / "style" / "ink.safetensors", seed=3, rank=3)  # replaced: read again
    assert service.check(prompt).ok and len(reads) == 2


def test_a_file_made_for_the_other_expert_is_refused_on_this_chain(lora_service: Any) -> None:
    prompt = _template()
    prompt["83"]["inputs"]["lora_name"] = "low_expert_diffusers.safetensors"  # diffusers' transformer_2. keys, high chain
    kind, details = _error(lora_service.check(prompt), "83")
    assert kind == "custom_validation_failed"
    assert "its weights are for 'transformer_2', but the node is on the chain of 'transformer'" in details
    prompt = _template()
    prompt["85"]["inputs"]["lora_name"] = "low_expert_diffusers.safetensors"  # on its own expert's chain: fine
    (job,) = lora_service.check(prompt).jobs
    assert job.loras[1].components == ("transformer_2",)


def test_ui_workflows_with_lora_nodes_convert_and_compile(lora_service: Any) -> None:
    """The editor's saved workflow (what a user downloads from the template browser) with a LoraLoader
    between the loaders and the rest, and a bypassed LoraLoaderModelOnly (mode 4) that passes its model through."""
    from fv_comfyui.convert import ui_to_api

    ui = copy.deepcopy(load_pair("text_to_video_wan")[0])
    ui["links"] = [link for link in ui["links"] if link[0] not in (74, 75, 94)]
    ui["links"] += [[200, 37, 0, 91, 0, "MODEL"], [201, 91, 0, 90, 0, "MODEL"], [202, 38, 0, 90, 1, "CLIP"],
                    [203, 90, 0, 48, 0, "MODEL"], [204, 90, 1, 6, 0, "CLIP"], [205, 90, 1, 7, 0, "CLIP"]]
    by_id = {node["id"]: node for node in ui["nodes"]}
    by_id[48]["inputs"][0]["link"], by_id[6]["inputs"][0]["link"], by_id[7]["inputs"][0]["link"] = 203, 204, 205
    ui["nodes"] += [
        {"id": 91, "type": "LoraLoaderModelOnly", "mode": 4, "inputs": [{"name": "model", "type": "MODEL", "link": 200}],
         "outputs": [{"name": "MODEL", "type": "MODEL", "links": [201]}], "widgets_values": [HIGH, 1.0]},
        {"id": 90, "type": "LoraLoader", "mode": 0,
         "inputs": [{"name": "model", "type": "MODEL", "link": 201}, {"name": "clip", "type": "CLIP", "link": 202}],
         "outputs": [{"name": "MODEL", "type": "MODEL", "links": [203]}, {"name": "CLIP", "type": "CLIP", "links": [204, 205]}],
         "widgets_values": ["style/ink.safetensors", 0.6, 0.6]},
    ]
    api = ui_to_api(ui)
    assert "91" not in api  # bypassed: its input passes through
    assert api["90"]["inputs"] == {"model": ["37", 0], "clip": ["38", 0], "lora_name": "style/ink.safetensors",
                                   "strength_model": 0.6, "strength_clip": 0.6}
    (job,) = lora_service.check(retarget(api)).jobs
    assert [(u.node_id, u.class_type, u.adapter, u.scale) for u in job.loras] == [("90", "LoraLoader", "comfy.style.ink", 0.6)]


def test_registration_reads_a_file_once_per_registry_and_again_when_it_changes(lora_service: Any, tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from fv_kernel.api import AdapterRegistry, converter_for

    folder = tmp_path / "loras"
    comfy_lora(folder / HIGH, seed=1)
    comfy_lora(folder / LOW, seed=2)
    library = LoraLibrary(LoraFolder(folder))
    service = copy.copy(lora_service)
    service.loras = library
    (job,) = service.check(_template()).jobs
    card = job.card
    registry = AdapterRegistry(converter_for(card))
    added: list[str] = []
    real = registry.add_file
    monkeypatch.setattr(registry, "add_file", lambda path, **kw: added.append(kw["name"]) or real(path, **kw))
    refs = library.register(registry, job.loras)
    assert [r.name for r in refs] == [u.adapter for u in job.loras] and len(added) == 2
    library.register(registry, job.loras)
    assert len(added) == 2  # already registered, file unchanged
    comfy_lora(folder / LOW, seed=5, rank=3)  # the file replaced on disk
    library.register(registry, job.loras)
    assert added[2:] == [job.loras[1].adapter]
    other = AdapterRegistry(converter_for(card))  # another engine's registry knows nothing yet
    library.register(other, job.loras)
    assert {i.name for i in other.list()} == {u.adapter for u in job.loras}
