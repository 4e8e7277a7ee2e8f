"""ModelCard specs: validated before any weights, with errors that name the field; recipe teeth."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from fv_kernel.card.checkpoint import apply_key_map, load_into
from fv_kernel.model.options import InstanceOptions
from fv_kernel.model.instance import build_instance
from fv_kernel.card.spec import KeyMapRule, LoopSpec, ModelCard, RecipeSpec, SamplerBinding
from fv_kernel.model.validate import RequestLimits, resolve_request
from fv_kernel.errors import CheckpointKeyError, InvalidRequest, RecipeMismatch
from fv_kernel.request.request import DiffusionParams, ImagePart, Request, TextPart
from fv_kernel.request.types import TaskType
from fv_kernel.testing.toy import toy_card


def t2v(model: str = "toy-dit", **diffusion: object) -> Request:
    return Request(model=model, task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text="a fox"),), diffusion=DiffusionParams(**diffusion))


def distilled_card() -> ModelCard:
    """toy-dit re-cut as a 3-step distilled recipe that assumes its DMD loop."""
    card = toy_card("toy-dit")
    loops = dict(card.loops)
    loops["dmd3"] = LoopSpec(
        loop_id="dmd3", kind="diffusion_denoise", implementation="fv_kernel.testing.toy:ToyDenoiseLoop",
        sampler=SamplerBinding(name="dmd", config={"denoising_timesteps": [1000, 757, 522], "shift": 8.0}, fixed_steps=3),
        guidance="none",
    )
    data = card.model_dump()
    data.update(model_id="toy-dmd", loops=loops,
                recipe=RecipeSpec(method="dmd2", parents=("toy-dit",), assumes_loop="dmd3", assumes_precision="fp32"))
    data["capabilities"] = card.capabilities.model_copy(update={"uses_guidance": False})
    return ModelCard.model_validate(data)


def test_card_round_trips_and_is_immutable() -> None:
    card = toy_card("toy-dit")
    assert ModelCard.model_validate(card.model_dump()) == card
    with pytest.raises(ValidationError):
        card.model_id = "other"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d.update(model_id="Bad Id"), "model_id"),
        (lambda d: d.update(factory="not a reference"), "factory"),
        (lambda d: d.update(unknown_field=1), "unknown_field"),
        (lambda d: d["recipe"].update(assumes_loop="nope"), "assumes_loop"),
        (lambda d: d["programs"][TaskType.TEXT_TO_VIDEO].update(loops=("text_encode", "missing")), "missing"),
        (lambda d: d["parallelism"].update(max_degree={"warp": 2}), "warp"),
        (lambda d: d["precision"].update(default="fp16"), "default precision"),
    ],
)
def test_malformed_card_names_the_field(mutate, field: str) -> None:
    data = toy_card("toy-dit").model_dump()
    mutate(data)
    with pytest.raises(ValidationError) as info:
        ModelCard.model_validate(data)
    assert field in str(info.value)


def test_recipe_mismatch_for_a_50_step_unipc_request_on_a_distilled_card() -> None:
    card = distilled_card()
    with pytest.raises(RecipeMismatch) as info:
        resolve_request(card, t2v("toy-dmd", sampler="unipc", steps=50))
    message = str(info.value)
    assert "dmd2" in message and "dmd3" in message and "'unipc'" in message and "50 steps" in message
    assert info.value.param == "sampler"
    with pytest.raises(RecipeMismatch) as info:
        resolve_request(card, t2v("toy-dmd", steps=50))
    assert info.value.param == "steps"
    # The recipe's own loop is fine, and is what runs.
    resolved = resolve_request(card, t2v("toy-dmd", steps=3))
    assert resolved.diffusion.steps == 3


def test_a_fixed_loop_bound_by_its_namespaced_sampler_name_accepts_that_sampler_by_either_name() -> None:
    card = distilled_card()
    loops = dict(card.loops)
    loops["dmd3"] = loops["dmd3"].model_copy(
        update={"sampler": loops["dmd3"].sampler.model_copy(update={"name": "fv-kernel/dmd"})}
    )
    card = card.model_copy(update={"loops": loops})
    for name in ("dmd", "fv-kernel/dmd"):
        assert resolve_request(card, t2v("toy-dmd", sampler=name, steps=3)).diffusion.sampler == name
    with pytest.raises(RecipeMismatch) as info:
        resolve_request(card, t2v("toy-dmd", sampler="euler"))
    assert info.value.param == "sampler"


def test_recipe_mismatch_on_precision() -> None:
    card = distilled_card()
    request = t2v("toy-dmd").with_updates(precision="bf16")
    with pytest.raises(InvalidRequest) as info:  # bf16 is not even supported: RecipeMismatch first
        resolve_request(card, request)
    assert isinstance(info.value, RecipeMismatch)
    assert "precision 'fp32'" in str(info.value) and "'bf16'" in str(info.value)


def test_guidance_on_a_recipe_without_cfg_is_rejected() -> None:
    with pytest.raises(InvalidRequest) as info:
        resolve_request(distilled_card(), t2v("toy-dmd", guidance=5.0))
    assert info.value.param == "guidance" and "without classifier-free guidance" in str(info.value)


@pytest.mark.parametrize(
    ("diffusion", "param", "allowed"),
    [
        ({"height": 10}, "height", "multiples of 4"),
        ({"width": 6}, "width", "multiples of 4"),
        ({"frames": 4}, "frames", "2k+1"),
        ({"sampler": "heun"}, "sampler", "euler"),
    ],
)
def test_request_shape_errors_name_field_and_allowed(diffusion, param: str, allowed: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        resolve_request(toy_card("toy-dit"), t2v(**diffusion))
    assert info.value.param == param
    assert allowed in str(info.value)


def test_deployment_limits() -> None:
    limits = RequestLimits(max_frames=3, max_steps=10, max_pixels=64)
    with pytest.raises(InvalidRequest, match="frames"):
        resolve_request(toy_card("toy-dit"), t2v(frames=5), limits)
    with pytest.raises(InvalidRequest, match="steps"):
        resolve_request(toy_card("toy-dit"), t2v(steps=11), limits)
    with pytest.raises(InvalidRequest, match="pixels"):
        resolve_request(toy_card("toy-dit"), t2v(height=16, width=16), limits)


def test_defaults_are_filled_from_the_card() -> None:
    resolved = resolve_request(toy_card("toy-dit"), t2v())
    d = resolved.diffusion
    assert (d.height, d.width, d.frames, d.steps, d.guidance) == (8, 8, 3, 4, 3.0)
    image = resolve_request(toy_card("toy-dit"), Request(model="toy-dit", task=TaskType.TEXT_TO_IMAGE, inputs=(TextPart(text="x"),)))
    assert image.diffusion.frames == 1


def test_task_the_card_cannot_run() -> None:
    request = Request(model="toy-dit", task=TaskType.IMAGE_TO_VIDEO, inputs=(ImagePart(image=torch.rand(3, 8, 8)),))
    with pytest.raises(InvalidRequest) as info:
        resolve_request(toy_card("toy-dit"), request)
    assert info.value.param == "task" and "text_to_video" in str(info.value)


def test_components_load_lazily_per_task() -> None:
    instance = build_instance(toy_card("toy-omni"), InstanceOptions())
    assert instance.components == {}
    instance.load_for_task(TaskType.TEXT_GENERATION)
    assert set(instance.components) == {"lm"}, "text generation must not load the DiT or the decoder"
    instance.load_for_task(TaskType.TEXT_TO_VIDEO)
    assert set(instance.components) == {"lm", "dit", "decoder"}


def test_a_load_in_flight_on_another_thread_is_waited_for_until_its_ops_exist() -> None:
    """Two requests of one task on two threads: the second must not return from ``load_for_task`` while the first
    has stored its components but not yet built the ops (it then failed on 'has no op ... (loaded: [])', seen once in
    CI on cosmos3-tiny's interleave gate). The first load is held right after its components are in."""
    import threading

    instance = build_instance(toy_card("toy-omni"), InstanceOptions())
    components_in, release = threading.Event(), threading.Event()
    build_ops = instance.ops_builder

    def slow_ops(built):  # noqa: ANN001, ANN202
        components_in.set()
        assert release.wait(10)
        return build_ops(built)

    instance.ops_builder = slow_ops
    first = threading.Thread(target=instance.load_for_task, args=(TaskType.TEXT_GENERATION,))
    first.start()
    assert components_in.wait(10) and "lm" in instance.components
    found: list[object] = []

    def second() -> None:
        instance.load_for_task(TaskType.TEXT_GENERATION)
        try:
            found.append(instance.op("lm_prefill"))
        except KeyError as exc:
            found.append(exc)

    waiter = threading.Thread(target=second)
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive(), "the second caller returned while the first load had not built its ops"
    release.set()
    first.join(10)
    waiter.join(10)
    assert len(found) == 1 and not isinstance(found[0], KeyError), found


def test_key_maps_are_declared_and_loading_reports_missing_and_unexpected_keys() -> None:
    module = torch.nn.Sequential(torch.nn.Linear(2, 2))
    original = {"layer0.w": torch.ones(2, 2), "layer0.b": torch.zeros(2)}
    rules = [KeyMapRule(pattern=r"^layer(\d+)\.w$", replacement=r"\1.weight"), KeyMapRule(pattern=r"^layer(\d+)\.b$", replacement=r"\1.bias")]
    mapped = apply_key_map(original, rules)
    load_into(module, mapped, component="toy", dtype=torch.bfloat16, keep_fp32=())
    assert module[0].weight.dtype == torch.bfloat16
    many = {f"extra.{i}": torch.zeros(1) for i in range(12)}
    with pytest.raises(CheckpointKeyError) as info:
        load_into(module, {"0.weight": torch.ones(2, 2), **many}, component="toy")
    message = str(info.value)
    assert "1 missing key(s): 0.bias" in message and "12 unexpected key(s)" in message and "(4 more)" in message


def test_fp32_kept_modules_stay_fp32() -> None:
    module = torch.nn.ModuleDict({"norm": torch.nn.LayerNorm(2), "proj": torch.nn.Linear(2, 2)})
    load_into(module, module.state_dict(), component="m", dtype=torch.bfloat16, keep_fp32=("norm",))
    assert module["norm"].weight.dtype == torch.float32 and module["proj"].weight.dtype == torch.bfloat16


def test_frames_for_seconds_rounds_up_to_the_cards_frame_rule() -> None:
    """The OpenAI API's ``seconds`` (fv serve and fv-dynamo's worker share this rule)."""
    from fv_kernel.api import FrameRule, InvalidRequest, frames_for_seconds
    from fv_kernel.testing.toy import toy_card

    card = toy_card("toy-dit")
    caps = card.capabilities.model_copy(update={"frame_rule": FrameRule(modulus=4, remainder=1)})
    card = card.model_copy(update={"capabilities": caps})
    assert frames_for_seconds(card, 1.0, 16.0) == (17, 16.0)  # 16 wanted -> the next 4k+1
    assert frames_for_seconds(card, 0.01, 16.0) == (1, 16.0)
    no_fps = card.model_copy(update={"capabilities": caps.model_copy(update={"defaults": None})})
    with pytest.raises(InvalidRequest, match="fps: required with seconds"):
        frames_for_seconds(no_fps, 1.0, None)
