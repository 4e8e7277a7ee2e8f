"""Adapters as part of the request and the recipe: names, strengths, default stacks, distilled
adapters' loops, and what a resident instance gives its loops (step inputs, routing, cache keys)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from fv_kernel.cache.adapters import AdapterRegistry, AdapterSettings
from fv_kernel.card.spec import AdapterRef, ModelCard, RecipeSpec
from fv_kernel.compute.lora import rows_adapted
from fv_kernel.errors import InvalidRequest, RecipeMismatch, UnknownAdapter
from fv_kernel.model.adapters import convert_peft
from fv_kernel.model.instance import ModelInstance, build_instance
from fv_kernel.model.validate import resolve_for_instance, resolve_request
from fv_kernel.request.request import DiffusionParams, Request, TextPart
from fv_kernel.request.types import TaskType
from fv_kernel.testing.adapters import peft_lora_tensors, write_peft_lora
from fv_kernel.testing.toy import build_component, toy_card


def t2v(*adapters: AdapterRef, **changes: object) -> Request:
    return Request(model="toy-dit", task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text="a fox"),), adapters=adapters, **changes)


def lora(tmp: Path, name: str, *, component: str = "dit", targets: tuple[str, ...] = ("blocks.0.qkv", "proj_out"),
         seed: int = 0, metadata: dict[str, str] | None = None) -> Path:
    module = build_component(component, 1)
    return write_peft_lora(tmp / f"{name}.safetensors", peft_lora_tensors(module, component, targets, seed=seed, rank=2),
                           metadata)


@pytest.fixture()
def registry(tmp_path: Path) -> AdapterRegistry:
    reg = AdapterRegistry(convert_peft, AdapterSettings(max_stack=2))
    reg.add_file(lora(tmp_path, "style"))
    reg.add_file(lora(tmp_path, "sketch", seed=1))
    reg.add_file(lora(tmp_path, "words", component="lm", targets=("qkv.0",), seed=2))
    reg.add_file(lora(tmp_path, "lightning", seed=3, metadata={"fv.assumes_steps": "2", "fv.assumes_loop": "denoise"}))
    return reg


def instance(registry: AdapterRegistry | None, card: ModelCard | None = None, **options: object) -> ModelInstance:
    from fv_kernel.model.options import InstanceOptions

    inst = build_instance(card or toy_card("toy-dit"), InstanceOptions(**options))  # type: ignore[arg-type]
    inst.adapters = registry
    return inst


def with_default_stack(*refs: AdapterRef) -> ModelCard:
    card = toy_card("toy-dit")
    return card.model_copy(update={"recipe": RecipeSpec(method="base", adapters=refs)})


# -- the request's fields ---------------------------------------------------------------------------


def test_adapter_refs_are_checked_where_they_are_written() -> None:
    with pytest.raises(ValidationError, match="adapter name '../x'"):
        AdapterRef(name="../x")
    for scale in (float("nan"), 101.0, -1e9):
        with pytest.raises(ValidationError, match="outside -100..100"):
            AdapterRef(name="a", scale=scale)
    with pytest.raises(ValidationError, match=r"adapters\[1\].name 'a' repeats adapters\[0\]"):
        t2v(AdapterRef(name="a"), AdapterRef(name="a", scale=0.5))
    with pytest.raises(ValidationError, match="more than once"):
        RecipeSpec(adapters=(AdapterRef(name="a"), AdapterRef(name="a")))
    with pytest.raises(ValidationError, match="not a 'package.module:attribute'"):
        toy_card("toy-dit").model_validate({**toy_card("toy-dit").model_dump(), "adapter_format": "nope"})


def test_unknown_adapter_names_the_field_and_the_registered_names(registry: AdapterRegistry) -> None:
    inst = instance(registry)
    with pytest.raises(UnknownAdapter) as caught:
        resolve_for_instance(inst, t2v(AdapterRef(name="style"), AdapterRef(name="stlye2")))
    err = caught.value
    assert err.param == "adapters[1].name" and err.info()["type"] == "unknown_adapter"
    assert "did you mean 'style'" in err.message and "allowed: lightning, sketch, style, words" in err.message


def test_adapters_on_a_deployment_without_them_are_refused_by_name(registry: AdapterRegistry) -> None:
    with pytest.raises(InvalidRequest, match=r"adapters\[0\]: the request names adapter 'style', but this deployment has adapters disabled"):
        resolve_for_instance(instance(None), t2v(AdapterRef(name="style")))
    card = with_default_stack(AdapterRef(name="style"))
    with pytest.raises(InvalidRequest, match=r"recipe.adapters\[0\]: the card's default stack"):
        resolve_request(card, t2v())


def test_default_stack_comes_first_and_a_request_sets_its_strength(registry: AdapterRegistry) -> None:
    card = with_default_stack(AdapterRef(name="style", scale=0.8))
    inst = instance(registry, card)
    resolved = resolve_for_instance(inst, t2v(AdapterRef(name="sketch", scale=0.5)))
    assert [(r.name, r.scale) for r in resolved.adapters] == [("style", 0.8), ("sketch", 0.5)]
    assert [r.version for r in resolved.adapters] == [registry.get("style").version, registry.get("sketch").version]
    assert resolve_for_instance(inst, resolved).adapters == resolved.adapters  # resolving again changes nothing
    off = resolve_for_instance(inst, t2v(AdapterRef(name="style", scale=0.0)))
    assert inst.adapter_stack(off, "dit") == []  # strength 0 turns the default off


def test_stack_size_and_components_are_checked(registry: AdapterRegistry, tmp_path: Path) -> None:
    inst = instance(registry)
    with pytest.raises(InvalidRequest, match=r"adapters: the stack has 3 adapters .*allowed: at most 2 \(adapters.max_stack\)"):
        resolve_for_instance(inst, t2v(AdapterRef(name="style"), AdapterRef(name="sketch"), AdapterRef(name="words")))
    lm_inst = instance(registry, toy_card("toy-lm"))
    chat = Request(model="toy-lm", task=TaskType.TEXT_GENERATION, inputs=(TextPart(text="hi"),), adapters=(AdapterRef(name="style"),))
    with pytest.raises(InvalidRequest, match=r"adapters\[0\].name: adapter 'style' changes components \['dit'\] that card 'toy-lm' does not have"):
        resolve_for_instance(lm_inst, chat)


def test_a_replaced_adapter_keeps_the_version_a_request_pinned(registry: AdapterRegistry, tmp_path: Path) -> None:
    inst = instance(registry)
    resolved = resolve_for_instance(inst, t2v(AdapterRef(name="style")))
    old = registry.get("style").version
    (tmp_path / "v2").mkdir()
    registry.add_file(lora(tmp_path / "v2", "style", seed=9))
    assert registry.get("style").version != old
    assert [info.version for info, _ in inst.adapter_stack(resolved, "dit")] == [old]


# -- distilled adapters -----------------------------------------------------------------------------


def test_a_distilled_adapter_fills_its_step_count_and_refuses_another(registry: AdapterRegistry) -> None:
    inst = instance(registry)
    resolved = resolve_for_instance(inst, t2v(AdapterRef(name="lightning")))
    assert resolved.diffusion.steps == 2  # the card's default is 4
    with pytest.raises(RecipeMismatch) as caught:
        resolve_for_instance(inst, t2v(AdapterRef(name="lightning"), diffusion=DiffusionParams(steps=50)))
    assert caught.value.param == "steps"
    assert "adapter 'lightning' assumes 2 steps" in caught.value.message and "override_recipe" in caught.value.message
    # Negative control: without the adapter, 50 steps is fine.
    assert resolve_for_instance(inst, t2v(diffusion=DiffusionParams(steps=50))).diffusion.steps == 50
    overridden = instance(registry, allow_recipe_mismatch=True)
    assert resolve_for_instance(overridden, t2v(AdapterRef(name="lightning"), diffusion=DiffusionParams(steps=50))).diffusion.steps == 50


def test_a_distilled_adapter_refuses_another_loop(registry: AdapterRegistry) -> None:
    inst = instance(registry)
    with pytest.raises(RecipeMismatch) as caught:
        resolve_for_instance(inst, t2v(AdapterRef(name="lightning"), diffusion=DiffusionParams(sampler="unipc", steps=2)))
    assert caught.value.param == "adapters" and "loop 'denoise'" in caught.value.message
    assert "loop 'denoise_unipc'" in caught.value.message
    assert resolve_for_instance(inst, t2v(AdapterRef(name="lightning"))).diffusion.sampler == "euler"


def test_an_adapter_assuming_a_loop_the_card_lacks_is_refused(registry: AdapterRegistry, tmp_path: Path) -> None:
    registry.add_file(lora(tmp_path, "other", seed=5, metadata={"fv.assumes_loop": "turbo"}))
    with pytest.raises(InvalidRequest, match=r"adapters\[0\].name: adapter 'other' assumes loop 'turbo'.*allowed: decode, denoise"):
        resolve_for_instance(instance(registry), t2v(AdapterRef(name="other")))


# -- what the instance gives loops and ops ----------------------------------------------------------


def test_adapter_inputs_have_one_shape_for_every_stack(registry: AdapterRegistry) -> None:
    inst = instance(registry)
    plain = inst.adapter_inputs(t2v(), "dit", rows=2)
    styled = inst.adapter_inputs(resolve_for_instance(inst, t2v(AdapterRef(name="style", scale=0.5))), "dit", rows=2)
    assert plain["adapter_ids"].shape == styled["adapter_ids"].shape == (2, 2)
    assert plain["adapter_ids"].dtype == torch.int64 and plain["adapter_scales"].dtype == torch.float32
    assert (plain["adapter_ids"] == -1).all() and (plain["adapter_scales"] == 0).all()
    assert styled["adapter_ids"][:, 0].tolist() == [registry.id_of(registry.get("style").version)] * 2
    assert styled["adapter_scales"].tolist() == [[0.5, 0.0], [0.5, 0.0]]
    assert instance(None).adapter_inputs(t2v(), "dit") == {}


def test_row_adapters_route_each_row_to_its_own_stack(registry: AdapterRegistry) -> None:
    inst = instance(registry)
    dit = inst.component("dit")
    req_a = resolve_for_instance(inst, t2v(AdapterRef(name="style")))
    req_b = resolve_for_instance(inst, t2v(AdapterRef(name="sketch", scale=0.7)))
    inputs = {k: torch.cat([inst.adapter_inputs(r, "dit")[k] for r in (req_a, t2v(), req_b)])
              for k in ("adapter_ids", "adapter_scales")}
    x, t, ctx = torch.randn(3, 4, 1, 2, 2), torch.tensor([500.0] * 3), torch.randn(3, 16, 32)
    with rows_adapted(dit, inst.row_adapters(inputs, "dit")):
        batched = dit(x, t, ctx)

    def alone(request: Request, row: int) -> torch.Tensor:
        inst.merge_stack("dit", tuple((info.version, s) for info, s in inst.adapter_stack(request, "dit")))
        try:
            return dit(x[row : row + 1], t[row : row + 1], ctx[row : row + 1])
        finally:
            inst.unmerge("dit")

    for row, request in enumerate((req_a, t2v(), req_b)):
        torch.testing.assert_close(batched[row : row + 1], alone(request, row), rtol=1e-5, atol=1e-5)
    base = dit(x, t, ctx)
    assert not torch.allclose(base[0], batched[0], atol=1e-4) and torch.equal(base[1], batched[1])
    # Negative control: routing with rows 0 and 2 swapped gives other outputs.
    swapped = {k: v[[2, 1, 0]] for k, v in inputs.items()}
    with rows_adapted(dit, inst.row_adapters(swapped, "dit")):
        assert not torch.allclose(dit(x, t, ctx)[0], batched[0], atol=1e-4)


def test_merged_stack_needs_no_routing_and_another_stack_restores_exactly(registry: AdapterRegistry) -> None:
    inst = instance(registry)
    dit = inst.component("dit")
    before = {k: v.clone() for k, v in dit.state_dict().items()}
    request = resolve_for_instance(inst, t2v(AdapterRef(name="style")))
    stack = tuple((info.version, s) for info, s in inst.adapter_stack(request, "dit"))
    inst.merge_stack("dit", stack)
    assert inst.merged_stack("dit") == stack
    assert not all(torch.equal(before[k], v) for k, v in dit.state_dict().items())
    assert inst.row_adapters(inst.adapter_inputs(request, "dit"), "dit") is None
    # A forward with another stack (here: none) gets the base weights back, bit-exactly, first.
    assert inst.row_adapters(inst.adapter_inputs(t2v(), "dit"), "dit") is None
    assert inst.merged_stack("dit") is None
    assert all(torch.equal(before[k], v) for k, v in dit.state_dict().items())


def test_adapter_versions_list_only_adapters_of_the_component_with_strength(registry: AdapterRegistry) -> None:
    inst = instance(registry)
    request = resolve_for_instance(inst, t2v(AdapterRef(name="style", scale=0.5), AdapterRef(name="words")))
    style, words = registry.get("style"), registry.get("words")
    assert inst.adapter_versions(request, "dit") == (("style", f"{style.version}@0.5"),)
    assert inst.adapter_versions(request, "lm") == (("words", f"{words.version}@1.0"),)
    stronger = resolve_for_instance(inst, t2v(AdapterRef(name="style", scale=0.6), AdapterRef(name="words")))
    assert inst.adapter_versions(stronger, "dit") != inst.adapter_versions(request, "dit")
    assert inst.adapter_versions(t2v(), "dit") == ()


def test_row_adapters_use_the_instances_row_kernel(registry: AdapterRegistry) -> None:
    inst = instance(registry)
    calls: list[str] = []

    def kernel(x: torch.Tensor, out: torch.Tensor, segments: object, path: str) -> None:
        calls.append(path)

    inst.adapter_row_kernel = kernel
    request = resolve_for_instance(inst, t2v(AdapterRef(name="style")))
    dit = inst.component("dit")
    with rows_adapted(dit, inst.row_adapters(inst.adapter_inputs(request, "dit"), "dit")):
        dit(torch.randn(1, 4, 1, 2, 2), torch.tensor([1.0]), torch.randn(1, 16, 32))
    assert sorted(set(calls)) == ["blocks.0.qkv", "proj_out"]
