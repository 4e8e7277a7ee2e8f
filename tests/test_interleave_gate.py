"""The interleave gate proves itself: negative controls it must fail, and the old design they passed.

Each buggy card below is the toy card with one deliberate conditioning or RNG leak:

- a DiT op that memoizes the text context on the module (first writer wins);
- an encode op that parks the text context on the module for the DiT op (last writer wins);
- a stochastic denoise loop that keeps its noise generator on the (shared) loop object;
- a DiT op that runs every row of a fused batch at row 0's timestep (the throughput gate's);
- a decode op whose fused calls pick other tokens (the throughput gate's, for a promise's ``text``);
- a DiT op and a decode op that share one workspace (the lane gate's: only two device lanes show it).

The gate (varied requests, each checked against a run alone on a fresh instance) fails on
each. The design it replaced (one prompt for every request, reference run serially on the
shared instance) passed the two conditioning leaks: with one prompt, a smeared conditioning
is the right conditioning, and on a shared instance the reference smears too.
"""

from __future__ import annotations

import dataclasses
import re
import time
from pathlib import Path
from typing import Any, Callable, ClassVar, Mapping, Sequence

import pytest
import torch

from fv_kernel.model.options import InstanceOptions
from fv_kernel.model.instance import ModelInstance
from fv_kernel.loop.plan import StepOp
from fv_kernel.card.spec import BatchedVsAlone, ModelCard, RecipeSpec, SamplerBinding
from fv_kernel.model.validate import resolve_request
from fv_kernel.loop.plan import StepResult
from fv_kernel.loop.samplers import sampler_from_state
from fv_kernel.state import generator_from_state
from fv_kernel.request.request import DiffusionParams, Request, TextPart
from fv_kernel.request.types import TaskType
from fv_kernel.runtime.records import GenerationResult
from fv_kernel.runtime.engine import Engine, run_serially
from fv_kernel.runtime.scheduler import SchedulerConfig
from fv_kernel.testing import (
    GATE_NEGATIVE_PROMPTS,
    GATE_PROMPTS,
    InterleaveConformance,
    TextDivergedWarning,
    alternative_size,
    sample_requests,
)
from fv_kernel.testing.toy import DenoiseState, ToyDenoiseLoop, build_toy_instance, toy_card

ROOT = Path(__file__).resolve().parents[1]
HERE = __name__  # "module:attr" references below resolve through this test module

# --------------------------------------------------------------------------- buggy cards

TensorDict = Mapping[str, torch.Tensor]


def _wrap_ops(instance: ModelInstance, wrap: Callable[[ModelInstance, dict[str, StepOp]], dict[str, StepOp]]) -> ModelInstance:
    inner = instance.ops_builder
    instance.ops_builder = lambda inst: wrap(inst, dict(inner(inst)))
    return instance


def build_first_writer_instance(card: ModelCard, options: InstanceOptions) -> ModelInstance:
    """BUG (a): the DiT op memoizes the text context on the module; the first request's wins."""

    def wrap(instance: ModelInstance, ops: dict[str, StepOp]) -> dict[str, StepOp]:
        if "dit_forward" in ops:
            dit, plain = instance.components["dit"], ops["dit_forward"].fn

            def dit_forward(inputs: TensorDict, params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
                # "The context is the same at every step, so compute with it once": kept on the module.
                memo = getattr(dit, "memo_context", None)
                if memo is None or memo.shape != inputs["context"].shape:
                    dit.memo_context = memo = inputs["context"]
                return plain({**inputs, "context": memo}, params)

            ops["dit_forward"] = dataclasses.replace(ops["dit_forward"], fn=dit_forward)
        return ops

    return _wrap_ops(build_toy_instance(card, options), wrap)


def build_last_writer_instance(card: ModelCard, options: InstanceOptions) -> ModelInstance:
    """BUG (b): the encode op parks the text context on the module and the DiT op reads it back."""

    def wrap(instance: ModelInstance, ops: dict[str, StepOp]) -> dict[str, StepOp]:
        lm = instance.components["lm"]
        if "encode_text" in ops:
            plain_encode = ops["encode_text"].fn

            def encode_text(inputs: TensorDict, params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
                out = plain_encode(inputs, params)
                lm.parked_context = out["hidden"]  # rows: prompt, negative prompt
                return out

            ops["encode_text"] = dataclasses.replace(ops["encode_text"], fn=encode_text)
        if "dit_forward" in ops:
            plain_dit = ops["dit_forward"].fn

            def dit_forward(inputs: TensorDict, params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
                rows = inputs["x"].shape[0]  # cond (+ uncond): the parked rows in branch order
                return plain_dit({**inputs, "context": lm.parked_context[:rows]}, params)

            ops["dit_forward"] = dataclasses.replace(ops["dit_forward"], fn=dit_forward)
        return ops

    return _wrap_ops(build_toy_instance(card, options), wrap)


def build_shared_workspace_instance(card: ModelCard, options: InstanceOptions) -> ModelInstance:
    """BUG (f): the DiT and decode ops stage their input in one workspace kept on the instance ("saves an
    allocation per step"). One op at a time, each reads back what it wrote; two at once, on two device
    lanes, the later writer's rows replace the earlier one's."""

    def wrap(instance: ModelInstance, ops: dict[str, StepOp]) -> dict[str, StepOp]:
        workspace = instance.__dict__.setdefault("shared_workspace", torch.zeros(1 << 16))

        def staged(op: StepOp, key: str) -> StepOp:
            def run(inputs: TensorDict, params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
                tensor = inputs[key]
                flat = workspace[: tensor.numel()]
                flat.copy_(tensor.reshape(-1))
                time.sleep(0.02)  # the op's other work: long enough for the other lane's op to start
                return op.fn({**inputs, key: flat.view_as(tensor).clone()}, params)

            return dataclasses.replace(op, fn=run)

        for name, key in (("dit_forward", "x"), ("decode_frame", "z")):
            if name in ops:
                ops[name] = staged(ops[name], key)
        return ops

    return _wrap_ops(build_toy_instance(card, options), wrap)


class RngOnLoopDenoise(ToyDenoiseLoop):
    """BUG (c): a stochastic loop whose noise generator lives on the loop object, which every
    request on the instance shares (the last request to start re-seeds it for all)."""

    def init(self, request: Request, model: ModelInstance, ctx: Any) -> DenoiseState:
        state = super().init(request, model, ctx)
        self.generator = generator_from_state(state.rng_state)
        return state

    def advance(self, state: DenoiseState, result: StepResult) -> DenoiseState:
        sampler = sampler_from_state(state.sampler_state)
        policy = self._guidance()
        branches = policy.branches(state.guidance)
        velocity = policy.combine(dict(zip(branches, result.outputs["v"].split(1))), state.guidance, step_index=state.step)
        noise = None
        if sampler.needs_noise(state.sampler_state):
            noise = torch.randn(state.latents.shape, generator=self.generator, dtype=torch.float32)
        sampler_state, latents = sampler.step(state.sampler_state, velocity, state.latents, noise=noise)
        return state.model_copy(update={"latents": latents, "sampler_state": sampler_state, "step": state.step + 1})


def toy_with_factory(factory: str) -> ModelCard:
    return toy_card("toy-dit").model_copy(update={"factory": factory})


def toy_dmd_card(implementation: str = "fv_kernel.testing.toy:ToyDenoiseLoop") -> ModelCard:
    """toy-dit as a few-step stochastic recipe: DMD's SDE sampler (fresh noise every step but the
    last), 3 fixed steps the recipe assumes, no CFG."""
    card = toy_card("toy-dit")
    denoise = card.loops["denoise"].model_copy(update={
        "implementation": implementation, "guidance": "none", "config": {},
        "sampler": SamplerBinding(name="dmd", config={"denoising_timesteps": [1000, 757, 522]}, fixed_steps=3),
    })
    loops = {**{k: v for k, v in card.loops.items() if k != "denoise_unipc"}, "denoise": denoise}
    defaults = card.capabilities.defaults
    assert defaults is not None
    capabilities = card.capabilities.model_copy(
        update={"uses_guidance": False, "defaults": defaults.model_copy(update={"steps": 3, "guidance": 1.0})}
    )
    data = card.model_copy(update={
        "model_id": "toy-dmd", "loops": loops, "capabilities": capabilities,
        "recipe": RecipeSpec(method="dmd2", parents=("toy-dit",), assumes_loop="denoise"),
    }).model_dump()
    return ModelCard.model_validate(data)


# --------------------------------------------------------------------------- gates


class _Gate(InterleaveConformance):
    """The kit's gate on one card built by :attr:`card_factory`."""

    card_factory: ClassVar[Callable[[], ModelCard]]

    def load_card(self, model_id: str) -> ModelCard:
        card = type(self).card_factory()
        assert card.model_id == model_id
        return card


class _OldGateDesign:
    """The gate before issue 12: every request the same prompt and negative prompt at the
    card's default size and steps (only the seed changed), and as reference the same requests
    run one after another on one shared instance."""

    concurrency: ClassVar[int]

    def gate_requests(self, cards: Sequence[ModelCard], prefix: str) -> list[Request]:
        requests = []
        for card in cards:
            for task in (TaskType.TEXT_TO_IMAGE, TaskType.TEXT_TO_VIDEO):
                for seed in range(self.concurrency):
                    requests.append(Request(
                        request_id=f"{prefix}{card.model_id}-{task.value}-{seed}", model=card.model_id, task=task,
                        inputs=(TextPart(text="a red fox runs through snow"), TextPart(text="blurry", role="negative_prompt")),
                        diffusion=DiffusionParams(seed=seed),
                    ))
        return requests

    def reference_results(self, cards: Sequence[ModelCard], requests: Sequence[Request]) -> list[GenerationResult]:
        return run_serially(self.make_engine(cards), requests)  # type: ignore[attr-defined]

    def assert_requests_vary(self, cards: Sequence[ModelCard], requests: Sequence[Request]) -> None:
        """The old design did not vary its requests."""


class _SharedInstanceReference:
    """Today's varied requests, but the old reference: run serially on one shared instance."""

    def reference_results(self, cards: Sequence[ModelCard], requests: Sequence[Request]) -> list[GenerationResult]:
        return run_serially(self.make_engine(cards), requests)  # type: ignore[attr-defined]


def _gate(factory: Callable[[], ModelCard], *designs: type) -> InterleaveConformance:
    card_id = factory().model_id
    cls = type("Gate", (*designs, _Gate), {"card_ids": (card_id,), "card_factory": staticmethod(factory)})
    return cls()


def _fails(gate: InterleaveConformance) -> str:
    with pytest.raises(AssertionError) as info:
        gate.test_interleaved_equals_each_alone()
    return str(info.value)


FIRST_WRITER = lambda: toy_with_factory(f"{HERE}:build_first_writer_instance")  # noqa: E731
LAST_WRITER = lambda: toy_with_factory(f"{HERE}:build_last_writer_instance")  # noqa: E731
RNG_ON_LOOP = lambda: toy_dmd_card(f"{HERE}:RngOnLoopDenoise")  # noqa: E731
SHARED_WORKSPACE = lambda: toy_with_factory(f"{HERE}:build_shared_workspace_instance")  # noqa: E731
CONDITIONING_LEAKS = pytest.mark.parametrize("factory", [FIRST_WRITER, LAST_WRITER], ids=["first-writer", "last-writer"])
SMEAR = "interleaved vs alone on a fresh instance"


# --------------------------------------------------------------------------- the controls


@CONDITIONING_LEAKS
def test_the_gate_fails_a_conditioning_kept_on_the_module(factory: Callable[[], ModelCard]) -> None:
    assert SMEAR in _fails(_gate(factory))


@CONDITIONING_LEAKS
def test_the_old_gate_design_passed_a_conditioning_kept_on_the_module(factory: Callable[[], ModelCard]) -> None:
    _gate(factory, _OldGateDesign).test_interleaved_equals_each_alone()


def test_varied_requests_alone_catch_the_last_writer_but_the_first_writer_needs_the_fresh_reference() -> None:
    # Serially on a shared instance, a parked context is read right after it is written: correct.
    assert SMEAR.split(" on ")[0] in _fails(_gate(LAST_WRITER, _SharedInstanceReference))
    # A memo on the module smears the shared-instance reference the same way as the interleaved run
    # (the first request to reach the DiT is the first submitted in both), so only a fresh instance
    # per reference request exposes it.
    _gate(FIRST_WRITER, _SharedInstanceReference).test_interleaved_equals_each_alone()


def test_the_gate_fails_a_loop_that_keeps_its_rng_on_the_loop_object() -> None:
    assert SMEAR in _fails(_gate(RNG_ON_LOOP))
    # The old design caught this one too: its requests' seeds already differed.
    assert SMEAR in _fails(_gate(RNG_ON_LOOP, _OldGateDesign))


def test_a_stochastic_loop_with_its_rng_in_the_state_passes() -> None:
    _gate(toy_dmd_card).test_interleaved_equals_each_alone()


def test_the_correct_toy_card_passes() -> None:
    _gate(lambda: toy_card("toy-dit")).test_interleaved_equals_each_alone()


def test_a_denoise_loop_marked_unbatchable_is_exempt_from_the_batching_check() -> None:
    def unbatchable() -> ModelCard:
        card = toy_card("toy-dit")
        loops = {**card.loops, "denoise": card.loops["denoise"].model_copy(update={"batchable": False})}
        return card.model_copy(update={"loops": loops})

    _gate(unbatchable).test_interleaved_equals_each_alone()  # its steps run batch-of-1, by the card's word


# --------------------------------------------------------------------------- the gate's requests


def test_gate_requests_differ_in_everything_the_card_lets_vary() -> None:
    card = toy_card("toy-dit")
    requests = [resolve_request(card, r) for r in sample_requests(card, seeds=range(2), vary_size=True)]
    for task in (TaskType.TEXT_TO_IMAGE, TaskType.TEXT_TO_VIDEO):
        mine = [r for r in requests if r.task is task]
        assert len(mine) == 4
        for field in (lambda r: r.text("prompt"), lambda r: r.text("negative_prompt")):
            assert len({field(r) for r in mine}) == 4
        assert [r.diffusion.seed for r in mine] == [0, 1, 1000, 1001]
        assert {(r.diffusion.height, r.diffusion.width) for r in mine} == {(8, 8), (4, 8)}
        assert {r.diffusion.steps for r in mine} == {4, 5}
        assert {r.diffusion.guidance for r in mine} == {3.0, 4.0}
        for size in ((8, 8), (4, 8)):  # two requests per shape, so they can batch
            assert sum((r.diffusion.height, r.diffusion.width) == size for r in mine) == 2


def test_gate_prompts_batch_under_byte_tokenizers() -> None:
    # Equal byte lengths keep prompt-length shape signatures equal; no punctuation a family might strip.
    for texts in (GATE_PROMPTS, GATE_NEGATIVE_PROMPTS):
        assert len({len(t.encode()) for t in texts}) == 1
        assert all(re.fullmatch(r"[a-z ]+", t) for t in texts)
    assert len({p[:15] for p in GATE_PROMPTS}) == len(GATE_PROMPTS)  # distinct within the toy encoder's window


def test_gate_requests_respect_fixed_steps_and_no_guidance() -> None:
    card = toy_dmd_card()
    requests = sample_requests(card, seeds=range(2), steps=2, vary_size=True)
    assert {r.diffusion.steps for r in requests} == {None}  # the recipe's 3 steps, never asked otherwise
    assert {r.diffusion.guidance for r in requests} == {None}  # the card's 1.0: no CFG
    assert {resolve_request(card, r).diffusion.steps for r in requests} == {3}


def test_gate_requests_vary_steps_around_the_kits_steps() -> None:
    requests = sample_requests(toy_card("toy-dit"), seeds=range(2), steps=2)
    assert [r.diffusion.steps for r in requests] == [2, 3, 2, 3]


def test_alternative_size_is_valid_for_the_card() -> None:
    card = toy_card("toy-dit")  # 8x8, multiples of 4
    assert alternative_size(card) == (4, 8)

    def with_caps(**update: Any) -> ModelCard:
        return card.model_copy(update={"capabilities": card.capabilities.model_copy(update=update)})

    # Sides of one multiple cannot shrink; growing must stay within max_pixels.
    defaults = card.capabilities.defaults
    assert defaults is not None
    small = with_caps(defaults=defaults.model_copy(update={"height": 4, "width": 4}))
    assert alternative_size(small) == (8, 4)
    assert alternative_size(with_caps(defaults=small.capabilities.defaults, max_pixels=16)) is None
    size_free = with_caps(defaults=small.capabilities.defaults, max_pixels=16)
    assert {(r.diffusion.height, r.diffusion.width) for r in sample_requests(size_free, seeds=range(2), vary_size=True)} == {(None, None)}
    for request in sample_requests(card, seeds=range(2), vary_size=True):
        resolve_request(card, request)  # valid: multiples of spatial_multiple, within the card's limits


def test_image_to_video_requests_carry_an_image_of_their_size() -> None:
    card = toy_card("toy-dit")
    card = card.model_copy(update={"capabilities": card.capabilities.model_copy(
        update={"tasks": card.capabilities.tasks | {TaskType.IMAGE_TO_VIDEO}})})
    for request in sample_requests(card, seeds=range(2), vary_size=True):
        if request.task is TaskType.IMAGE_TO_VIDEO:
            resolved = resolve_request(card, request).diffusion
            assert tuple(request.part("image").image.shape) == (3, resolved.height, resolved.width)


def test_the_toy_gate_runs_twenty_requests() -> None:
    cards = [toy_card(m) for m in ("toy-dit", "toy-lm", "toy-omni")]
    assert len(InterleaveConformance().gate_requests(cards, "")) == 8 + 2 + 10


def test_text_generation_requests_vary_prompt_seed_and_length() -> None:
    requests = sample_requests(toy_card("toy-lm"), seeds=range(2), vary_size=True)
    assert len(requests) == 2  # no sizes in text generation
    assert len({r.text("prompt") for r in requests}) == 2
    assert [(r.ar.seed, r.ar.max_tokens) for r in requests if r.ar] == [(0, 4), (1, 5)]


def test_too_many_seeds_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="seeds: 5 requests per shape x 2 shapes"):
        sample_requests(toy_card("toy-dit"), seeds=range(5), vary_size=True)


def test_the_gate_refuses_requests_that_do_not_vary() -> None:
    class FlatSteps(_Gate):
        card_ids = ("toy-dit",)
        card_factory = staticmethod(lambda: toy_card("toy-dit"))

        def requests_for(self, card: ModelCard, **options: Any) -> list[Request]:
            requests = super().requests_for(card, **options)
            return [r.with_updates(diffusion=r.diffusion.model_copy(update={"steps": 2})) for r in requests]

    message = _fails(FlatSteps())
    assert "toy-dit: every text_to_image gate request has the same steps ([2])" in message and "steps = N" in message
    assert "(its recipe does not fix them)" in message


def _one_prompt(requests: Sequence[Request]) -> list[Request]:
    """Every request's prompt replaced by the first gate prompt."""
    return [
        r.with_updates(inputs=tuple(TextPart(text=GATE_PROMPTS[0]) if getattr(p, "role", None) == "prompt" else p for p in r.inputs))
        for r in requests
    ]


class _OldVaryCheck:
    """The varied-fields check before: a field had to vary wherever ``sample_requests`` itself varied it."""

    steps: ClassVar[int | None]

    def assert_requests_vary(self, cards: Sequence[ModelCard], requests: Sequence[Request]) -> None:
        for card in cards:
            kit = [resolve_request(card, r) for r in sample_requests(card, seeds=range(2), steps=self.steps, vary_size=True)]
            mine = [resolve_request(card, r) for r in requests if r.model == card.model_id]
            if len({r.text("prompt") for r in kit}) > 1 and len({r.text("prompt") for r in mine}) < 2:
                raise AssertionError(f"{card.model_id}: every gate request has the same prompt")


def test_the_gate_refuses_requests_that_share_one_prompt() -> None:
    class OnePrompt(_Gate):
        card_ids = ("toy-dit",)
        card_factory = staticmethod(lambda: toy_card("toy-dit"))

        def requests_for(self, card: ModelCard, **options: Any) -> list[Request]:
            return _one_prompt(super().requests_for(card, **options))

    message = _fails(OnePrompt())
    assert f"toy-dit: every text_to_image gate request has the same prompt (['{GATE_PROMPTS[0]}'])" in message


def test_the_varied_fields_are_decided_from_the_card_not_from_the_kits_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    # The kit's own request builder regresses to one prompt for every request: the gate's requests
    # and what the old check compared them against share it, so the old check passed them.
    from fv_kernel.testing import card_kit

    monkeypatch.setattr(card_kit, "GATE_PROMPTS", (GATE_PROMPTS[0],) * len(GATE_PROMPTS))
    cards = [toy_card("toy-dit"), toy_card("toy-lm")]
    old, new = _gate(lambda: cards[0], _OldVaryCheck), _gate(lambda: cards[0])
    requests = new.gate_requests(cards, "gate-")
    assert {r.text("prompt") for r in requests} == {GATE_PROMPTS[0]}
    old.assert_requests_vary(cards, requests)
    with pytest.raises(AssertionError, match="toy-dit: every text_to_image gate request has the same prompt"):
        new.assert_requests_vary(cards, requests)
    with pytest.raises(AssertionError, match="toy-lm: every text_generation gate request has the same prompt"):
        new.assert_requests_vary(cards[1:], requests)


def test_the_gate_requires_variation_only_where_the_card_allows_it() -> None:
    # No CFG and a recipe that fixes the steps (DMD): guidance, negative prompt and steps need not vary.
    card = toy_dmd_card()
    gate = _gate(toy_dmd_card)
    requests = gate.gate_requests([card], "gate-")
    flat = [r.with_updates(inputs=tuple(p for p in r.inputs if getattr(p, "role", None) != "negative_prompt")) for r in requests]
    gate.assert_requests_vary([card], flat)
    # One size only: the size need not vary either, but the seed still must.
    caps = card.capabilities
    assert caps.defaults is not None
    small = caps.defaults.model_copy(update={"height": 4, "width": 4})
    one_size = card.model_copy(update={"capabilities": caps.model_copy(update={"defaults": small, "max_pixels": 16})})
    assert alternative_size(one_size) is None
    same_seed = [r.with_updates(diffusion=r.diffusion.model_copy(update={"seed": 0})) for r in gate.requests_for(one_size, seeds=range(2))]
    with pytest.raises(AssertionError, match="every text_to_image gate request has the same seed"):
        gate.assert_requests_vary([one_size], same_seed)
    # Text generation: its length varies too.
    lm = toy_card("toy-lm")
    one_length = [r.with_updates(ar=r.ar.model_copy(update={"max_tokens": 4})) for r in sample_requests(lm, seeds=range(2)) if r.ar]
    with pytest.raises(AssertionError, match=r"toy-lm: every text_generation gate request has the same max_tokens \(\[4\]\)"):
        gate.assert_requests_vary([lm], one_length)


def test_the_gate_refuses_a_request_that_never_batched() -> None:
    class Lonely(_Gate):
        card_ids = ("toy-dit",)
        card_factory = staticmethod(lambda: toy_card("toy-dit"))

        def requests_for(self, card: ModelCard, **options: Any) -> list[Request]:
            requests = super().requests_for(card, **options)
            odd = requests[0].with_updates(
                request_id=f"{options['prefix']}odd-one", diffusion=requests[0].diffusion.model_copy(update={"frames": 5})
            )
            return [*requests, odd]

    assert re.search(r"\['gate-odd-one'\] never ran a denoise or token step batched with another request", _fails(Lonely()))


# --------------------------------------------------------------------------- docs


def test_conformance_doc_example_runs() -> None:
    text = (ROOT / "docs" / "conformance.md").read_text()
    [example] = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "class TestToyOmniGate" in b]
    namespace: dict[str, Any] = {"__name__": "conformance_doc_example"}
    exec(compile(example, "docs/conformance.md", "exec"), namespace)
    gate = namespace["TestToyOmniGate"]()
    requests = gate.gate_requests([toy_card("toy-omni")], "doc-")
    assert {r.diffusion.sampler for r in requests} == {None, "unipc"}  # the default loop and the added one
    assert {r.diffusion.steps for r in requests if r.task is not TaskType.TEXT_GENERATION} == {2, 3}
    assert sum(r.prompt_upsampling for r in requests) == 2
    gate.test_interleaved_equals_each_alone()


# --------------------------------------------------------------------------- the throughput gate


def build_row_zero_timestep_instance(card: ModelCard, options: InstanceOptions) -> ModelInstance:
    """BUG (d): the DiT op runs every row of a fused batch at row 0's timestep. Alone (batch 1) it is right."""

    def wrap(instance: ModelInstance, ops: dict[str, StepOp]) -> dict[str, StepOp]:
        if "dit_forward" in ops:
            plain = ops["dit_forward"].fn

            def dit_forward(inputs: TensorDict, params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
                return plain({**inputs, "t": inputs["t"][:1].expand_as(inputs["t"])}, params)

            ops["dit_forward"] = dataclasses.replace(ops["dit_forward"], fn=dit_forward)
        return ops

    return _wrap_ops(build_toy_instance(card, options), wrap)


def with_batched_vs_alone(card: ModelCard, *entries: BatchedVsAlone) -> ModelCard:
    return card.model_copy(update={"parity": card.parity.model_copy(update={"batched_vs_alone": entries})})


ROW_ZERO = lambda: toy_with_factory(f"{HERE}:build_row_zero_timestep_instance")  # noqa: E731


def _throughput_fails(gate: InterleaveConformance) -> str:
    with pytest.raises(AssertionError) as info:
        gate.test_throughput_within_the_card_tolerance()
    return str(info.value)


def test_the_throughput_gate_passes_the_toy_card_within_its_declared_tolerance() -> None:
    _gate(lambda: toy_card("toy-dit")).test_throughput_within_the_card_tolerance()


def test_the_throughput_gate_fails_a_row_that_reads_another_rows_timestep() -> None:
    message = _throughput_fails(_gate(ROW_ZERO))
    assert "moved" in message and "parity.batched_vs_alone max_abs 1e-06" in message, message
    # The exact gate runs each row alone, where row 0 is the row itself: it cannot see this bug.
    _gate(ROW_ZERO).test_interleaved_equals_each_alone()


def test_the_throughput_gate_has_teeth_fusing_moves_results_on_this_cpu() -> None:
    """A declared 0 fails: fused forwards really differ from batch 1 here, so the gate measures something."""
    exact = lambda: with_batched_vs_alone(  # noqa: E731
        toy_card("toy-dit"), BatchedVsAlone(precision="fp32", max_abs=0.0, justification="claims bit-identity"))
    assert "moved" in _throughput_fails(_gate(exact))


def test_a_card_that_declares_nothing_runs_unfused_and_bit_identical_under_throughput() -> None:
    _gate(lambda: with_batched_vs_alone(toy_card("toy-dit"))).test_throughput_within_the_card_tolerance()
    # The same gate fails such a card whose steps fuse anyway (an engine that ignored the declaration).
    class IgnoresTheDeclaration(_Gate):
        card_ids = ("toy-dit",)
        card_factory = staticmethod(lambda: with_batched_vs_alone(toy_card("toy-dit")))

        def make_engine(self, cards: Sequence[ModelCard], scheduler: SchedulerConfig | None = None) -> Engine:
            engine = super().make_engine(cards, scheduler)
            engine.executor.fused_rows = lambda instance, op, batch: list(range(len(batch))) if len(batch) > 1 else []  # type: ignore[method-assign]
            return engine

    assert "declares no parity.batched_vs_alone, yet op" in _throughput_fails(IgnoresTheDeclaration())


# --------------------------------------------------------------------------- a promise scoped to ops, and its text


def _promise(**fields: Any) -> BatchedVsAlone:
    return BatchedVsAlone(**{"precision": "fp32", "max_abs": 1e-6, "justification": "toy, measured on CPU", **fields})


def build_token_flip_instance(card: ModelCard, options: InstanceOptions) -> ModelInstance:
    """A decode op whose fused calls shift the vocabulary by one (a token that flips near a tie, made certain).
    Alone (batch 1) it is right."""

    def wrap(instance: ModelInstance, ops: dict[str, StepOp]) -> dict[str, StepOp]:
        if "lm_decode" in ops:
            plain = ops["lm_decode"].fn

            def lm_decode(inputs: TensorDict, params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
                out = plain(inputs, params)
                if inputs["ids"].shape[0] > 1:
                    out = {**out, "logits": out["logits"].roll(1, dims=-1)}
                return out

            ops["lm_decode"] = dataclasses.replace(ops["lm_decode"], fn=lm_decode)
        return ops

    return _wrap_ops(build_toy_instance(card, options), wrap)


def _token_flip(text: str) -> Callable[[], ModelCard]:
    def card() -> ModelCard:
        lm = toy_card("toy-lm").model_copy(update={"factory": f"{HERE}:build_token_flip_instance"})
        return with_batched_vs_alone(lm, _promise(ops=("lm_decode",), text=text))

    return card


def _meta(name: str = "text") -> Any:
    from fv_kernel.request.artifacts import Provenance

    return Provenance(model_id="toy", loop_id="loop", request_id=name)


def _text(ids: list[int]) -> Any:
    from fv_kernel.request.artifacts import TextArtifact

    return TextArtifact(token_ids=ids, text=" ".join(map(str, ids)), provenance=_meta())


def _video(value: float, fps: float = 8.0) -> Any:
    from fv_kernel.request.artifacts import VideoArtifact

    return VideoArtifact(frames=torch.full((1, 3, 2, 2), value), fps=fps, provenance=_meta("video"))


def test_compare_with_alone_holds_text_as_the_promise_says_and_tensors_to_max_abs_either_way() -> None:
    from fv_kernel.testing import compare_with_alone

    alone, batched = [_text([1, 2, 3]), _video(0.5)], [_text([1, 2, 4]), _video(0.75)]
    # identical (the default): a text difference fails, as artifacts_max_abs always did.
    with pytest.raises(AssertionError, match="field 'token_ids'"):
        compare_with_alone(alone, batched)
    with pytest.raises(AssertionError, match="field 'token_ids'"):
        compare_with_alone(alone, batched, text="identical")
    # may_diverge: the text difference is reported, not failed. The frames followed other text (an
    # upsampled prompt feeding the video step), so they are not held to max_abs, and the report says so.
    seen = compare_with_alone(alone, batched, text="may_diverge")
    assert seen.max_abs == 0.0
    assert [d.split(":")[0] for d in seen.text_differences] == [
        "artifact 0 (text 'text') field 'token_ids'", "artifact 0 (text 'text') field 'text'",
        "tensors of a request whose text diverged are not bounded"]
    # Equal text: nothing to report, and the frames measure 0.25 against max_abs in either mode.
    assert compare_with_alone(alone, [alone[0], batched[1]], text="identical") == (0.25, ())
    assert compare_with_alone(alone, [alone[0], batched[1]], text="may_diverge") == (0.25, ())
    # may_diverge speaks for text only: other metadata must still be equal.
    with pytest.raises(AssertionError, match="field 'fps'"):
        compare_with_alone([_video(0.5)], [_video(0.5, fps=16.0)], text="may_diverge")


def test_a_promise_scoped_to_the_dit_passes_the_gate_and_a_fused_op_outside_it_fails_it() -> None:
    scoped = lambda: with_batched_vs_alone(toy_card("toy-dit"), _promise(ops=("dit_forward",)))  # noqa: E731
    _gate(scoped).test_throughput_within_the_card_tolerance()

    class IgnoresTheScope(_Gate):  # an executor that fuses every op of a declaring card
        card_ids = ("toy-dit",)
        card_factory = staticmethod(scoped)

        def make_engine(self, cards: Sequence[ModelCard], scheduler: SchedulerConfig | None = None) -> Engine:
            engine = super().make_engine(cards, scheduler)
            engine.executor.fused_rows = lambda instance, op, batch: list(range(len(batch))) if len(batch) > 1 else []  # type: ignore[method-assign]
            return engine

    message = _throughput_fails(IgnoresTheScope())
    assert "fused, but parity.batched_vs_alone covers only ops ['dit_forward']" in message, message


def test_a_scoped_promise_still_holds_its_ops_tensors_to_max_abs() -> None:
    """may_diverge loosens text only: a row reading row 0's timestep still fails on its frames."""
    row_zero = lambda: with_batched_vs_alone(ROW_ZERO(), _promise(ops=("dit_forward",), text="may_diverge"))  # noqa: E731
    assert "moved" in _throughput_fails(_gate(row_zero))


def test_text_identical_fails_a_flipped_token_and_may_diverge_reports_it() -> None:
    message = _throughput_fails(_gate(_token_flip("identical")))
    assert "field 'token_ids'" in message, message
    with pytest.warns(TextDivergedWarning, match="text differs from its run alone, as parity.batched_vs_alone text: "
                                                 "may_diverge allows .*field 'token_ids'"):
        _gate(_token_flip("may_diverge")).test_throughput_within_the_card_tolerance()


def test_the_gate_refuses_a_promise_for_an_op_the_card_does_not_have(monkeypatch: pytest.MonkeyPatch) -> None:
    """The executor refuses it, typed, once the instance has every component (toy-lm has one): the gate's
    requests fail with the field and the ops there are. Where the executor cannot tell yet (a component never
    loaded, simulated by switching its check off), the gate's own check after every task still refuses it."""
    from fv_kernel.errors import InvalidRequest
    from fv_kernel.runtime import executor

    typo = lambda: with_batched_vs_alone(toy_card("toy-lm"), _promise(ops=("lm_decod",)))  # noqa: E731
    refused = ("parity.batched_vs_alone.ops: card 'toy-lm' promises fused steps at fp32 for ops ['lm_decod'] that "
               "its instance does not have; allowed: encode_text, lm_decode, lm_prefill")
    message = _throughput_fails(_gate(typo))
    assert refused in message, message
    with monkeypatch.context() as patched:
        patched.setattr(executor, "check_promised_ops", lambda instance, **_: None)
        with pytest.raises(InvalidRequest) as info:
            _gate(typo).test_throughput_within_the_card_tolerance()
    assert str(info.value) == refused
    # The op's real name passes (the flip-free toy-lm decodes the same tokens fused).
    _gate(lambda: with_batched_vs_alone(toy_card("toy-lm"), _promise(ops=("lm_decode",)))).test_throughput_within_the_card_tolerance()


def test_the_lane_gate_fails_ops_that_share_a_workspace_which_one_lane_never_shows() -> None:
    gate = _gate(SHARED_WORKSPACE)
    gate.test_interleaved_equals_each_alone()  # one op at a time: each reads back what it wrote
    with pytest.raises(AssertionError, match="with the overlap lane vs alone"):
        gate.test_overlap_lane_equals_each_alone()


def test_the_lane_gate_passes_the_toy_card_and_saw_an_overlap() -> None:
    gate = _gate(lambda: toy_card("toy-dit"))
    gate.test_overlap_lane_equals_each_alone()  # asserts some batch ran beside the other lane's
