"""Kernel side of behaviour capture: the request field, the artifact's files, the driver's refusal.

The capturing loop itself (fv-wan's denoise loop, bit-identity through the Engine) is tested
in plugins/fv-rl/tests/test_capture.py.
"""

from __future__ import annotations

import pytest
import torch

from fv_kernel.api import (
    BehaviorRecord,
    BehaviorSlice,
    Engine,
    OutputSpec,
    Provenance,
    Request,
    TaskType,
    TextPart,
    build_instance,
)
from fv_kernel.testing.toy import toy_card


def _record() -> BehaviorRecord:
    g = torch.Generator().manual_seed(0)
    return BehaviorRecord(
        capture="steps", seed=3, sampler="euler:{}", sigmas=torch.tensor([1.0, 0.5, 0.0]), timesteps=torch.tensor([1000.0, 500.0]),
        initial_noise=torch.randn(1, 2, 3, generator=g), final_latents=torch.randn(1, 2, 3, generator=g), prompt="fox",
        prompt_embeds=torch.randn(1, 4, 8, generator=g), guidance=1.0, guidance_policy="cfg", precision="fp32",
        attention_backend="sdpa", weights_version="v1", deterministic={"ran_alone": True},
        steps=[BehaviorSlice(step=0, timestep=1000.0, sigma=1.0, sigma_next=0.5, expert="transformer", guidance=1.0,
                             branches=("cond",), log_prob=torch.tensor([-1.5]), latents=torch.randn(1, 2, 3, generator=g))],
        provenance=Provenance(model_id="m", loop_id="denoise", request_id="r"),
    )


def test_capture_field_is_typed():
    assert OutputSpec().capture_behavior == "off"
    with pytest.raises(ValueError, match="capture_behavior"):
        OutputSpec(capture_behavior="everything")


def test_a_behavior_record_survives_modalities_filtering():
    record = _record()
    assert OutputSpec(modalities=frozenset({"video"})).keep([record]) == [record]


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_record_round_trips_bit_exactly(tmp_path, fmt):
    record = _record()
    if fmt == "torch":
        record.save(tmp_path / "r.pt")
        loaded = BehaviorRecord.load(tmp_path / "r.pt")
    else:
        record.save_safetensors(tmp_path / "r.safetensors")
        loaded = BehaviorRecord.load_safetensors(tmp_path / "r.safetensors")
    assert torch.equal(loaded.steps[0].log_prob, record.steps[0].log_prob)
    assert torch.equal(loaded.steps[0].latents, record.steps[0].latents) and loaded.steps[0].velocity is None
    assert torch.equal(loaded.prompt_embeds, record.prompt_embeds) and loaded.negative_embeds is None
    assert loaded.deterministic == record.deterministic and loaded.steps[0].branches == ("cond",)


def test_driver_refuses_capture_on_a_denoise_loop_that_cannot():
    """The toy card's denoise loop does not capture: the request fails naming the field, instead of returning no record."""
    engine = Engine()
    engine.add_instance(build_instance(toy_card("toy-dit")))
    plain = engine.generate(Request(model="toy-dit", task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text="fox"),)))
    assert plain.status == "completed"
    engine = Engine()
    engine.add_instance(build_instance(toy_card("toy-dit")))
    result = engine.generate(Request(model="toy-dit", task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text="fox"),),
                                     output=OutputSpec(capture_behavior="final")))
    assert result.status == "failed" and result.error.param == "output.capture_behavior"
