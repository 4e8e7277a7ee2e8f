"""The generator runs rows (requests) and guidance branches together where their shapes allow.

* ``Cosmos3MoT.generate_batch`` over B rows equals B one-row ``generate_forward`` calls
  within the card's ``generator_batched_vs_one_row`` tolerance (fp32 GEMMs over more rows
  are blocked differently, so not bit-identical); a state smear between rows fails it.
* The instance's ``generate`` op makes one generator call per prompt length: cond and
  uncond of equal length run as one call of rows x 2, of different lengths as one call
  per branch (the fallback), with every output in its (row, branch) place.
* Through the Engine in throughput mode, concurrent requests' steps fuse and match the
  same requests run one at a time.
"""

from __future__ import annotations

import pytest
import torch
from cosmos3_testutils import build_model

from fv_cosmos3.cards import cosmos3_card
from fv_cosmos3.instance import generator_groups
from fv_cosmos3.models import Cosmos3Config, Cosmos3MoT, TextKV
from fv_kernel.api import DiffusionParams, Engine, Request, SchedulerConfig, TaskType, TextPart, build_instance
from fv_kernel.runtime.engine import run_concurrently, run_serially


def _tolerance() -> float:
    tolerances = {t.name: t for t in cosmos3_card("cosmos3-tiny").parity.tolerances}
    tolerance = tolerances["generator_batched_vs_one_row"]
    assert tolerance.metric == "max_abs"
    return tolerance.value


def _assert_rows_match(batched: torch.Tensor, rows: list[torch.Tensor], what: str) -> None:
    assert batched.shape[0] == len(rows), what
    for index, row in enumerate(rows):
        diff = (batched[index] - row).abs().max().item()
        assert diff <= _tolerance(), f"{what} row {index}: max abs diff {diff:.3e} > {_tolerance():.0e}"


def _row_kv(kv: TextKV, row: int) -> TextKV:
    return TextKV(tuple(k[row : row + 1] for k in kv.keys), tuple(v[row : row + 1] for v in kv.values), kv.purpose)


@pytest.fixture(scope="module")
def rows(tiny_model):
    """Four rows of one shape: different prompts, latents, timesteps, sound, actions and embodiments."""
    model, _ = tiny_model
    gen = torch.Generator().manual_seed(3)
    batch = 4
    data = dict(
        ids=torch.randint(0, 272, (batch, 11), generator=gen),
        video=torch.randn(batch, 4, 3, 5, 6, generator=gen),  # H=5: patch padding and crop on every row
        timestep=torch.tensor([999.0, 640.0, 250.0, 12.5]),
        sound=torch.randn(batch, 4, 7, generator=gen),
        action=torch.randn(batch, 4, 6, generator=gen),
        domain=torch.tensor([0, 2, 1, 2]),
    )
    with torch.inference_mode():
        data["kv"] = model.text_kv_for_generation(data["ids"])
    return model, data


def _batched(model: Cosmos3MoT, data: dict, kv: TextKV):
    return model.generate_batch(
        kv, data["video"], data["timestep"], fps=16.0, video_noisy_frames=[1, 2], sound_latents=data["sound"],
        action=data["action"], action_domain=data["domain"], action_noisy_frames=[1, 3],
    )


def _one_rows(model: Cosmos3MoT, data: dict):
    out = []
    for r in range(data["video"].shape[0]):
        out.append(model.generate_forward(
            _row_kv(data["kv"], r), data["video"][r : r + 1], data["timestep"][r], fps=16.0, video_noisy_frames=[1, 2],
            sound_latents=data["sound"][r], action=data["action"][r], action_domain=int(data["domain"][r]),
            action_noisy_frames=[1, 3],
        ))
    return out


def test_generate_batch_equals_one_row_calls(rows):
    model, data = rows
    with torch.inference_mode():
        batched = _batched(model, data, data["kv"])
        singles = _one_rows(model, data)
    _assert_rows_match(batched.video, [s.video[0] for s in singles], "video")
    _assert_rows_match(batched.sound, [s.sound for s in singles], "sound")
    _assert_rows_match(batched.action, [s.action for s in singles], "action")
    # Clean conditioning frames and clean actions stay exactly zero in every row.
    assert not batched.video[:, :, 0].any() and not batched.action[:, [0, 2]].any()


def test_row_smear_fails_the_check(rows):
    """Negative control: every row attending to its neighbour's prompt (a state smear) is caught."""
    model, data = rows
    rolled = TextKV(tuple(k.roll(1, 0) for k in data["kv"].keys), tuple(v.roll(1, 0) for v in data["kv"].values),
                    data["kv"].purpose)
    with torch.inference_mode():
        smeared = _batched(model, data, rolled)
        singles = _one_rows(model, data)
    with pytest.raises(AssertionError, match="video row"):
        _assert_rows_match(smeared.video, [s.video[0] for s in singles], "video")


def test_generate_batch_input_errors(rows):
    model, data = rows
    with torch.inference_mode(), pytest.raises(ValueError, match="text_kv batch 4 != video_latents batch 3"):
        model.generate_batch(data["kv"], data["video"][:3], data["timestep"][:3])
    with torch.inference_mode(), pytest.raises(ValueError, match="per-row or"):
        model.generate_batch(data["kv"], data["video"], torch.ones(3))
    with torch.inference_mode(), pytest.raises(ValueError, match="action_domain must be one id or 4"):
        model.generate_batch(data["kv"], data["video"], data["timestep"], action=data["action"], action_domain=[0, 1])


def test_generator_groups_join_equal_prompt_lengths_only():
    assert generator_groups(("cond", "uncond"), {"cond": 12, "uncond": 12}) == [("cond", "uncond")]
    assert generator_groups(("cond", "uncond"), {"cond": 12, "uncond": 9}) == [("cond",), ("uncond",)]
    assert generator_groups(("cond",), {"cond": 5}) == [("cond",)]


@pytest.fixture()
def instance():
    inst = build_instance(cosmos3_card("cosmos3-tiny"))
    inst.load_for_task(TaskType.TEXT_TO_VIDEO_AUDIO)
    return inst


@pytest.mark.parametrize("uncond_len", [11, 8], ids=["equal-lengths-one-call", "different-lengths-call-per-branch"])
def test_generate_op_batches_rows_and_branches(instance, uncond_len, monkeypatch):
    mot: Cosmos3MoT = instance.component("transformer")
    gen = torch.Generator().manual_seed(5)
    rows = 3
    with torch.inference_mode():
        cond = mot.text_kv_for_generation(torch.randint(0, 272, (rows, 11), generator=gen))
        uncond = mot.text_kv_for_generation(torch.randint(0, 272, (rows, uncond_len), generator=gen))
    stack = lambda kv, part: torch.stack(getattr(kv, part), dim=1)  # noqa: E731 - (B, L, H, T, D) as the loop sends
    inputs = {
        "video": torch.randn(rows, 4, 2, 2, 4, generator=gen), "timestep": torch.tensor([900.0, 500.0, 100.0]),
        "sound": torch.randn(rows, 4, 5, generator=gen),
        "k_cond": stack(cond, "keys"), "v_cond": stack(cond, "values"),
        "k_uncond": stack(uncond, "keys"), "v_uncond": stack(uncond, "values"),
    }
    params = {"branches": ("cond", "uncond"), "fps": 24.0, "video_noisy": (0, 1)}
    calls: list[int] = []
    real = mot.generate_batch

    def counting(kv, video, *args, **kwargs):
        calls.append(video.shape[0])
        return real(kv, video, *args, **kwargs)

    monkeypatch.setattr(mot, "generate_batch", counting)
    with torch.inference_mode():
        out = instance.op("generate").fn(inputs, params)
    assert calls == ([2 * rows] if uncond_len == 11 else [rows, rows])
    assert out["v_video"].shape == (rows, 2, 4, 2, 2, 4) and out["v_sound"].shape == (rows, 2, 4, 5)
    monkeypatch.undo()
    with torch.inference_mode():
        for b, kv in enumerate((cond, uncond)):
            expected = [mot.generate_forward(_row_kv(kv, r), inputs["video"][r : r + 1], inputs["timestep"][r],
                                             sound_latents=inputs["sound"][r]) for r in range(rows)]
            _assert_rows_match(out["v_video"][:, b], [e.video[0] for e in expected], f"branch {b} video")
            _assert_rows_match(out["v_sound"][:, b], [e.sound for e in expected], f"branch {b} sound")
    # Sensitivity: the branches and the rows really differ, so a swap of either would fail the checks above.
    assert (out["v_video"][:, 0] - out["v_video"][:, 1]).abs().max() > 100 * _tolerance()
    assert (out["v_video"][0] - out["v_video"][1]).abs().max() > 100 * _tolerance()


def _t2v(prefix: str) -> list[Request]:
    # One prompt length (byte tokenizer: equal character counts) so the three requests share a shape signature.
    prompts = ["a red fox in snow", "tall ship at sea!", "grey city at dusk"]
    assert len({len(p) for p in prompts}) == 1
    return [Request(request_id=f"{prefix}{i}", model="cosmos3-tiny", task=TaskType.TEXT_TO_VIDEO,
                    inputs=(TextPart(text=p),), diffusion=DiffusionParams(seed=10 + i)) for i, p in enumerate(prompts)]


def test_concurrent_requests_fuse_and_match_one_at_a_time(monkeypatch):
    card = cosmos3_card("cosmos3-tiny")
    rows_per_call: list[int] = []
    real = Cosmos3MoT.generate_batch

    def counting(self, kv, video, *args, **kwargs):
        rows_per_call.append(video.shape[0])
        return real(self, kv, video, *args, **kwargs)

    monkeypatch.setattr(Cosmos3MoT, "generate_batch", counting)

    def engine(config: SchedulerConfig) -> Engine:
        e = Engine(config)
        e.add_instance(build_instance(card))
        return e

    serial = run_serially(engine(SchedulerConfig()), _t2v("s-"))
    assert set(rows_per_call) == {1}  # one at a time, cond and uncond prompts of different lengths: row by row
    rows_per_call.clear()
    fused_engine = engine(SchedulerConfig(batching="throughput"))
    fused = run_concurrently(fused_engine, _t2v("f-"))
    # Every denoise step of the three requests ran as one generator call per guidance branch.
    assert rows_per_call and set(rows_per_call) == {3}, rows_per_call
    for s, f in zip(serial, fused):
        assert s.status == f.status == "completed", (s.error, f.error)
        a, b = s.artifacts[0].frames, f.artifacts[0].frames
        # Decoded frames of a 3-step trajectory: the per-step tolerance, compounded (the card's C1 bound).
        assert (a - b).abs().max().item() <= 1e-4, f"{f.request_id}: fused differs from one-at-a-time"
