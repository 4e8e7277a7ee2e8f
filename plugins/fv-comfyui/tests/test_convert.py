"""UI workflow → API prompt: exact on the three real fixture pairs, and on variants made here
(muted, bypassed, reroute, primitive, changed widgets, dict widgets, titles)."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from conftest import WORKFLOWS, load_pair
from fv_comfyui.convert import WorkflowFormatError, is_ui_workflow, ui_to_api


def _exact(a: Any, b: Any) -> bool:
    """Equal including int/float and key order, as JSON text."""
    return json.dumps(a, ensure_ascii=False) == json.dumps(b, ensure_ascii=False)


def _node(ui: dict[str, Any], node_id: int) -> dict[str, Any]:
    return next(n for n in ui["nodes"] if n["id"] == node_id)


def _without_is_changed(prompt: dict[str, Any]) -> dict[str, Any]:
    return {k: {f: v for f, v in node.items() if f != "is_changed"} for k, node in prompt.items()}


@pytest.mark.parametrize("name", WORKFLOWS)
def test_each_fixture_converts_exactly(name: str) -> None:
    ui, api = load_pair(name)
    assert is_ui_workflow(ui) and not is_ui_workflow(api)
    # LoadImage's is_changed is the image's hash, which ComfyUI adds when it runs the prompt;
    # the fixture's image is not shipped, so it is compared without it (its rule is tested below).
    assert _exact(ui_to_api(ui), _without_is_changed(api))


def test_is_changed_is_the_images_sha256(tmp_path: Path) -> None:
    ui, api = load_pair("image_to_video_wan_example")
    (tmp_path / "flux_dev_example.png").write_bytes(b"not the fixture's image")
    out = ui_to_api(ui, image_dir=tmp_path)
    assert out["52"]["is_changed"] == [hashlib.sha256(b"not the fixture's image").hexdigest()]
    assert list(out["52"]) == list(api["52"])  # the key sits where ComfyUI puts it


def test_seed_control_value_is_skipped_and_literals_typed_like_validation(
    t2v_pair: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    ui, api = t2v_pair
    assert _node(ui, 3)["widgets_values"][1] == "randomize"
    out = ui_to_api(ui)
    assert out["3"]["inputs"]["steps"] == 30 and isinstance(out["3"]["inputs"]["cfg"], float)
    assert isinstance(out["28"]["inputs"]["fps"], float) and out["28"]["inputs"]["fps"] == 16.0
    # Negative control: without the skip, "randomize" lands in steps and every later widget shifts.
    import fv_comfyui.convert as convert

    with monkeypatch.context() as patched:
        patched.setattr(convert, "CONTROL_VALUES", frozenset())
        shifted = ui_to_api(ui)["3"]["inputs"]
    assert shifted["steps"] == "randomize" and shifted["cfg"] == 30.0
    _node(ui, 3)["widgets_values"].pop(1)
    assert ui_to_api(ui)["3"]["inputs"]["steps"] == 30  # a workflow without the entry still reads right
    _node(ui, 3)["widgets_values"].insert(1, "fixed")
    assert ui_to_api(ui)["3"]["inputs"]["steps"] == 30


def test_changed_widget_values(t2v_pair: Any) -> None:
    ui, api = t2v_pair
    _node(ui, 3)["widgets_values"] = [7, "fixed", 12, 5.5, "euler", "normal", 1]
    _node(ui, 40)["widgets_values"] = [64, 48, 9, 1]
    _node(ui, 6)["widgets_values"] = ["a red fox"]
    out = ui_to_api(ui)
    expected = copy.deepcopy(api)
    expected["3"]["inputs"].update(seed=7, steps=12, cfg=5.5, sampler_name="euler", scheduler="normal", denoise=1.0)
    expected["40"]["inputs"].update(width=64, height=48, length=9, batch_size=1)
    expected["6"]["inputs"]["text"] = "a red fox"
    assert _exact(out, expected)


def test_muted_node_is_dropped_and_its_consumers_keep_a_dangling_link(t2v_pair: Any) -> None:
    ui, api = t2v_pair
    _node(ui, 48)["mode"] = 2  # mute ModelSamplingSD3
    out = ui_to_api(ui)
    assert "48" not in out
    assert out["3"]["inputs"]["model"] == ["48", 0]  # the frontend keeps it; validation answers it


def test_bypassed_node_passes_its_input_through(t2v_pair: Any) -> None:
    ui, api = t2v_pair
    _node(ui, 48)["mode"] = 4  # bypass ModelSamplingSD3: KSampler gets the UNET's MODEL
    out = ui_to_api(ui)
    expected = {k: v for k, v in copy.deepcopy(api).items() if k != "48"}
    expected["3"]["inputs"]["model"] = ["37", 0]
    assert _exact(out, expected)


def test_bypassed_node_without_a_matching_input_drops_the_link(t2v_pair: Any) -> None:
    ui, _ = t2v_pair
    _node(ui, 8)["mode"] = 4  # VAEDecode: IMAGE out, only LATENT/VAE in
    out = ui_to_api(ui)
    assert "8" not in out and "images" not in out["28"]["inputs"]


def test_bypassed_output_node_is_dropped(t2v_pair: Any) -> None:
    ui, api = t2v_pair
    assert _node(ui, 47)["mode"] == 4  # the fixture's SaveWEBM is bypassed
    _node(ui, 47)["mode"] = 0
    out = ui_to_api(ui)
    assert out["47"] == {
        "inputs": {"filename_prefix": "ComfyUI", "codec": "vp9", "fps": 24.0, "crf": 32.0, "images": ["8", 0]},
        "class_type": "SaveWEBM", "_meta": {"title": "SaveWEBM"},
    }


def test_reroute_is_followed_to_its_source(t2v_pair: Any) -> None:
    ui, api = t2v_pair
    # CLIPLoader 38 -> Reroute 100 -> Reroute 101 -> CLIPTextEncode 6 (link 74 re-pointed)
    ui["nodes"] += [
        {"id": 100, "type": "Reroute", "mode": 0, "inputs": [{"name": "", "type": "*", "link": 200}],
         "outputs": [{"name": "", "type": "CLIP", "links": [201]}]},
        {"id": 101, "type": "Reroute", "mode": 0, "inputs": [{"name": "", "type": "*", "link": 201}],
         "outputs": [{"name": "", "type": "CLIP", "links": [74]}]},
    ]
    ui["links"] = [link for link in ui["links"] if link[0] != 74] + [
        [200, 38, 0, 100, 0, "CLIP"], [201, 100, 0, 101, 0, "*"], [74, 101, 0, 6, 0, "CLIP"],
    ]
    assert _exact(ui_to_api(ui), api)


def test_primitive_node_value_feeds_a_widget_input(t2v_pair: Any) -> None:
    ui, api = t2v_pair
    sampler = _node(ui, 3)
    sampler["inputs"].append({"name": "seed", "type": "INT", "link": 300, "widget": {"name": "seed"}})
    ui["nodes"].append({"id": 110, "type": "PrimitiveNode", "mode": 0, "inputs": [],
                        "outputs": [{"name": "INT", "type": "INT", "links": [300], "widget": {"name": "seed"}}],
                        "widgets_values": [1234, "fixed"]})
    ui["links"].append([300, 110, 0, 3, 4, "INT"])
    out = ui_to_api(ui)
    assert out["3"]["inputs"]["seed"] == 1234
    assert list(out["3"]["inputs"]) == list(api["3"]["inputs"])  # the converted widget keeps its place
    assert "110" not in out


def test_note_nodes_and_titles(t2v_pair: Any) -> None:
    ui, api = t2v_pair
    ui["nodes"].append({"id": 120, "type": "Note", "mode": 0, "widgets_values": ["hello"]})
    ui["nodes"].append({"id": 121, "type": "MarkdownNote", "mode": 0, "widgets_values": ["# hi"]})
    _node(ui, 37)["title"] = "My UNET"
    out = ui_to_api(ui)
    assert "120" not in out and "121" not in out
    assert out["37"]["_meta"]["title"] == "My UNET"


def test_dict_widgets_values_and_link_dicts(t2v_pair: Any) -> None:
    ui, api = t2v_pair
    _node(ui, 40)["widgets_values"] = {"width": 832, "height": 480, "length": 33, "batch_size": 1}
    ui["links"] = [
        {"id": l[0], "origin_id": l[1], "origin_slot": l[2], "target_id": l[3], "target_slot": l[4], "type": l[5]}
        for l in ui["links"]
    ]
    assert _exact(ui_to_api(ui), api)


def test_unknown_node_keeps_its_links_for_validation_to_refuse(t2v_pair: Any) -> None:
    ui, _ = t2v_pair
    _node(ui, 48)["type"] = "SomeCustomNode"
    out = ui_to_api(ui)
    assert out["48"] == {"inputs": {"model": ["37", 0]}, "class_type": "SomeCustomNode", "_meta": {"title": "SomeCustomNode"}}


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda ui: ui.pop("links"), "workflow: expected a UI workflow"),
    (lambda ui: ui["links"].append("bad"), "links["),
    (lambda ui: ui["nodes"].append({"type": "VAEDecode"}), "a node needs an 'id' and a 'type'"),
    (lambda ui: _node(ui, 8)["inputs"][0].update(link=999), "link 999"),
])
def test_malformed_workflows_are_typed_errors(t2v_pair: Any, mutate: Any, message: str) -> None:
    ui, _ = t2v_pair
    mutate(ui)
    with pytest.raises(WorkflowFormatError, match=message.replace("[", r"\[")):
        ui_to_api(ui)


def test_newer_frontends_list_every_widget_as_an_input(t2v_pair: Any) -> None:
    ui, api = t2v_pair
    for node in ui["nodes"]:  # frontend >= 1.16 writes each widget as an input slot with no link
        if node["type"] == "KSampler":
            for name, kind in [("seed", "INT"), ("steps", "INT"), ("cfg", "FLOAT"), ("sampler_name", "COMBO"),
                               ("scheduler", "COMBO"), ("denoise", "FLOAT")]:
                node["inputs"].append({"name": name, "type": kind, "widget": {"name": name}, "link": None})
    assert _exact(ui_to_api(ui), api)


def test_subgraphs_are_refused(t2v_pair: Any) -> None:
    ui, _ = t2v_pair
    ui["definitions"] = {"subgraphs": [{"id": "abc", "nodes": []}]}
    with pytest.raises(WorkflowFormatError, match="definitions.subgraphs"):
        ui_to_api(ui)
