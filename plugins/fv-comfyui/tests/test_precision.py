"""``UNETLoader.weight_dtype`` → fv precision paths (docs/comfyui.md, "weight_dtype and precision paths").

``default``: the file's own (None: the deployment's path); ``fp8_e4m3fn``: ``fp8_weights``;
``fp8_e4m3fn_fast``: ``fp8_dynamic``; ``fp8_e5m2`` and paths the card's contract does not list are
refused on the loader's ``weight_dtype``, naming the values that would run. The job carries the path to
the instance (``fv.load(..., precision_path=)``, ``fv generate --precision-path``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import load_api, load_pair, retarget
from fv_kernel.api import ModelCard, PrecisionPathContract, load
from fv_comfyui import run as run_module
from fv_comfyui.run import JobRunner
from test_equivalence import one_thread  # noqa: F401 - both sides on one thread

T2V = "text_to_video_wan"  # one UNETLoader (#37) on wan-tiny
A14B = "wan22_14B_t2v_fp8"  # two UNETLoaders (#37 high noise, #56 low noise) on wan-tiny-a14b


def _with_paths(card: ModelCard, *paths: str) -> ModelCard:
    contracts = {path: PrecisionPathContract(path=path, min_psnr_db=20.0) for path in paths}
    return card.model_copy(update={"precision": card.precision.model_copy(update={"paths": contracts})})


def service_with_paths(service: Any, *paths: str, served: dict[str, str] | None = None) -> Any:
    """The session's service over the tiny cards, each allowing exactly ``paths`` beyond native."""
    cards = {card_id: _with_paths(card, *paths) for card_id, card in service.cards.items()}
    return dataclasses.replace(service, cards=cards, served_paths=served)


def _prompt(name: str, *dtypes: str) -> dict[str, Any]:
    prompt = retarget(load_pair(name)[1] if name == T2V else load_api(name), steps=2)
    loaders = [node for node, value in prompt.items() if value["class_type"] == "UNETLoader"]
    for loader, dtype in zip(sorted(loaders, key=int), dtypes, strict=True):
        prompt[loader]["inputs"]["weight_dtype"] = dtype
    return prompt


def _error(answer: Any, node: str) -> dict[str, Any]:
    assert not answer.ok, answer.body()
    (error,) = answer.node_errors[node]["errors"]
    assert error["type"] == "custom_validation_failed" and error["extra_info"] == {"input_name": "weight_dtype"}
    return error


@pytest.mark.parametrize(("dtype", "path"), [("default", None), ("fp8_e4m3fn", "fp8_weights"),
                                             ("fp8_e4m3fn_fast", "fp8_dynamic")])
@pytest.mark.parametrize("name", [T2V, A14B])
def test_each_weight_dtype_runs_its_path(name: str, dtype: str, path: str | None, service: Any) -> None:
    check = service_with_paths(service, "fp8_weights", "fp8_dynamic")
    answer = check.check(_prompt(name, *[dtype] * (2 if name == A14B else 1)))
    assert answer.ok, answer.body()
    (job,) = answer.jobs
    assert job.precision_path == path
    args = job.fv_generate_args(job.card.model_id)
    if path is None:
        assert "--precision-path" not in args
    else:
        assert args[args.index("--precision-path") + 1] == path
    # Nothing but the path changes: the request is the one 'default' makes.
    (default,) = check.check(_prompt(name, *["default"] * (2 if name == A14B else 1))).jobs
    assert job.options == default.options
    assert job.request().model_dump(exclude={"request_id"}) == default.request().model_dump(exclude={"request_id"})


def test_fp8_e5m2_is_refused_naming_the_values_that_run(service: Any) -> None:
    error = _error(service_with_paths(service, "fp8_weights", "fp8_dynamic").check(_prompt(T2V, "fp8_e5m2")), "37")
    assert error["details"] == ("weight_dtype - fv: weight_dtype 'fp8_e5m2': fv has no e5m2 weights (its fp8 precision "
                                "paths store e4m3); on card 'wan-tiny' weight_dtype may be default, fp8_e4m3fn, "
                                "fp8_e4m3fn_fast")


@pytest.mark.parametrize(("paths", "dtype", "allowed", "may_be"), [
    ((), "fp8_e4m3fn", "native", "default"),
    ((), "fp8_e4m3fn_fast", "native", "default"),
    (("fp8_weights",), "fp8_e4m3fn_fast", "native, fp8_weights", "default, fp8_e4m3fn"),
    (("fp8_dynamic", "fp8_attention"), "fp8_e4m3fn", "native, fp8_dynamic, fp8_attention", "default, fp8_e4m3fn_fast"),
])
def test_a_path_the_card_does_not_allow_is_refused(paths: tuple[str, ...], dtype: str, allowed: str, may_be: str,
                                                   service: Any) -> None:
    answer = service_with_paths(service, *paths).check(_prompt(T2V, dtype))
    path = {"fp8_e4m3fn": "fp8_weights", "fp8_e4m3fn_fast": "fp8_dynamic"}[dtype]
    assert _error(answer, "37")["details"] == (
        f"weight_dtype - fv: weight_dtype {dtype!r} runs precision path {path!r}, which card 'wan-tiny' does not "
        f"allow (its precision paths: {allowed}); weight_dtype may be {may_be}")
    assert answer.status == 400 and answer.jobs == []


def test_the_two_experts_run_one_path(service: Any) -> None:
    check = service_with_paths(service, "fp8_weights", "fp8_dynamic")
    error = _error(check.check(_prompt(A14B, "fp8_e4m3fn", "fp8_e4m3fn_fast")), "56")
    assert error["details"] == (
        "weight_dtype - fv: fv runs both experts of card 'wan-tiny-a14b' at one precision path, and the loaders ask "
        "for different ones (UNETLoader #37 'fp8_e4m3fn' (fp8_weights), UNETLoader #56 'fp8_e4m3fn_fast' "
        "(fp8_dynamic)); give them one weight_dtype")
    error = _error(check.check(_prompt(A14B, "default", "fp8_e4m3fn")), "56")
    assert "UNETLoader #37 'default' (the file's own), UNETLoader #56 'fp8_e4m3fn' (fp8_weights)" in error["details"]


def test_a_served_card_runs_only_its_served_path(service: Any) -> None:
    served = service_with_paths(service, "fp8_weights", "fp8_dynamic", served={"wan-tiny": "fp8_weights"})
    assert served.check(_prompt(T2V, "fp8_e4m3fn")).jobs[0].precision_path == "fp8_weights"
    assert served.check(_prompt(T2V, "default")).jobs[0].precision_path is None  # the served instance as it is
    assert _error(served.check(_prompt(T2V, "fp8_e4m3fn_fast")), "37")["details"] == (
        "weight_dtype - fv: weight_dtype 'fp8_e4m3fn_fast' runs precision path 'fp8_dynamic', but this server serves "
        "card 'wan-tiny' at 'fp8_weights' (the deploy config's cards[].precision_path); weight_dtype may be default, "
        "fp8_e4m3fn")
    native = service_with_paths(service, "fp8_weights", served={"wan-tiny": "native"})
    assert "weight_dtype may be default" in _error(native.check(_prompt(T2V, "fp8_e4m3fn")), "37")["details"]


def test_the_runner_loads_the_card_at_the_jobs_path(service: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, dict[str, Any]]] = []

    def fake_load(model: str, **kwargs: Any) -> Any:
        calls.append((model, kwargs))
        return object()

    monkeypatch.setattr(run_module, "load", fake_load)
    check = service_with_paths(service, "fp8_weights", "fp8_dynamic")
    runner = JobRunner()
    for dtype in ("fp8_e4m3fn", "fp8_e4m3fn_fast", "default", "fp8_e4m3fn"):
        (job,) = check.check(_prompt(T2V, dtype)).jobs
        runner.generator(job.card.model_id, job.precision_path)
    # One generator per (card, path); default leaves the path to the deploy config.
    assert calls == [("wan-tiny", {"config": None, "precision_path": "fp8_weights"}),
                     ("wan-tiny", {"config": None, "precision_path": "fp8_dynamic"}),
                     ("wan-tiny", {"config": None})]


def test_a_recipe_that_assumes_a_path_runs_only_that_one(service: Any) -> None:
    check = service_with_paths(service, "fp8_weights", "fp8_dynamic")
    card = check.cards["wan-tiny"]
    qat = card.model_copy(update={"recipe": card.recipe.model_copy(update={"assumes_precision": "fp8_dynamic"})})
    check = dataclasses.replace(check, cards={**check.cards, "wan-tiny": qat})
    assert check.check(_prompt(T2V, "fp8_e4m3fn_fast")).jobs[0].precision_path == "fp8_dynamic"
    assert check.check(_prompt(T2V, "default")).jobs[0].precision_path is None  # the instance resolves the recipe's
    assert _error(check.check(_prompt(T2V, "fp8_e4m3fn")), "37")["details"] == (
        "weight_dtype - fv: weight_dtype 'fp8_e4m3fn' runs precision path 'fp8_weights', but card 'wan-tiny''s recipe "
        "assumes 'fp8_dynamic' (recipe.assumes_precision); weight_dtype may be default, fp8_e4m3fn_fast")


def test_fv_serve_refuses_a_path_its_instance_does_not_run(service: Any, host: Any, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("fastapi")
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from conftest import MODELS_FILE
    from fv_kernel.api import DeployConfig, Engine, InstanceOptions, PluginsConfig, build_instance
    from fv_comfyui.serving import mount
    from fv_comfyui.settings import MODELS_ENV

    monkeypatch.delenv(MODELS_ENV, raising=False)

    card = _with_paths(service.cards["wan-tiny"], "fp8_weights", "fp8_dynamic")
    engine = Engine()
    engine.add_instance(build_instance(card, InstanceOptions(precision_path="fp8_weights",
                                                             registry=host.registry())))
    app = FastAPI()
    config = DeployConfig(output_dir=tmp_path, plugins=PluginsConfig(settings={"fv-comfyui": {"models": str(MODELS_FILE)}}))
    server = mount(app, engine, config)
    assert server.service.served_paths == {"wan-tiny": "fp8_weights"}
    reply = TestClient(app).post("/prompt", json={"prompt": _prompt(T2V, "fp8_e4m3fn_fast")})
    assert reply.status_code == 400
    assert "this server serves card 'wan-tiny' at 'fp8_weights'" in reply.json()["node_errors"]["37"]["errors"][0]["details"]


@pytest.mark.parametrize(("name", "dtype", "path"), [(T2V, "fp8_e4m3fn", "fp8_weights"),
                                                     (A14B, "fp8_e4m3fn_fast", "fp8_dynamic")])
def test_an_fp8_workflow_equals_the_request_at_its_path(name: str, dtype: str, path: str, service: Any) -> None:
    """End to end on the installed tiny cards (their contracts list the fp8 paths): the workflow's
    frames are bit for bit ``fv.load(card, precision_path=path)``'s for the same request."""
    loaders = 2 if name == A14B else 1
    (job,) = service.check(_prompt(name, *[dtype] * loaders)).jobs
    assert job.precision_path == path
    runner = JobRunner()
    video = runner.run(job)
    reference = load(job.card.model_id, precision_path=path).generate(job.prompt, **job.options)
    assert torch.equal(video.frames, reference.frames), (video.frames - reference.frames).abs().max()
    # Negative control: the same workflow at 'default' runs the native path, and differs.
    (native,) = service.check(_prompt(name, *["default"] * loaders)).jobs
    assert native.precision_path is None
    assert not torch.equal(runner.run(native).frames, video.frames)


def test_default_runs_the_deploy_configs_path(service: Any) -> None:
    from fv_kernel.api import DeployConfig

    (job,) = service.check(_prompt(T2V, "default")).jobs
    config = DeployConfig.model_validate({"cards": [{"model": "wan-tiny", "precision_path": "fp8_weights"}]})
    video = JobRunner(config=config).run(job)
    reference = load("wan-tiny", precision_path="fp8_weights").generate(job.prompt, **job.options)
    assert torch.equal(video.frames, reference.frames)
    # Negative control: without the config's entry, default is native, and differs.
    assert not torch.equal(JobRunner().run(job).frames, video.frames)
