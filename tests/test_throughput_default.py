"""Batching that pays by default: ``batching: throughput`` is the default, and fuses where it is promised.

The executor fuses compatible steps of different requests into one call only for a card that
declares how far that may move a result at the instance's precision
(``ParitySpec.batched_vs_alone``), and never for a request that must be bit-identical to its
run alone (``Request.exact``). ``batching: exact`` fuses nothing that is not batch-invariant.
"""

from __future__ import annotations

import dataclasses

import pytest

from fv_kernel.api import (
    DeployConfig,
    DiffusionParams,
    Engine,
    ModelCard,
    Request,
    SchedulerConfig,
    TaskType,
    TextPart,
    build_instance,
    run_concurrently,
    run_serially,
)
from fv_kernel.testing import StepRecorder, assert_artifacts_identical
from fv_kernel.testing.toy import toy_card

PROMPTS = ("a red fox runs through snow", "a lighthouse at dusk waves", "a paper boat on a puddle")


def _requests(exact_index: int | None = None) -> list[Request]:
    return [
        Request(request_id=f"r{i}", model="toy-dit", task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text=p),),
                diffusion=DiffusionParams(seed=i), exact=i == exact_index)
        for i, p in enumerate(PROMPTS)
    ]


def _run(card: ModelCard, requests: list[Request], config: SchedulerConfig) -> tuple[list, StepRecorder]:
    engine = Engine(config)
    engine.add_instance(build_instance(card))
    recorder = StepRecorder()
    engine.observers.append(recorder)
    return run_concurrently(engine, requests), recorder


def _alone(card: ModelCard, request: Request) -> list:
    engine = Engine(SchedulerConfig(batching="exact"))
    engine.add_instance(build_instance(card))
    return run_serially(engine, [request])[0].artifacts


def _undeclared() -> ModelCard:
    card = toy_card("toy-dit")
    return card.model_copy(update={"parity": card.parity.model_copy(update={"batched_vs_alone": ()})})


def test_throughput_is_the_default_of_the_engine_and_of_the_deploy_config() -> None:
    assert SchedulerConfig().batching == "throughput"
    assert DeployConfig().scheduler.batching == "throughput"


def test_a_declaring_card_fuses_under_the_default() -> None:
    results, recorder = _run(toy_card("toy-dit"), _requests(), SchedulerConfig())
    assert all(r.status == "completed" for r in results)
    fused = [rec for rec in recorder.of_kind("diffusion_step") if sum(rec.fused) == len(PROMPTS)]
    assert fused, "three same-shape requests never shared one fused denoise call"


def test_a_card_that_declares_nothing_runs_unfused_and_bit_identical() -> None:
    card = _undeclared()
    results, recorder = _run(card, _requests(), SchedulerConfig())
    batched = [rec for rec in recorder.of_kind("diffusion_step") if rec.batch_size > 1]
    assert batched, "the requests still share executions (scheduling, admission, one batch)"
    assert not any(any(rec.fused) for rec in recorder.records)
    for request, result in zip(_requests(), results):
        assert_artifacts_identical(_alone(card, request), result.artifacts, what=request.request_id)


def test_an_exact_request_never_shares_a_fused_call_and_stays_bit_identical() -> None:
    card = toy_card("toy-dit")
    requests = _requests(exact_index=1)
    results, recorder = _run(card, requests, SchedulerConfig())
    steps = recorder.of_kind("diffusion_step")
    assert any(sum(rec.fused) == 2 for rec in steps), "the two other requests fuse"
    for rec in steps:
        for request_id, fused in zip(rec.request_ids, rec.fused):
            assert not (request_id == "r1" and fused), f"the exact request ran inside a fused call: {rec}"
    assert_artifacts_identical(_alone(card, requests[1]), results[1].artifacts, what="exact request")


def test_exact_mode_fuses_nothing_that_is_not_batch_invariant() -> None:
    results, recorder = _run(toy_card("toy-dit"), _requests(), SchedulerConfig(batching="exact"))
    assert all(r.status == "completed" for r in results)
    assert any(rec.batch_size > 1 for rec in recorder.records) and not any(any(rec.fused) for rec in recorder.records)


def test_exact_mode_still_fuses_a_batch_invariant_op() -> None:
    card = toy_card("toy-dit")
    instance = build_instance(card)
    inner = instance.ops_builder

    def invariant(inst):  # type: ignore[no-untyped-def]
        ops = dict(inner(inst))
        ops["decode_frame"] = dataclasses.replace(ops["decode_frame"], batch_invariant=True)
        return ops

    instance.ops_builder = invariant
    engine = Engine(SchedulerConfig(batching="exact"))
    engine.add_instance(instance)
    recorder = StepRecorder()
    engine.observers.append(recorder)
    run_concurrently(engine, _requests())
    assert {rec.op for rec in recorder.records if sum(rec.fused) > 1} == {"decode_frame"}


@pytest.mark.parametrize("batching", ["exact", "throughput"])
def test_batching_is_a_typed_choice(batching: str) -> None:
    assert SchedulerConfig(batching=batching).batching == batching  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="batching"):
        SchedulerConfig(batching="fast")  # type: ignore[arg-type]


def test_a_card_declares_one_batched_vs_alone_per_precision() -> None:
    from pydantic import ValidationError

    from fv_kernel.api import BatchedVsAlone, ParitySpec

    entry = BatchedVsAlone(precision="fp32", max_abs=1e-5, justification="measured")
    spec = ParitySpec(level="C1", reference="self", batched_vs_alone=(entry,))
    assert spec.batching_tolerance("fp32") == entry and spec.batching_tolerance("bf16") is None
    with pytest.raises(ValidationError, match="(?s)batched_vs_alone.*one batched_vs_alone entry per precision; fp32"):
        ParitySpec(level="C1", reference="self", batched_vs_alone=(entry, entry))
    with pytest.raises(ValidationError, match="max_abs"):
        BatchedVsAlone(precision="fp32", max_abs=-1.0, justification="measured")
    with pytest.raises(ValidationError, match="justification"):
        BatchedVsAlone(precision="fp32", max_abs=1e-5, justification="")


def test_the_engine_counts_fused_calls_by_how_many_requests_they_held() -> None:
    engine = Engine(SchedulerConfig())
    engine.add_instance(build_instance(toy_card("toy-dit")))
    recorder = StepRecorder()
    engine.observers.append(recorder)
    run_concurrently(engine, _requests(exact_index=0))
    expected: dict[int, int] = {}
    for rec in recorder.records:
        if sum(rec.fused) > 1:
            expected[sum(rec.fused)] = expected.get(sum(rec.fused), 0) + 1
    assert expected and engine.metrics.fused_calls_by_size == expected and 3 not in expected  # the exact one never fused


def test_an_undeclared_card_is_named_in_the_log_when_it_is_added(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    with caplog.at_level(logging.INFO, logger="fv.engine"):
        Engine(SchedulerConfig()).add_instance(build_instance(_undeclared()))
        Engine(SchedulerConfig()).add_instance(build_instance(toy_card("toy-dit")))
        Engine(SchedulerConfig(batching="exact")).add_instance(build_instance(_undeclared()))
    named = [r.getMessage() for r in caplog.records if "declares no parity.batched_vs_alone" in r.getMessage()]
    assert named == ["card 'toy-dit' declares no parity.batched_vs_alone at fp32: its steps run unfused (as under "
                     "batching: exact) unless an op is batch-invariant"]


def test_a_scoped_promise_names_its_ops_in_the_log_when_the_card_is_added(caplog: pytest.LogCaptureFixture) -> None:
    """What a scoped promise leaves unfused is said at deploy time; an unscoped promise needs no line."""
    import logging

    def with_promise(promise):  # type: ignore[no-untyped-def]
        card = toy_card("toy-dit")
        return card.model_copy(update={"parity": card.parity.model_copy(update={"batched_vs_alone": (promise,)})})

    scoped = with_promise(_promise(ops=("dit_forward",), text="may_diverge"))
    with caplog.at_level(logging.INFO, logger="fv.engine"):
        Engine(SchedulerConfig()).add_instance(build_instance(scoped))
        Engine(SchedulerConfig()).add_instance(build_instance(with_promise(_promise())))
        Engine(SchedulerConfig(batching="exact")).add_instance(build_instance(scoped))
    named = [r.getMessage() for r in caplog.records if "parity.batched_vs_alone at fp32 covers ops" in r.getMessage()]
    assert named == ["card 'toy-dit''s parity.batched_vs_alone at fp32 covers ops ['dit_forward'] (text may_diverge): "
                     "its other ops run unfused unless batch-invariant"]


def _promise(**fields: object):  # type: ignore[no-untyped-def]
    from fv_kernel.api import BatchedVsAlone

    return BatchedVsAlone(**{"precision": "fp32", "max_abs": 1e-6, "justification": "toy, measured on CPU", **fields})


def _scoped(*ops: str) -> ModelCard:
    card = toy_card("toy-dit")
    return card.model_copy(update={"parity": card.parity.model_copy(update={"batched_vs_alone": (_promise(ops=ops),)})})


def test_a_promise_scopes_its_ops_and_text_and_defaults_to_every_op_and_identical_text() -> None:
    from pydantic import ValidationError

    from fv_kernel.api import ParitySpec

    default = _promise()
    assert default.ops == () and default.text == "identical"
    assert default.covers("dit_forward") and default.covers("decode_frame")
    scoped = _promise(ops=("dit_forward",), text="may_diverge")
    assert scoped.covers("dit_forward") and not scoped.covers("decode_frame")
    assert ParitySpec(level="C1", reference="self", batched_vs_alone=(scoped,)).batching_tolerance("fp32") == scoped
    with pytest.raises(ValidationError, match=r"(?s)ops\n.*ops names \[''\]; each entry is an op's \(StepOp\) name"):
        _promise(ops=("dit_forward", ""))
    with pytest.raises(ValidationError, match=r"(?s)ops\n.*ops names \['dit_forward'\] more than once; give each op once"):
        _promise(ops=("dit_forward", "dit_forward"))
    with pytest.raises(ValidationError, match=r"(?s)text\n.*'identical' or 'may_diverge'"):
        _promise(text="close")


@pytest.mark.parametrize("covered, uncovered", [("dit_forward", "decode_frame"), ("decode_frame", "dit_forward")])
def test_a_promise_scoped_to_one_op_fuses_that_op_and_not_the_others(covered: str, uncovered: str) -> None:
    results, recorder = _run(_scoped(covered), _requests(), SchedulerConfig())
    assert all(r.status == "completed" for r in results)
    fused = {rec.op for rec in recorder.records if sum(rec.fused) > 1}
    batched = {rec.op for rec in recorder.records if rec.batch_size > 1}
    assert covered in fused, f"{covered} is covered and batched, yet never fused"
    assert uncovered in batched and uncovered not in fused, f"{uncovered} is outside the promise, yet fused"
    # The unscoped promise (today's meaning) fuses both.
    _, every = _run(toy_card("toy-dit"), _requests(), SchedulerConfig())
    assert {covered, uncovered} <= {rec.op for rec in every.records if sum(rec.fused) > 1}


def test_a_promise_for_an_op_the_instance_does_not_have_is_refused_typed() -> None:
    from fv_kernel.api import InvalidRequest
    from fv_kernel.runtime.executor import check_promised_ops

    instance = build_instance(_scoped("dit_forward", "dit_forwrd"))
    # Ops are built from the components loaded so far: with none loaded a name may still come, so no verdict.
    check_promised_ops(instance)
    with pytest.raises(InvalidRequest) as info:
        check_promised_ops(instance, every_op_built=True)
    assert info.value.param == "parity.batched_vs_alone.ops" and str(info.value).endswith("allowed: none (no op built yet)")
    instance.load_for_task(TaskType.TEXT_TO_VIDEO)  # every component of toy-dit
    with pytest.raises(InvalidRequest) as info:
        check_promised_ops(instance)
    assert str(info.value) == ("parity.batched_vs_alone.ops: card 'toy-dit' promises fused steps at fp32 for ops "
                               "['dit_forwrd'] that its instance does not have; allowed: decode_frame, dit_forward, "
                               "encode_text, lm_decode, lm_prefill")
    right = build_instance(_scoped("dit_forward"))
    right.load_for_task(TaskType.TEXT_TO_VIDEO)
    check_promised_ops(right)  # the real name passes
    # Through the engine: the requests whose steps would fuse fail with that error, none runs on a wrong promise.
    results, _ = _run(_scoped("dit_forwrd"), _requests(), SchedulerConfig())
    assert {r.status for r in results} == {"failed"}
    assert all(r.error is not None and r.error.param == "parity.batched_vs_alone.ops" for r in results)
