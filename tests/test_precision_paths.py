"""Precision paths (docs/precision.md): typed on the card and the instance, chosen by contract.

The card lists the paths it may be served on (``PrecisionContract.paths``, each with a
``PrecisionPathContract``) and the linears they quantize (``fp8_targets``); a deployment asks
for one (``precision_path``), ``auto``, or nothing (the card's own); the instance reports the
resolved path and its family quantizes the targets at load. Toy-dit lists ``fp8_weights`` and
``fp8_dynamic``; device strings in ``auto`` cases are only compared, never used.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from torch import nn

import fv_kernel as fv
from fv_kernel.api import DiffusionParams, Request, TaskType, TextPart, run_local
from fv_kernel.card.checkpoint import load_into
from fv_kernel.card.spec import (
    IDENTICAL_CLIP_PSNR_DB,
    ModelCard,
    PrecisionContract,
    PrecisionPathContract,
    PrecisionPathMeasurement,
    PrecisionPathSample,
    PrecisionPathVerdict,
    TierParityRecord,
)
from fv_kernel.compute.compile import ComputeOptions, load_parity_record
from fv_kernel.compute.fp8 import Fp8Linear
from fv_kernel.config import CardDeployment, DeployConfig, DeployConfigError, load_deploy_config
from fv_kernel.deploy.model_resolution import resolve_model
from fv_kernel.errors import InvalidRequest, RecipeMismatch
from fv_kernel.model.instance import build_instance
from fv_kernel.model.options import InstanceOptions
from fv_kernel.model.precision import apply_precision_path, fp8_target_paths, select_precision_path
from fv_kernel.plugins.host import PluginHost
from fv_kernel.testing.toy import ToyDiT, toy_card

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture
def card() -> ModelCard:
    return toy_card("toy-dit")  # defaults: 4 steps at 3x8x8, fp32; lists fp8_weights and fp8_dynamic


def measured(path: str = "fp8_dynamic", *, psnr: float | tuple[float, ...] = 50.0, device: str = "cpu",
             step: float | None = 1e-3, native_step: float | None = 2e-3, steps: int = 4,
             judge: dict[str, float] | None = None, native_judge: dict[str, float] | None = None) -> PrecisionPathMeasurement:
    """One measurement; ``psnr`` a value for each of three seeds alike, or the samples' values."""
    values = psnr if isinstance(psnr, tuple) else (psnr,) * 3
    samples = tuple(PrecisionPathSample(seed=seed, prompt="a red fox", psnr_db=value) for seed, value in enumerate(values))
    return PrecisionPathMeasurement(
        path=path, model_id="toy-dit", precision="fp32", steps=steps, frames=3, height=8, width=8, samples=samples,  # type: ignore[arg-type]
        judge_scores=judge or {}, reference_judge_scores=native_judge or {}, device=device, step_seconds=step,
        reference_step_seconds=native_step, source="test",
    )


def recorded(tmp_path: Path, *measurements: PrecisionPathMeasurement) -> ComputeOptions:
    file = tmp_path / "record.json"
    file.write_text(TierParityRecord(precision_paths=measurements).model_dump_json())
    return ComputeOptions(parity_record=file)


def with_precision(card: ModelCard, **update: Any) -> ModelCard:
    data = card.model_dump()
    data["precision"].update(update)
    return ModelCard.model_validate(data)


def qat_card(card: ModelCard) -> ModelCard:
    data = card.model_dump()
    data["recipe"]["assumes_precision"] = "fp8_dynamic"
    data["recipe"]["method"] = "fp8_qat"
    return ModelCard.model_validate(data)


def video(card: ModelCard, options: InstanceOptions, prompt: str = "a red fox", seed: int = 3) -> torch.Tensor:
    request = Request(model=card.model_id, task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text=prompt),),
                      diffusion=DiffusionParams(seed=seed))
    (out,) = run_local(request, build_instance(card, options))
    return out.frames


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = float(((a.double() - b.double()) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


# --------------------------------------------------------------------------- the card's declaration


def test_a_card_lists_paths_with_contracts_and_native_is_always_allowed(card: ModelCard) -> None:
    assert card.precision.allowed_paths == ("native", "fp8_weights", "fp8_dynamic")
    assert toy_card("toy-lm").precision.allowed_paths == ("native",)


def test_card_validation_names_what_is_inconsistent(card: ModelCard) -> None:
    contract = PrecisionPathContract(path="fp8_weights", min_psnr_db=30)
    with pytest.raises(ValidationError, match="fp8_targets names none"):
        PrecisionContract(default="fp32", supported=frozenset({"fp32"}), paths={"fp8_weights": contract})
    with pytest.raises(ValidationError, match="must equal its key"):
        PrecisionContract(default="fp32", supported=frozenset({"fp32"}), paths={"fp8_dynamic": contract},
                          fp8_targets={"dit": ("blocks.*.o",)})
    with pytest.raises(ValidationError, match="fp8_targets names unknown components"):
        with_precision(card, fp8_targets={"transformer": ("blocks.*.o",)})
    data = card.model_dump()
    data["recipe"]["assumes_precision"] = "fp8_all"  # a path the card does not list
    with pytest.raises(ValidationError, match="precision.paths does not list"):
        ModelCard.model_validate(data)
    with pytest.raises(ValidationError):  # not a path at all
        PrecisionPathContract(path="native", min_psnr_db=30)  # type: ignore[arg-type]


def test_fp8_targets_resolve_to_the_matching_linears(card: ModelCard) -> None:
    dit = ToyDiT()
    layers = len(dit.blocks)
    expected = [f"blocks.{i}.{name}" for i in range(layers) for name in ("qkv", "o", "q2", "kv2", "o2", "mlp.0", "mlp.2")]
    assert fp8_target_paths(card, "dit", dit) == expected
    assert fp8_target_paths(card, "decoder", nn.Linear(2, 2)) == []  # no globs for it: nothing targeted


def test_a_glob_matching_no_linear_is_a_typed_error(card: ModelCard) -> None:
    renamed = with_precision(card, fp8_targets={"dit": ("blocks.*.qkv", "blocks.*.attn.to_q")})
    with pytest.raises(InvalidRequest) as info:
        fp8_target_paths(renamed, "dit", ToyDiT())
    assert info.value.param == "precision.fp8_targets" and "blocks.*.attn.to_q" in info.value.message
    assert "blocks.0.qkv" in str(info.value.allowed)  # it shows what the linears are called


# --------------------------------------------------------------------------- asking for a path


def test_a_path_the_card_does_not_list_names_precision_path_and_the_allowed_paths(card: ModelCard) -> None:
    with pytest.raises(InvalidRequest) as info:
        build_instance(card, InstanceOptions(precision_path="fp8_all"))
    assert info.value.param == "precision_path"
    assert info.value.allowed == "native, fp8_weights, fp8_dynamic"
    with pytest.raises(InvalidRequest, match="precision_path"):
        build_instance(toy_card("toy-lm"), InstanceOptions(precision_path="fp8_weights"))
    with pytest.raises(ValidationError):
        InstanceOptions(precision_path="fp8")  # type: ignore[arg-type]


def test_the_default_is_the_cards_own_path(card: ModelCard) -> None:
    instance = build_instance(card)
    assert instance.precision_path == "native" and instance.precision_selection is not None
    assert not any(isinstance(m, Fp8Linear) for m in instance.component("dit").modules())


@pytest.mark.parametrize("path, mode", [("fp8_weights", "fp8_weights"), ("fp8_dynamic", "fp8_dynamic")])
def test_a_linear_path_quantizes_the_targets_at_load_and_nothing_else(card: ModelCard, path: str, mode: str) -> None:
    instance = build_instance(card, InstanceOptions(precision_path=path))
    assert instance.precision_path == path
    dit = instance.component("dit")
    targets = set(fp8_target_paths(card, "dit", dit))
    for name, module in dit.named_modules():
        if name in targets:
            assert isinstance(module, Fp8Linear) and module.mode == mode, name
            assert module.weight.dtype == torch.float8_e4m3fn and module.weight_scale.shape == (module.out_features,)
    for native in ("proj_in", "time.0", "time.2", "proj_out"):
        assert type(dit.get_submodule(native)) is nn.Linear
    # The other components of the card are not touched.
    assert not any(isinstance(m, Fp8Linear) for m in instance.component("lm").modules())


def test_each_path_keeps_its_contract_on_toy_dit(card: ModelCard) -> None:
    """The toy card's own contracts hold for what its paths produce over three seeds (the numbers are measurements)."""
    seeds = (3, 4, 5)
    native = [video(card, InstanceOptions(), seed=seed) for seed in seeds]
    for path, contract in card.precision.paths.items():
        got = [video(card, InstanceOptions(precision_path=path), seed=seed) for seed in seeds]
        assert not any(torch.equal(g, n) for g, n in zip(got, native))  # the path ran: fp8 is not the native result
        m = measured(path, psnr=tuple(psnr(g, n) for g, n in zip(got, native)))
        assert contract.check(m, model_id="toy-dit", precision="fp32", defaults=card.capabilities.defaults).passed, m.psnr_db


def test_apply_precision_path_leaves_native_and_attention_paths_alone(card: ModelCard) -> None:
    dit = ToyDiT()
    assert apply_precision_path(card, "dit", dit, "native") == [] and apply_precision_path(card, "dit", dit, "fp8_attention") == []
    assert not any(isinstance(m, Fp8Linear) for m in dit.modules())
    with pytest.raises(InvalidRequest, match="precision_path"):
        apply_precision_path(card, "dit", dit, "fp8")


def test_an_explicit_path_without_a_passing_measurement_runs_with_a_warning(card: ModelCard, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="fv.card"):
        instance = build_instance(card, InstanceOptions(precision_path="fp8_weights"))
    assert instance.precision_path == "fp8_weights"
    assert "outside its contract" in caplog.text and "no trajectory measurement" in caplog.text


# --------------------------------------------------------------------------- auto


def test_auto_selects_the_fastest_path_whose_measurement_passes(card: ModelCard, tmp_path: Path) -> None:
    compute = recorded(tmp_path, measured("fp8_weights", step=1.5e-3), measured("fp8_dynamic", step=1e-3))
    instance = build_instance(card, InstanceOptions(precision_path="auto", compute=compute))
    assert instance.precision_path == "fp8_dynamic"
    assert isinstance(instance.component("dit").get_submodule("blocks.0.qkv"), Fp8Linear)
    slower = recorded(tmp_path, measured("fp8_weights", step=1e-3), measured("fp8_dynamic", step=1.5e-3))
    assert select_precision_path(card, InstanceOptions(precision_path="auto", compute=slower)).path == "fp8_weights"


def test_auto_does_not_select_a_path_whose_measurement_fails(card: ModelCard, tmp_path: Path) -> None:
    # Negative control: the same record with the PSNR above the floor selects it.
    passing = recorded(tmp_path, measured("fp8_dynamic", psnr=40.5))
    assert select_precision_path(card, InstanceOptions(precision_path="auto", compute=passing)).path == "fp8_dynamic"
    failing = recorded(tmp_path, measured("fp8_dynamic", psnr=39.5))
    selection = select_precision_path(card, InstanceOptions(precision_path="auto", compute=failing))
    assert selection.path == "native" and not selection.verdicts["fp8_dynamic"].passed
    assert "below the contract's 40 dB" in selection.reason
    assert build_instance(card, InstanceOptions(precision_path="auto", compute=failing)).precision_path == "native"


@pytest.mark.parametrize("measurement, why", [
    (None, "nothing recorded"),
    (dict(device="cuda"), "timed on another device type"),
    (dict(step=2e-3), "not faster than native"),
    (dict(step=None), "not timed"),
    (dict(steps=2), "not the full trajectory"),
    (dict(psnr=float("nan")), "NaN"),
])
def test_auto_stays_native_without_a_passing_faster_measurement(card: ModelCard, tmp_path: Path, measurement: Any, why: str) -> None:
    compute = recorded(tmp_path, *([] if measurement is None else [measured("fp8_dynamic", **measurement)]))
    assert select_precision_path(card, InstanceOptions(precision_path="auto", compute=compute)).path == "native", why


def test_a_judge_bound_fails_a_path_whose_scores_move_more_than_n_points() -> None:
    contract = PrecisionPathContract(path="fp8_dynamic", min_psnr_db=30, max_judge_delta=2.0)
    native = {"colour": 80.0, "direction": 60.0}

    def verdict(scores: dict[str, float] | None, native_scores: dict[str, float] | None = native) -> bool:
        m = measured(judge=scores, native_judge=native_scores)
        return contract.check(m, model_id="toy-dit", precision="fp32", defaults=None).passed

    assert verdict({"colour": 78.5, "direction": 61.9})
    assert not verdict({"colour": 77.9, "direction": 60.0})  # 2.1 points of colour lost
    assert not verdict({"colour": 80.0})  # direction not scored on the path
    assert not verdict(None, None)  # the contract needs the judge; the measurement has none
    # Without a judge bound, scores are not read.
    assert PrecisionPathContract(path="fp8_dynamic", min_psnr_db=30).check(
        measured(judge={"colour": 0.0}, native_judge=native), model_id="toy-dit", precision="fp32", defaults=None).passed


def test_the_record_keeps_tier_and_path_measurements_side_by_side(tmp_path: Path) -> None:
    record = TierParityRecord(precision_paths=(measured("fp8_dynamic", psnr=41.0), measured("fp8_weights")))
    record = record.merged_paths([measured("fp8_dynamic", psnr=44.0)])
    assert len(record.precision_paths) == 2 and record.find_path("fp8_dynamic", "toy-dit", "fp32").psnr_db == 44.0
    assert record.merged([]).precision_paths == record.precision_paths  # merging tiers keeps the paths
    file = tmp_path / "r.json"
    file.write_text(record.model_copy(update={"precision_paths": (measured(psnr=math.inf),)}).model_dump_json())
    loaded = load_parity_record(file).find_path("fp8_dynamic", "toy-dit", "fp32")
    assert [s.psnr_db for s in loaded.samples] == [math.inf] * 3  # kept as measured
    assert loaded.psnr_db == IDENTICAL_CLIP_PSNR_DB  # and counted as 150 dB in the statistics


# --------------------------------------------------------------------------- the statistical floor


def test_the_floor_is_on_the_95_percent_lower_bound_of_the_mean_psnr() -> None:
    """Every sample at or above the floor passes; below it, the mean's 95% lower bound must hold the floor. Negative
    control: the same mean (42 dB, floor 40) with one sample below passes when the samples are close together and
    fails when they are spread too wide to tell. The bound is mean - t(0.95, n-1) * sd / sqrt(n), from its definition."""
    contract = PrecisionPathContract(path="fp8_dynamic", min_psnr_db=40)

    def verdict(values: tuple[float, ...]) -> PrecisionPathVerdict:
        return contract.check(measured(psnr=values), model_id="toy-dit", precision="fp32", defaults=None)

    assert verdict((40.0, 70.0, 100.0)).passed and "every sample >= 40 dB" in verdict((40.0, 70.0, 100.0)).reason
    # One unlucky seed: mean 42.0, sd 1.0807 over 6; bound 42 - 2.015048 * 1.0807 / sqrt(6) = 41.1109.
    unlucky = verdict((39.8, 42.4, 42.4, 42.4, 42.4, 42.6))
    assert unlucky.passed and "95% lower bound 41.11 dB" in unlucky.reason, unlucky.reason
    wide = (36.0, 42.0, 48.0)
    # t(0.95, 2) = 2.919986; sd 6; bound 42 - 2.919986 * 6 / sqrt(3) = 31.885
    failed = verdict(wide)
    assert not failed.passed and "95% lower bound 31.88 dB" in failed.reason and "sd 6.00" in failed.reason
    assert "worst sample 36.00 dB at seed 0, prompt 'a red fox'" in failed.reason  # the clip to reproduce first
    # An identical clip counts as 150 dB, not as an infinity that would carry any mean.
    assert verdict((math.inf, 41.0, 41.0)).passed
    assert not verdict((math.inf, 20.0, 20.0)).passed
    assert not verdict((math.nan, 45.0, 45.0)).passed


def test_a_record_with_fewer_samples_than_the_contract_needs_is_not_judged(tmp_path: Path) -> None:
    """A record from before samples were kept (one pooled psnr_db) still loads, as one sample, and is not judged: the
    reason names 'samples' and how many seeds the contract needs."""
    old = measured(psnr=60.0).model_dump(mode="json")
    del old["samples"]
    old["psnr_db"] = 60.0
    file = tmp_path / "old.json"
    file.write_text(json.dumps({"precision_paths": [old]}))
    loaded = load_parity_record(file).find_path("fp8_dynamic", "toy-dit", "fp32")
    assert loaded is not None and [s.psnr_db for s in loaded.samples] == [60.0]
    verdict = PrecisionPathContract(path="fp8_dynamic", min_psnr_db=40).check(
        loaded, model_id="toy-dit", precision="fp32", defaults=None)
    assert not verdict.passed and "1 sample(s) in 'samples'" in verdict.reason and "at least 3 seeds" in verdict.reason
    with pytest.raises(ValidationError, match="not both"):
        PrecisionPathMeasurement.model_validate({**old, "samples": [{"psnr_db": 60.0}]})
    with pytest.raises(ValidationError, match="min_samples"):
        PrecisionPathContract(path="fp8_dynamic", min_psnr_db=40, min_samples=1)


# --------------------------------------------------------------------------- recipes that assume a path


def test_a_qat_card_deploys_on_its_path_and_refuses_another(card: ModelCard, tmp_path: Path) -> None:
    qat = qat_card(card)
    assert build_instance(qat).precision_path == "fp8_dynamic"
    # auto does not second-guess the recipe, even with a faster passing path recorded.
    compute = recorded(tmp_path, measured("fp8_weights", step=1e-4))
    assert build_instance(qat, InstanceOptions(precision_path="auto", compute=compute)).precision_path == "fp8_dynamic"
    for other in ("native", "fp8_weights"):
        with pytest.raises(RecipeMismatch) as info:
            build_instance(qat, InstanceOptions(precision_path=other))
        assert info.value.param == "precision_path" and "fp8_dynamic" in info.value.message
        assert "override_recipe" in info.value.message


def test_an_overridden_qat_card_runs_the_asked_path_and_says_so(card: ModelCard) -> None:
    instance = build_instance(qat_card(card), InstanceOptions(precision_path="native", allow_recipe_mismatch=True))
    assert instance.precision_path == "native" and instance.recipe_overrides == ("precision_path",)
    assert build_instance(qat_card(card)).recipe_overrides == ()


# --------------------------------------------------------------------------- fp8 attention


def test_an_fp8_attention_path_runs_the_fp8_attention_driver(card: ModelCard) -> None:
    listed = with_precision(card, paths={
        **{k: v.model_dump() for k, v in card.precision.paths.items()},
        "fp8_attention": {"path": "fp8_attention", "min_psnr_db": 30.0},
        "fp8_all": {"path": "fp8_all", "min_psnr_db": 30.0},
    })
    assert build_instance(listed, InstanceOptions(precision_path="fp8_attention")).options.attention_backend == "fp8"
    fp8_all = build_instance(listed, InstanceOptions(precision_path="fp8_all"))
    assert fp8_all.options.attention_backend == "fp8" and fp8_all.precision_path == "fp8_all"
    assert isinstance(fp8_all.component("dit").get_submodule("blocks.0.o"), Fp8Linear)
    assert build_instance(listed, InstanceOptions(precision_path="fp8_dynamic")).options.attention_backend == "sdpa"
    with pytest.raises(InvalidRequest) as info:
        build_instance(listed, InstanceOptions(precision_path="fp8_attention", attention_backend="vsa"))
    assert info.value.param == "precision_path" and "'vsa'" in info.value.message


# --------------------------------------------------------------------------- deploy config, fv.load, CLI


def test_deploy_config_cards_take_a_precision_path(tmp_path: Path, fv_host: PluginHost) -> None:
    file = tmp_path / "card.json"
    file.write_text(toy_card("toy-dit").model_dump_json())
    config = DeployConfig(cards=[CardDeployment(model=str(file), precision_path="fp8_weights")])
    assert resolve_model(str(file), config, fv_host).options.precision_path == "fp8_weights"
    assert resolve_model(str(file), config, fv_host, precision_path="auto").options.precision_path == "auto"  # the flag wins
    with pytest.raises(InvalidRequest) as info:
        resolve_model(str(file), config, fv_host, precision_path="fp8")
    assert info.value.param == "precision_path"
    bad = tmp_path / "deploy.yaml"
    bad.write_text(f"cards:\n  - model: {file}\n    precision_path: fp16\n")
    with pytest.raises(DeployConfigError, match="precision_path"):
        load_deploy_config(bad)


def test_fv_load_takes_a_precision_path(tmp_path: Path, fv_host: PluginHost) -> None:
    file = tmp_path / "toy-dit.json"
    file.write_text(toy_card("toy-dit").model_dump_json())
    gen = fv.load(str(file), host=fv_host, precision_path="fp8_dynamic")
    assert gen.instance.precision_path == "fp8_dynamic"
    assert isinstance(gen.instance.component("dit").get_submodule("blocks.1.mlp.2"), Fp8Linear)
    with pytest.raises(InvalidRequest, match="precision_path"):
        fv.load(str(file), host=fv_host, precision_path="fp8_all")


def test_fv_generate_precision_path_flag(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from fv_kernel.cli.app import app

    file = tmp_path / "toy-dit.json"
    file.write_text(toy_card("toy-dit").model_dump_json())
    out = tmp_path / "v.mp4"
    args = ["generate", "--model", str(file), "--prompt", "a red fox", "-q", "--output", str(out)]
    bad = CliRunner().invoke(app, [*args, "--precision-path", "fp8_all"])
    assert bad.exit_code == 2 and "precision_path" in bad.output and "native, fp8_weights, fp8_dynamic" in bad.output
    assert not out.exists()
    ok = CliRunner().invoke(app, [*args, "--precision-path", "fp8_weights"])
    assert ok.exit_code == 0, ok.output
    assert out.stat().st_size > 0 and "precision path:" not in ok.output
    auto = CliRunner().invoke(app, [*args, "--precision-path", "auto"])
    assert auto.exit_code == 0, auto.output
    assert "precision path: native (auto: native (precision path 'fp8_weights' of card 'toy-dit' at fp32: no trajectory" in auto.output


def test_load_into_keeps_stored_fp8_weights_and_scales() -> None:
    linear = Fp8Linear.from_linear(nn.Linear(4, 3))
    module = nn.Sequential(Fp8Linear(4, 3))
    load_into(module, {f"0.{k}": v for k, v in linear.state_dict().items()}, component="x", dtype=torch.bfloat16)
    assert module[0].weight.dtype == torch.float8_e4m3fn and module[0].weight_scale.dtype == torch.float32
    assert torch.equal(module[0].weight.float(), linear.weight.float())
    assert module[0].bias.dtype == torch.bfloat16  # everything else is cast as before


def test_a_lora_on_an_fp8_component_applies_per_row(tmp_path: Path, fv_host: PluginHost) -> None:
    from fv_kernel.testing.adapters import peft_lora_tensors, write_peft_lora
    from fv_kernel.testing.toy import build_component

    file = tmp_path / "toy-dit.json"
    file.write_text(toy_card("toy-dit").model_dump_json())
    on_dit = write_peft_lora(tmp_path / "dit.safetensors", peft_lora_tensors(build_component("dit", 1), "dit", ["blocks.0.o"]))
    fp8 = fv.load(str(file), host=fv_host, precision_path="fp8_weights")
    assert "dit" in fp8.instance.fp8_linear_components
    plain, adapted = fp8.generate("a red fox").frames, fp8.generate("a red fox", loras=[on_dit]).frames
    assert not torch.equal(plain, adapted)  # the LoRA changes the fp8 component's output
    native = fv.load(str(file), host=fv_host)
    native_adapted = native.generate("a red fox", loras=[on_dit]).frames
    # The LoRA moves the fp8 path as it moves the native one: the update is computed from the same activations.
    moved, native_moved = (adapted - plain).abs().mean(), (native_adapted - native.generate("a red fox").frames).abs().mean()
    assert abs(moved - native_moved) < 0.25 * native_moved, (moved, native_moved)


class _AlwaysMerge:
    """A merge gate that says every stack pays to merge (what a long run of one stack earns)."""

    allow_merge = True

    def should_merge(self, *args: Any) -> bool:
        return True

    def note_mixed(self, *args: Any) -> None:
        pass

    def note_transition(self, *args: Any) -> None:
        pass


def test_an_fp8_component_routes_its_lora_per_row_even_where_a_merge_would_pay(tmp_path: Path, fv_host: PluginHost) -> None:
    from fv_kernel.testing.adapters import peft_lora_tensors, write_peft_lora
    from fv_kernel.testing.toy import build_component

    file = tmp_path / "toy-dit.json"
    file.write_text(toy_card("toy-dit").model_dump_json())
    lora = write_peft_lora(tmp_path / "dit.safetensors", peft_lora_tensors(build_component("dit", 1), "dit", ["blocks.0.o"]))
    for path, merges in (("fp8_weights", False), ("native", True)):  # native: the control, where it merges
        model = fv.load(str(file), host=fv_host, precision_path=path)
        model.generate("a red fox", loras=[lora])  # registers and stages the adapter
        instance = model.instance
        (info,) = instance.adapters.list()
        instance.adapters.load(info.version, instance.device)
        inputs = {"adapter_ids": torch.tensor([[instance.adapters.id_of(info.version)]]),
                  "adapter_scales": torch.tensor([[1.0]])}
        instance.merge_gate = _AlwaysMerge()  # type: ignore[assignment]
        try:
            routing = instance.row_adapters(inputs, "dit")
        finally:
            instance.merge_gate = None
            instance.unmerge_all()
        assert (routing is None) is merges, path
    # A full delta on a parameter that is no linear's applies merged only: on the fp8 component, refused by name.
    from fv_kernel.compute.lora import AdapterError, AdapterWeights

    fp8_instance = fv.load(str(file), host=fv_host, precision_path="fp8_weights")
    fp8_instance.generate("a red fox", loras=[lora])
    instance = fp8_instance.instance
    instance.components["dit"].register_parameter("gain", nn.Parameter(torch.ones(3)))
    instance.adapters.weights = lambda *args: AdapterWeights("gain-delta", "dit", deltas={"gain": torch.ones(3)})
    (info,) = instance.adapters.list()
    inputs = {"adapter_ids": torch.tensor([[instance.adapters.id_of(info.version)]]), "adapter_scales": torch.tensor([[1.0]])}
    with pytest.raises(AdapterError, match="'gain-delta' has full deltas on gain, which apply merged only, and 'dit'"):
        instance.row_adapters(inputs, "dit")


def _adapter_on(linear: nn.Module, *, rank: int = 4, scale: float = 0.5) -> Any:
    from fv_kernel.compute.lora import AdapterWeights, LowRankUpdate

    gen = torch.Generator().manual_seed(3)
    down = torch.randn(rank, linear.in_features, generator=gen) * 0.2
    up = torch.randn(linear.out_features, rank, generator=gen) * 0.2
    return AdapterWeights(name="l", component="c", low_rank={"lin": LowRankUpdate(down=down, up=up, alpha=rank * scale)}), down, up


@pytest.mark.parametrize("mode", ["fp8_weights", "fp8_dynamic"])
def test_an_fp8_linears_rows_get_each_their_own_lora_update_from_the_activations(mode: str) -> None:
    from fv_kernel.compute.fp8 import takes_quantized_rows
    from fv_kernel.compute.lora import RowAdapters, rows_adapted

    torch.manual_seed(0)
    root = nn.Module()
    root.lin = Fp8Linear.from_linear(nn.Linear(32, 48), mode=mode, kernel="torch")
    adapter, down, up = _adapter_on(root.lin)
    x = torch.randn(3, 5, 32)
    base = root.lin(x)
    routing = RowAdapters.from_stacks([((adapter, 1.0),), (), ((adapter, 2.0),)])
    with rows_adapted(root, routing):
        assert not takes_quantized_rows(root.lin)  # a hooked linear reads the activations, not their e4m3 rows
        got = root.lin(x)
    assert takes_quantized_rows(root.lin) is (mode == "fp8_dynamic")
    # The reference, in fp64 and apart from the kernels: the base output plus strength x scale x (x A^T) B^T.
    delta = (x.double() @ down.double().t()) @ up.double().t() * 0.5
    for row, strength in enumerate((1.0, 0.0, 2.0)):
        want = base[row].double() + strength * delta[row]
        assert torch.allclose(got[row].double(), want, atol=1e-5, rtol=1e-5), row


def test_a_lora_never_merges_into_an_fp8_linear() -> None:
    from fv_kernel.compute.lora import AdapterError, merge_adapters

    root = nn.Module()
    root.lin = Fp8Linear.from_linear(nn.Linear(32, 48), mode="fp8_weights", kernel="torch")
    adapter, _, _ = _adapter_on(root.lin)
    weight = root.lin.weight.clone()
    with pytest.raises(AdapterError, match="lin is an fp8 linear"):
        merge_adapters(root, ((adapter, 1.0),))
    assert torch.equal(root.lin.weight.view(torch.uint8), weight.view(torch.uint8))


def test_auto_on_a_card_without_paths_is_native_and_says_why() -> None:
    selection = select_precision_path(toy_card("toy-lm"), InstanceOptions(precision_path="auto"))
    assert selection.path == "native" and "lists no precision path" in selection.reason


def test_the_conformance_kit_catches_a_loader_that_skips_the_path(monkeypatch: pytest.MonkeyPatch) -> None:
    from fv_kernel.testing import CardConformance
    from fv_kernel.testing import toy

    class Kit(CardConformance):
        card_ids = ["toy-dit"]

        def load_card(self, model_id: str) -> ModelCard:
            return toy_card(model_id)

    Kit().test_precision_paths_quantize_their_targets()
    monkeypatch.setattr(toy, "apply_precision_path", lambda *args, **kwargs: [])
    with pytest.raises(AssertionError, match="must call apply_precision_path"):
        Kit().test_precision_paths_quantize_their_targets()
