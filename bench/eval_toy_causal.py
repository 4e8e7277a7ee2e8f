"""Judge a causal toy card per segment: does a prompt update turn the object, and is the first segment right?

For each of ``--prompts`` held-out toy prompts whose first object moves left (fv_wan.toy.grammar's
held-out split), a stream generates ``--left-chunks`` chunks under that prompt, then receives the
update "... moves right ..." (the first object's direction changed) at the chunk boundary and
generates ``--right-chunks`` more. The decoded frames are cut per segment (the frames of each
segment's chunks) and judged by the toy judge (fv_wan.toy.judge) against that segment's prompt:

- ``turn``: share of streams whose first object moves right over the ``--right-chunks`` chunks after
  the update (the judge's direction check on that segment; issue 32 target >= 80% within two chunks);
- ``colour``: the judge's colour accuracy over the first segment's objects (target >= 85%).

Backends: ``card`` (default) streams through the real card and its chunk-rollout loop via the
façade (``fv.load(model).session(prompt)``, ``update`` at a chunk boundary); ``reference`` runs
fv_rl.self_forcing's training rollout (the same sampler and KV refresh, with the KV cache held
in-process) on the card's transformer and decodes the whole latent at once -- a cross-check of the
weights independent of the serving loop.

    python bench/eval_toy_causal.py --model wan-toy-causal --prompts 50 [--backend reference] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from typing import Any

import torch


def prompt_pairs(count: int, seed: int = 0) -> list[tuple[str, str]]:
    """``count`` (left prompt, right prompt) pairs: held-out prompts whose first object moves left,
    and the same scene with that object moving right."""
    from fv_wan.toy.grammar import is_held_out, sample_scene

    generator = torch.Generator().manual_seed(seed)
    pairs: list[tuple[str, str]] = []
    seen: set[str] = set()
    while len(pairs) < count:
        scene = sample_scene(generator, held_out=True)
        first = scene.objects[0]
        if first.direction != "left" or scene.prompt() in seen:
            continue
        seen.add(scene.prompt())
        right = dataclasses.replace(scene, objects=(dataclasses.replace(first, direction="right"), *scene.objects[1:]))
        assert is_held_out(scene.prompt())
        pairs.append((scene.prompt(), right.prompt()))
    return pairs


def frames_of_chunks(latent_frames: int, chunk_frames: int, frames_per_latent: int) -> list[int]:
    """Pixel frames each chunk decodes to (Wan's causal VAE: the first latent frame is one frame)."""
    counts = []
    for start in range(0, latent_frames, chunk_frames):
        counts.append(sum(1 if k == 0 else frames_per_latent for k in range(start, start + chunk_frames)))
    return counts


def wilson_interval(successes: int, trials: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a share (95% at ``z`` 1.96): how far a score over ``trials``
    streams may sit from the rate a much larger sample would give (about +-12 points at 50 streams)."""
    if trials < 1 or not 0 <= successes <= trials:
        raise ValueError(f"need 0 <= successes <= trials and trials >= 1, got {successes}/{trials}")
    p = successes / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / (1 + z * z / trials)
    return max(0.0, centre - half), min(1.0, centre + half)


def judge_segments(first: torch.Tensor, second: torch.Tensor, left: str, right: str) -> dict[str, Any]:
    """Judge one stream: ``first`` (the frames before the update) against ``left``, ``second`` (the
    frames of the chunks generated under the update) against ``right``; (F, 3, H, W) in [0, 1]."""
    from fv_wan.toy.judge import judge

    one, two = judge(first, left), judge(second, right)
    return {
        "left": left, "right": right,
        "colour": [obj.colour for obj in one.objects],
        "left_direction": one.objects[0].direction,
        "turn": two.objects[0].direction,
        "right_displacement": two.objects[0].displacement,
    }


def _reference_streams(model: str, pairs: list[tuple[str, str]], left_chunks: int, right_chunks: int, seed: int,
                       chunk_frames: int, batch: int, device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from fv_rl.flow_matching import context_length_of
    from fv_rl.self_forcing import CausalSchedule, SelfForcingOptions, causal_rollout
    from fv_wan.causal import CausalRecipe

    from fv_kernel.api import CardCatalog, InstanceOptions, build_instance
    from fv_kernel.plugins import PluginHost

    host = PluginHost()
    host.start()
    resolved = CardCatalog(host).resolve(model)  # a card id, a card file or an export's folder
    card = resolved.card
    instance = build_instance(
        card, InstanceOptions(device=device, precision="fp32", registry=host.registry(), source=resolved.source)
    )
    transformer = instance.component("transformer").eval()
    text = instance.component("text_encoder")
    vae = instance.component("vae_decoder")
    defaults, grid = card.capabilities.defaults, card.capabilities.token_grid
    scale = grid.pixels_per_token // transformer.config.patch_size[1]
    schedule = CausalSchedule.of(SelfForcingOptions(chunk_frames=chunk_frames))
    length = context_length_of(card)
    # The served window (sink and local chunks), as the card's sessions attend through it.
    window = CausalRecipe(**card.loops["realtime"].config).window if "realtime" in card.loops else None
    generator = torch.Generator().manual_seed(seed)
    videos: list[torch.Tensor] = []
    with torch.no_grad():
        for start in range(0, len(pairs), batch):
            rows = pairs[start : start + batch]
            ctx_l = text.encode([p[0] for p in rows], length).float()
            ctx_r = text.encode([p[1] for p in rows], length).float()
            shape = (len(rows), transformer.config.in_channels, chunk_frames, defaults.height // scale, defaults.width // scale)
            chunks = causal_rollout(transformer, [ctx_l] * left_chunks + [ctx_r] * right_chunks, shape, schedule, generator,
                                    window=window)
            latents = torch.cat(chunks, dim=2)
            pixels = vae.decode(vae.denormalize_latents(latents))  # (B, 3, F, H, W) in [-1, 1]
            videos.extend(((pixels + 1) / 2).clamp(0, 1).permute(0, 2, 1, 3, 4).cpu().unbind(0))
    sizes = frames_of_chunks((left_chunks + right_chunks) * chunk_frames, chunk_frames, grid.frames_per_latent)
    cut = sum(sizes[:left_chunks])
    return [(video[:cut], video[cut:]) for video in videos]


def _card_streams(model: str, pairs: list[tuple[str, str]], left_chunks: int, right_chunks: int,
                  seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Stream each pair through the card's session: the first ``left_chunks`` chunks, then (the update
    sent as the last of them arrives) the first ``right_chunks`` chunks generated under the update
    (``prompt_version`` 1; the session may have run a chunk ahead under the old prompt)."""
    import fv_kernel as fv

    pipe = fv.load(model)
    segments = []
    for index, (left, right) in enumerate(pairs):
        first: list[torch.Tensor] = []
        second: list[torch.Tensor] = []
        with pipe.session(left, seed=seed + index) as session:
            for chunk in session:
                if chunk.prompt_version == 0 and len(first) < left_chunks:
                    first.append(chunk.frames)
                    if len(first) == left_chunks:
                        session.update(right)
                elif chunk.prompt_version == 1:
                    second.append(chunk.frames)
                    if len(second) == right_chunks:
                        break
        segments.append((torch.cat(first), torch.cat(second)))
        verdict = judge_segments(segments[-1][0], segments[-1][1], left, right)
        print(f"[{index + 1}/{len(pairs)}] turn {verdict['turn']}, colour {verdict['colour']}: {left!r}", file=sys.stderr,
              flush=True)
    return segments


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="wan-toy-causal", help="card id (reference backend: or an export folder)")
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--left-chunks", type=int, default=3)
    parser.add_argument("--right-chunks", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=("card", "reference"), default="card")
    parser.add_argument("--chunk-frames", type=int, default=1, help="latent frames per chunk (reference backend)")
    parser.add_argument("--batch", type=int, default=10, help="streams per rollout (reference backend)")
    parser.add_argument("--device", default="cpu", help="device of the reference backend's model")
    parser.add_argument("--json", help="write per-stream results and the scores here")
    args = parser.parse_args(argv)
    if args.prompts < 1 or args.left_chunks < 1 or args.right_chunks < 1:
        parser.error("--prompts, --left-chunks and --right-chunks must be at least 1")

    pairs = prompt_pairs(args.prompts, args.seed)
    started = time.perf_counter()
    if args.backend == "card":
        segments = _card_streams(args.model, pairs, args.left_chunks, args.right_chunks, args.seed)
    else:
        segments = _reference_streams(args.model, pairs, args.left_chunks, args.right_chunks, args.seed,
                                      args.chunk_frames, args.batch, args.device)
    seconds = time.perf_counter() - started
    results = [judge_segments(a, b, left, right) for (a, b), (left, right) in zip(segments, pairs)]
    colours = [c for r in results for c in r["colour"]]
    scores = {
        "model": args.model, "backend": args.backend, "prompts": len(pairs), "left_chunks": args.left_chunks,
        "right_chunks": args.right_chunks,
        "segment_frames": [int(segments[0][0].shape[0]), int(segments[0][1].shape[0])],
        "turn": sum(r["turn"] for r in results) / len(results),
        "colour": sum(colours) / len(colours),
        "left_direction": sum(r["left_direction"] for r in results) / len(results),
        "seconds": round(seconds, 1),
    }
    turns = sum(r["turn"] for r in results)
    scores["turn_95"] = wilson_interval(turns, len(results))
    scores["colour_95"] = wilson_interval(sum(colours), len(colours))
    low, high = scores["turn_95"]
    print(f"turn within {args.right_chunks} chunks: {scores['turn']:.0%} ({turns}/{len(results)}; 95% interval "
          f"{low:.0%}-{high:.0%})  [target >= 80%]")
    low, high = scores["colour_95"]
    print(f"colour, first segment: {scores['colour']:.0%} ({sum(colours)}/{len(colours)} objects; 95% interval "
          f"{low:.0%}-{high:.0%})  [target >= 85%]")
    print(f"(first segment moves left: {scores['left_direction']:.0%}; {args.backend} backend, {seconds:.0f} s)")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"scores": scores, "streams": results}, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
