"""The resident Cosmos 3 instance: components, the paged text-KV pool and the executable steps.

One :class:`Cosmos3Instance` holds the two-tower MoT once. Its ops are the only code
that runs kernels; loops describe steps that name them:

* ``ar_prefill`` / ``ar_token``: the reasoner tower against the instance's paged
  text-KV pool (``ar_token`` takes a group of requests with different context
  lengths and decodes them as one right-padded batch; with ``compute.cuda_graphs`` on
  CUDA it replays captured steps, ``fv_cosmos3.graphed_decode``, and samples the next
  token in the step when the plan carries the sampling inputs);
* ``text_kv``: the prompt's per-layer K/V, computed once per request and guidance branch;
* ``generate``: the generator tower against that K/V for every row (request) and guidance
  branch of the step, as one batched call per prompt length (``generator_groups``);
* ``vae_decode`` / ``sound_decode``: the Wan 2.2 VAE and the AVAE sound decoder.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from fv_kernel.api import (
    torch_dtype,
    CheckpointKeyError,
    CheckpointNotFound,
    InstanceOptions,
    ModelCard,
    ModelInstance,
    PagedKVConfig,
    PagedKVPool,
    StepOp,
    load_into,
    read_safetensors,
    resolve_source,
)
from fv_cosmos3.decode_kernels import DecodeKernels, DecodeKernelsUnavailable
from fv_cosmos3.graphed_decode import SAMPLING_INPUTS, GraphedDecode, chain_length, logits_health, sample_tokens
from fv_cosmos3.models import Cosmos3Config, Cosmos3MoT, TextKV, from_unified_state_dict
from fv_cosmos3.models.mot import GeneratorOutput
from fv_cosmos3.models.audio_vae import Cosmos3AudioDecoder, Cosmos3AudioDecoderConfig
from fv_cosmos3.models.layers import MRoPE
from fv_cosmos3.models.tokenizer import ByteTokenizer, HFChatTokenizer
from fv_wan.models.vae import WanVAE, WanVAEConfig

__all__ = ["Cosmos3Instance", "build_cosmos3_instance", "cosmos3_ops", "generator_groups", "seeded_init", "text_pool_config"]



@dataclass
class Cosmos3Instance(ModelInstance):
    """A Cosmos 3 card made resident, plus the pool its reasoner's decode loops draw K/V blocks from.

    The pool is instance-wide infrastructure (like the weights); what a request owns in it
    is a block table held in that request's ``LoopState``.
    """

    text_kv_pool: PagedKVPool | None = None
    #: The reasoner's CUDA-graphed decode steps (``compute.cuda_graphs`` on a CUDA device), else None: eager.
    graphed_decode: GraphedDecode | None = None
    #: Tokens a decode loop that samples on the device runs per scheduled step (``compute.decode_tokens_per_step``
    #: where the decode is graphed, else 1): a chained ``ar_token`` step.
    decode_tokens_per_step: int = 1

    @property
    def samples_on_device(self) -> bool:
        """Decode loops started here sample in the step (graph-safe sampling) instead of on the host."""
        return self.graphed_decode is not None

    def block_pools(self) -> dict[str, PagedKVPool]:
        """The text-KV pool, by the name the decode loop's estimate reserves blocks of (admission)."""
        return {"text_kv": self.text_kv_pool} if self.text_kv_pool is not None else {}


def seeded_init(module: nn.Module, seed: int) -> nn.Module:
    """Deterministic random weights: norm gains near 1, everything else small (tiny cards)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in module.state_dict().items():
            noise = torch.randn(tensor.shape, generator=gen, dtype=torch.float32)
            last = name.split(".")
            is_gain = name.endswith(".weight") and len(last) > 1 and "norm" in last[-2]
            is_weight_norm_g = name.endswith("weight_g")
            value = 1.0 + 0.1 * noise if (is_gain or is_weight_norm_g) else 0.2 * noise
            tensor.copy_(value.to(tensor.dtype))
    return module


def text_pool_config(card: ModelCard, options: InstanceOptions) -> PagedKVConfig:
    """The text-KV pool's geometry from the transformer config and its budget from the card's cache contract."""
    config = Cosmos3Config(**card.components["transformer"].config)
    contract = card.caches["text_kv"]
    precision = options.precision or card.precision.default
    block_size = 16
    geometry: dict[str, Any] = dict(
        num_layers=config.num_hidden_layers, num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
        block_size=block_size, dtype=precision, device=options.device,
    )
    max_tokens = int(card.components["tokenizer"].config.get("max_sequence_tokens", 4096))
    return PagedKVConfig.from_budget(contract.budget_bytes, max_blocks_per_sequence=-(-max_tokens // block_size), **geometry)


def _read_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.exists():
        raise CheckpointNotFound(f"{folder} has no config.json", param="model")
    return json.loads(path.read_text())


def _load_component(card: ModelCard, options: InstanceOptions, component_id: str) -> Any:
    spec = card.components[component_id]
    ckpt = card.checkpoint.components.get(component_id)
    dtype = torch_dtype(options.precision or card.precision.default)
    if spec.kind == "tokenizer":
        if spec.config.get("kind") == "byte":
            return ByteTokenizer(vocab_size=int(spec.config["vocab_size"]))
        from transformers import AutoTokenizer  # real checkpoints only

        source = options.source or card.checkpoint.source
        if source is None:
            raise CheckpointNotFound(f"card {card.model_id!r} needs a checkpoint source (--model PATH)", param="model")
        folder = resolve_source(source, subfolder=ckpt.subfolder if ckpt else "", local_files_only=options.local_files_only)
        return HFChatTokenizer(AutoTokenizer.from_pretrained(str(folder)))
    builders = {
        "transformer": lambda: Cosmos3MoT(Cosmos3Config(**spec.config)),
        "vae": lambda: WanVAE(WanVAEConfig(**spec.config)),
        "sound_decoder": lambda: Cosmos3AudioDecoder(Cosmos3AudioDecoderConfig(**spec.config)),
    }
    if component_id not in builders:
        raise KeyError(f"card {card.model_id!r} has no loadable component {component_id!r}")
    if ckpt is not None and ckpt.random_init_seed is not None:
        # Seeded random weights exist only for embedded cards (cosmos3-tiny); a real-size card never gets here.
        module = seeded_init(builders[component_id](), ckpt.random_init_seed)
        return module.to(device=options.device, dtype=dtype).eval().requires_grad_(False)
    source = options.source or card.checkpoint.source
    if source is None:
        raise CheckpointNotFound(
            f"card {card.model_id!r} has no default checkpoint source; pass a local checkpoint directory", param="model"
        )
    # The source first, then the module on the meta device: its weights are allocated once, by
    # load_into, in their final dtype (building it on the CPU first would allocate a full
    # random-initialised copy: ~21 GB for Nano before a single checkpoint byte is read).
    folder = resolve_source(source, subfolder=ckpt.subfolder if ckpt else "", local_files_only=options.local_files_only)
    with torch.device("meta"):
        module = builders[component_id]()
    state = read_safetensors(folder)
    if component_id == "transformer":
        # Accepts the diffusers layout and the unified/transformers reasoner names (declared key maps).
        state = from_unified_state_dict(state)
    elif component_id == "sound_decoder":
        state = {k: v for k, v in state.items() if k.startswith("decoder.")}
    keep = spec.precision_policy.keep_fp32_modules
    load_into(module, state, component=component_id, dtype=dtype, keep_fp32=keep, device=options.device)
    if isinstance(module, Cosmos3MoT):
        # The RoPE tables are non-persistent buffers (in no checkpoint): computed again, in fp32, on the device.
        config = Cosmos3Config(**spec.config)
        module.rotary_emb = MRoPE(config.head_dim, config.rope_theta, config.rope_axes_dim).to(options.device)
    left_on_meta = [name for name, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
    if left_on_meta:
        raise CheckpointKeyError(component_id, left_on_meta, [])
    return module.eval().requires_grad_(False)


# --------------------------------------------------------------------------- ops


def _text_kv_tensors(kv: TextKV) -> tuple[torch.Tensor, torch.Tensor]:
    """TextKV (per layer (B, H, T, D)) -> (B, L, H, T, D) keys and values."""
    return torch.stack(kv.keys, dim=1), torch.stack(kv.values, dim=1)


def _text_kv_from(keys: torch.Tensor, values: torch.Tensor, purpose: str = "generator") -> TextKV:
    """(B, L, H, T, D) -> TextKV."""
    return TextKV(tuple(keys.unbind(1)), tuple(values.unbind(1)), purpose)  # type: ignore[arg-type]


def generator_groups(branches: tuple[str, ...], text_lengths: Mapping[str, int]) -> list[tuple[str, ...]]:
    """The guidance branches that run as one generator call: those whose prompts have the same token count.

    Rows of one call share every position and stack with no padding; branches of different
    prompt lengths run as separate calls rather than padding the shorter prompt's K/V behind
    a key mask (a mask takes the attention off the unmasked fused kernels at real size).
    """
    groups: dict[int, list[str]] = {}
    for branch in branches:
        groups.setdefault(int(text_lengths[branch]), []).append(branch)
    return [tuple(group) for group in groups.values()]


def cosmos3_ops(instance: ModelInstance) -> dict[str, StepOp]:
    """The instance's executable steps over its components (the card factory's ops builder; a benchmark
    that builds its components another way, e.g. random weights on the device, reuses it)."""
    assert isinstance(instance, Cosmos3Instance)
    comps = instance.components
    ops: dict[str, StepOp] = {}
    if "transformer" in comps:
        mot: Cosmos3MoT = comps["transformer"]
        pool = instance.text_kv_pool
        assert pool is not None

        def ar_prefill(inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
            graphed = instance.graphed_decode
            if graphed is not None:
                replayed = graphed.prefill(mot, pool, instance.weights_version, inputs)
                if replayed is not None:
                    return replayed
            ids = inputs["ids"]
            logits, kv = mot.text_prefill(ids)
            keys, values = _text_kv_tensors(kv)
            for row in range(ids.shape[0]):
                table = pool.table_from_tensor(inputs["table"][row], 0)
                pool.write(table, 0, keys[row], values[row])
            return {"logits": logits[:, -1].float()}

        def ar_token(inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
            graphed = instance.graphed_decode
            if graphed is not None:
                replayed = graphed.run(mot, pool, instance.weights_version, inputs)
                if replayed is not None:
                    return replayed
            chain = chain_length(inputs)
            if chain > 1:
                return _eager_chain(inputs, chain)
            out = _eager_ar_token(inputs)
            if all(name in inputs for name in SAMPLING_INPUTS):
                # The graphed step's sampler, run eagerly: the same token for the same logits.
                device = out["logits"].device
                out["token"] = sample_tokens(out["logits"], *(inputs[name].to(device) for name in SAMPLING_INPUTS))
            return out

        def _eager_chain(inputs: Mapping[str, torch.Tensor], chain: int) -> dict[str, torch.Tensor]:
            """``chain`` one-token steps, each sampling at its column of ``uniform`` and feeding its token to the
            next (what the graphed chain replays): ``tokens`` (B, chain) and the summed ``logits_health``."""
            missing = [name for name in SAMPLING_INPUTS if name not in inputs]
            if missing:
                raise ValueError(f"a chained ar_token step (uniform of shape (B, {chain})) samples on the device and "
                                 f"needs every sampling input; missing: {missing}")
            step = dict(inputs)
            tokens, health = [], None
            for j in range(chain):
                step["uniform"] = inputs["uniform"][:, j]
                logits = _eager_ar_token(step)["logits"]
                device = logits.device
                token = sample_tokens(logits, *(step[name].to(device) for name in SAMPLING_INPUTS))
                tokens.append(token)
                row_health = logits_health(logits)
                health = row_health if health is None else health + row_health
                # The next sub-step: this token at the next position, and this token among those seen (a set: the
                # presence penalty counts a token once however often it is listed).
                step["token"] = token.view(-1, 1).to(inputs["token"].device)
                step["length"] = inputs["length"] + (j + 1)
                step["seen"] = torch.cat([step["seen"], token.view(-1, 1).to(step["seen"].device)], dim=1)
            return {"tokens": torch.stack(tokens, dim=1), "health": health}

        def _eager_ar_token(inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            tokens, lengths = inputs["token"], inputs["length"]
            n = tokens.shape[1]
            tables = [pool.table_from_tensor(inputs["table"][row], int(lengths[row])) for row in range(tokens.shape[0])]
            ragged = len({t.length for t in tables}) > 1
            # Positions continue each row's own sequence; padding is masked only when rows differ.
            positions = lengths.view(-1, 1).to(torch.long)
            weight = mot.embed_tokens.weight
            window = pool.window(tables[0], tables[0].length + n) if len(tables) == 1 else None
            if window is not None and window[0].dtype == weight.dtype and window[0].device == weight.device:
                # One sequence on consecutive blocks: the tower attends over the pool's storage in place and
                # writes the new tokens' K/V straight into their slots. Nothing is copied but the new tokens.
                past = TextKV(tuple(window[0].unbind(0)), tuple(window[1].unbind(0)), "reasoner")
                logits, _ = mot.text_extend(tokens, past, positions, past_has_room=True)
                return {"logits": logits[:, -1].float()}
            # Otherwise the history is read out of the pool once per step (every row and layer), into a buffer
            # with a free slot per new token that the tower writes and attends over (no per-layer concat).
            keys, values, valid = pool.gather_padded(tables, extra=n)
            past = TextKV(tuple(keys.unbind(0)), tuple(values.unbind(0)), "reasoner")
            logits, new_kv = mot.text_extend(tokens, past, positions, past_valid=valid if ragged else None,
                                             past_has_room=True)
            pool.write_rows(tables, [t.length for t in tables], torch.stack(new_kv.keys), torch.stack(new_kv.values))
            return {"logits": logits[:, -1].float()}

        def text_kv(inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
            keys, values = _text_kv_tensors(mot.text_kv_for_generation(inputs["ids"]))
            return {"keys": keys, "values": values}

        def generate(inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
            """Every (row, guidance branch) of the batch, in as few generator calls as shapes allow."""
            branches: tuple[str, ...] = tuple(params["branches"])
            # The loop's latents live on the host (its state is device-free); the step runs on the weights' device.
            device = mot.embed_tokens.weight.device
            inputs = {name: tensor.to(device) for name, tensor in inputs.items()}
            rows = inputs["video"].shape[0]
            per_branch: dict[str, GeneratorOutput] = {}
            for group in generator_groups(branches, {b: inputs[f"k_{b}"].shape[3] for b in branches}):
                # One call over rows x branches of this group, branch-major: the rows of a fused batch share
                # the shape signature, so only the text length (per branch) can differ.
                kv = _text_kv_from(torch.cat([inputs[f"k_{b}"] for b in group]), torch.cat([inputs[f"v_{b}"] for b in group]))
                repeat = len(group)
                result = mot.generate_batch(
                    kv, inputs["video"].repeat(repeat, 1, 1, 1, 1), inputs["timestep"].repeat(repeat),
                    fps=float(params["fps"]), video_noisy_frames=list(params["video_noisy"]),
                    sound_latents=inputs["sound"].repeat(repeat, 1, 1) if "sound" in inputs else None,
                    action=inputs["action"].repeat(repeat, 1, 1) if "action" in inputs else None,
                    action_domain=params.get("action_domain"),
                    action_noisy_frames=list(params["action_noisy"]) if "action" in inputs else None,
                )
                for index, branch in enumerate(group):
                    part = slice(index * rows, (index + 1) * rows)
                    per_branch[branch] = GeneratorOutput(
                        video=result.video[part], sound=None if result.sound is None else result.sound[part],
                        action=None if result.action is None else result.action[part],
                    )
            # (rows, branches, ...) in the plan's branch order, as the loop's guidance combine reads them.
            out = {"v_video": torch.stack([per_branch[b].video.float() for b in branches], dim=1)}
            if "sound" in inputs:
                out["v_sound"] = torch.stack([per_branch[b].sound.float() for b in branches], dim=1)  # type: ignore[union-attr]
            if "action" in inputs:
                out["v_action"] = torch.stack([per_branch[b].action.float() for b in branches], dim=1)  # type: ignore[union-attr]
            return out

        ops["ar_prefill"] = StepOp("ar_prefill", ar_prefill)
        ops["ar_token"] = StepOp("ar_token", ar_token)
        ops["text_kv"] = StepOp("text_kv", text_kv)
        ops["generate"] = StepOp("generate", generate)
    if "vae" in comps:
        vae: WanVAE = comps["vae"]

        def vae_decode(inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
            z = inputs["latents"].to(next(vae.parameters()))  # the weights' device and dtype
            video = vae.decode(vae.denormalize_latents(z))  # (B, 3, F, H, W) in [-1, 1]
            return {"frames": (video.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4).contiguous()}

        def vae_encode(inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
            mean, _ = vae.encode(inputs["video"].to(next(vae.parameters())))
            return {"latents": vae.normalize_latents(mean).float()}

        ops["vae_decode"] = StepOp("vae_decode", vae_decode)
        ops["vae_encode"] = StepOp("vae_encode", vae_encode)
    if "sound_decoder" in comps:
        sound: Cosmos3AudioDecoder = comps["sound_decoder"]

        def sound_decode(inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
            return {"samples": sound(inputs["latents"].to(next(sound.parameters()))).float()}

        ops["sound_decode"] = StepOp("sound_decode", sound_decode)
    return ops


def build_cosmos3_instance(card: ModelCard, options: InstanceOptions) -> Cosmos3Instance:
    """The card's factory: lazy components, one text-KV pool, the ops above."""

    def load(component_id: str) -> Any:
        return _load_component(card, options, component_id)

    seeds = sorted(
        f"{name}={c.random_init_seed}" for name, c in card.checkpoint.components.items() if c.random_init_seed is not None
    )
    version = ("seeded:" + ",".join(seeds)) if seeds else f"source:{options.source or card.checkpoint.source}"
    compute = options.compute
    graphed = None
    captured = compute is not None and compute.cuda_graphs and torch.device(options.device).type == "cuda"
    # fused_ops (the transformer's, "dit"): 'triton' runs the reasoner's captured decode step through the decode
    # kernels; 'off', 'torch' (the same ops composed) and 'auto' (nothing measured to choose them by) do not.
    kernels = None
    if compute is not None and compute.fused_ops_for("dit") == "triton":
        if not captured:
            raise DecodeKernelsUnavailable(
                "compute.fused_ops='triton' runs the reasoner's captured decode step through Triton kernels: it needs "
                f"compute.cuda_graphs=true on a CUDA device; got cuda_graphs={compute.cuda_graphs}, "
                f"device={options.device!r}"
            )
        kernels = DecodeKernels()
    if captured:
        graphed = GraphedDecode(tuple(compute.graph_batch_buckets), kernels=kernels)  # off CUDA the decode stays eager
    return Cosmos3Instance(
        card=card, options=options, component_loader=load, ops_builder=cosmos3_ops, weights_version=version,
        text_kv_pool=PagedKVPool(text_pool_config(card, options)), graphed_decode=graphed,
        decode_tokens_per_step=compute.decode_tokens_per_step if graphed is not None and compute is not None else 1,
    )
