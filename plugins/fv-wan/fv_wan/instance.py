"""Building a resident Wan instance: component loading and the executable step ops.

Components load lazily per task (text-to-video never loads the VAE encoder or the
CLIP tower). Weights come from the card's checkpoint (a local diffusers-layout
directory or a Hugging Face repo id) or, for embedded tiny cards, from a seeded
random initialisation. Transformers are built on the ``meta`` device and filled
with their weights already in the card's precision, so no second full-size copy
exists.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

import torch

from fv_kernel.api import (
    FP8_LINEAR_PATHS,
    PRECISION_PATHS,
    apply_precision_path,
    select_precision_path,
    torch_dtype,
    CompileCache,
    CompileKey,
    ComputeOptions,
    GraphedStep,
    compile_blocks,
    BuildProblem,
    CheckpointKeyError,
    CheckpointNotFound,
    ComponentSpec,
    InstanceOptions,
    InvalidCard,
    InvalidRequest,
    ModelCard,
    ModelInstance,
    RowAdapters,
    StepOp,
    component_source,
    component_sources_version,
    parse_component_config,
    read_safetensors,
    resolve_source,
    rows_adapted,
    select_compute_tiers,
    select_fused_ops,
)
from fv_wan.checkpoint import is_original_layout, same_architecture, seed_of, transformer_config_from_disk
from fv_wan.component_configs import WanImageEncoderConfig, WanTextEncoderConfig
from fv_wan.models.encoders import WanImageEncoder, WanTextEncoder
from fv_wan.models.transformer import (
    IGNORED_CHECKPOINT_KEY_PATTERN,
    WanStateDictError,
    WanTransformer,
    WanTransformerConfig,
    cast_for_inference,
    load_wan_state_dict,
    original_rename_map,
)
from fv_wan.fp8 import install_fp8_checkpoint, read_safetensors_metadata, split_fp8_checkpoint
from fv_wan.models.vae import CausalCache, WanVAE, WanVAEConfig

__all__ = ["build_wan_instance", "configure_transformer", "load_transformer", "load_vae", "load_text_encoder", "load_image_encoder", "wan_ops", "dit_inputs", "adapter_routing"]

def _component_dtype(card: ModelCard, component_id: str, options: InstanceOptions) -> torch.dtype:
    policy = card.components[component_id].precision_policy
    precision = options.precision or card.precision.default
    return torch_dtype(policy.dtype if policy.dtype != "card" else precision)


def _folder(card: ModelCard, component_id: str, options: InstanceOptions) -> Path | None:
    """The checkpoint folder of a component (or the one file the deployment gives it,
    ``component_sources``), or None for seeded random weights (:func:`seed_of`)."""
    own = component_source(options, component_id)
    if own is not None:
        return own
    if seed_of(card, component_id, options) is not None:  # always so without a source
        return None
    source = options.source or card.checkpoint.source
    assert source is not None  # seed_of seeds every component of a card without one
    ckpt = card.checkpoint.components[component_id]
    return resolve_source(source, subfolder=ckpt.subfolder, local_files_only=options.local_files_only)


def _component_config(spec: ComponentSpec, expected: type, default: Any) -> Any:
    """``spec.config`` parsed through the card's ``config_schema`` (``default`` when it names none):
    the parser ``fv cards validate`` ran, so a card that validated loads the config it checked."""
    config = parse_component_config(spec, default=default)
    if not isinstance(config, expected):
        raise InvalidCard([BuildProblem(
            f"components.{spec.component_id}.config_schema",
            f"{spec.config_schema!r} parses to {type(config).__name__}; this loader needs a {expected.__name__}",
        )])
    return config


def _seeded(seed: int, build: Any) -> Any:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def configure_transformer(
    model: WanTransformer, options: InstanceOptions, compute: ComputeOptions | None = None, *, registry: Any = None,
    assumption: Any = None,
) -> WanTransformer:
    """Apply the deployment's attention backend and compute tier to a loaded transformer.

    The backend is a named driver (``fv.attention_backends``) of the deployment's enabled
    plugins: ``registry`` (a ``DriverRegistry``), else ``options.registry.attention_backends``
    (the runtime's deploy registry), else the kernel's built-ins alone; a disabled plugin's
    driver is refused naming why. The default ``sdpa`` keeps the model's own
    ``F.scaled_dot_product_attention`` call, so the default path is today's code exactly.
    ``compute`` adds fused kernels and/or per-block compile. ``assumption`` (the card's
    ``recipe.assumes_attention``) configures the driver it names; a ``needs_video_grid`` driver
    (``vsa``) takes the self-attention only, with the layers' ``to_gate_compress`` gates.
    """
    if options.attention_backend != "sdpa":
        from fv_kernel.api import attention_callable, load_attention_backend

        if registry is None and options.registry is not None:
            registry = options.registry.attention_backends
        backend = load_attention_backend(options.attention_backend, registry)
        if assumption is not None and assumption.kind == options.attention_backend:
            backend = backend.for_assumption(assumption)  # the recipe's sparsity / tile
        if backend.needs_video_grid:
            # Self-attention only (with the layers' compression gates); cross-attention stays dense.
            model.set_video_attention(backend.attend_video)  # type: ignore[attr-defined]
        else:
            model.set_attention_fn(attention_callable(backend))
    if compute is None:
        return model
    device = model.patch_embedding.weight.device
    model.set_fused_ops(select_fused_ops(device, compute.fused_ops_for("dit")))
    if compute.compile == "blocks":
        compile_blocks(model.blocks, mode=compute.compile_mode)
    return model


def load_transformer(
    card: ModelCard, component_id: str, options: InstanceOptions, compute: ComputeOptions | None = None,
    *, precision_path: str = "native",
) -> WanTransformer:
    """The transformer on ``precision_path`` (``ModelInstance.precision_path``): on the fp8 linear
    paths its linears are an fp8 file's own layers as stored, else the card's ``fp8_targets``
    quantized here, once; an fp8 file on the other paths is dequantized to the card's precision."""
    if precision_path not in PRECISION_PATHS:
        raise InvalidRequest("precision_path", f"{precision_path!r} is not a precision path", allowed=PRECISION_PATHS)
    model = _load_transformer_weights(card, component_id, options, FP8_LINEAR_PATHS.get(precision_path))
    apply_precision_path(card, component_id, model, precision_path, kernel="auto")
    return configure_transformer(model, options, compute, assumption=card.recipe.assumes_attention)


def _load_transformer_weights(
    card: ModelCard, component_id: str, options: InstanceOptions, fp8_mode: str | None = None,
) -> WanTransformer:
    """The transformer's weights; with ``fp8_mode``, an fp8 file's e4m3 linears load as Fp8Linear."""
    spec = card.components[component_id]
    expected = _component_config(spec, WanTransformerConfig, WanTransformerConfig.from_diffusers_config)
    dtype = _component_dtype(card, component_id, options)
    device = torch.device(options.device)
    folder = _folder(card, component_id, options)
    if folder is None:
        seed = seed_of(card, component_id, options) or 0
        model = _seeded(seed, lambda: WanTransformer(expected))
        model.rope.build_tables(device)
        return cast_for_inference(model.to(device), dtype).eval().requires_grad_(False)
    own_file = folder.is_file()  # a component source: the card's config, its shapes checked below
    where = f"component_sources.{component_id}" if own_file else "model"
    if not own_file:
        config = WanTransformerConfig.from_diffusers_config(transformer_config_from_disk(json.loads((folder / "config.json").read_text())))
        if not same_architecture(config, expected):
            raise CheckpointNotFound(
                f"checkpoint {folder} holds a transformer config that is not card {card.model_id!r}'s "
                f"(e.g. {config.num_layers} layers x {config.num_attention_heads} heads vs {expected.num_layers} x {expected.num_attention_heads})",
                param="model",
            )
    config = expected  # the card's (same architecture; its RoPE table bound)
    state_dict = read_safetensors(folder, device=str(device))
    fp8 = split_fp8_checkpoint(state_dict, read_safetensors_metadata(folder))
    if fp8 is not None:
        state_dict = fp8.tensors
    if is_original_layout(state_dict):
        # The original release's names: renamed (not copied) through the declared key map.
        try:
            renames = original_rename_map(state_dict)
        except WanStateDictError as exc:
            raise CheckpointNotFound(f"checkpoint {folder} (original Wan layout): {exc}", param=where) from None
        state_dict = {renames[k]: v for k, v in state_dict.items()}
        fp8 = fp8.renamed(renames) if fp8 is not None else None
    with torch.device("meta"):
        model = WanTransformer(config)
    if fp8 is not None:
        state_dict = install_fp8_checkpoint(model, fp8, mode=fp8_mode, dtype=dtype)  # type: ignore[arg-type]
    expected = set(model.state_dict())
    given = {k for k in state_dict if not IGNORED_CHECKPOINT_KEY_PATTERN.search(k)}
    if expected != given:
        raise CheckpointKeyError(component_id, sorted(expected - given), sorted(given - expected))
    _check_shapes(model, state_dict, card=card, folder=folder, param=where)
    load_wan_state_dict(model, state_dict, assign=True)
    model.rope.build_tables(device)
    return cast_for_inference(model, dtype).eval().requires_grad_(False)


def _check_shapes(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor], *, card: ModelCard, folder: Path,
                  param: str) -> None:
    """A typed error naming the first tensor whose shape is not the card's (a file of another model size
    has the same keys), before torch's load would fail deep inside."""
    own = model.state_dict()
    for key, tensor in state_dict.items():
        if key in own and tuple(tensor.shape) != tuple(own[key].shape):
            raise CheckpointNotFound(
                f"{param}: {folder} does not hold the transformer of card {card.model_id!r}: {key} is "
                f"{list(tensor.shape)}, the card's is {list(own[key].shape)}", param=param,
            )


def load_vae(card: ModelCard, component_id: str, options: InstanceOptions) -> WanVAE:
    """The VAE, keeping only the half this component is (``vae_encoder`` or ``vae_decoder``)."""
    config = _component_config(card.components[component_id], WanVAEConfig, WanVAEConfig.from_diffusers_config)
    dtype = _component_dtype(card, component_id, options)
    device = torch.device(options.device)
    folder = _folder(card, component_id, options)
    keep_encoder = component_id == "vae_encoder"
    if folder is None:
        vae = _seeded(seed_of(card, component_id, options) or 0, lambda: WanVAE(config))
    else:
        disk = json.loads((folder / "config.json").read_text())
        found = WanVAEConfig.from_diffusers_config(disk)
        if found.z_dim != config.z_dim or found.base_dim != config.base_dim:
            raise CheckpointNotFound(f"checkpoint {folder} holds a VAE that is not card {card.model_id!r}'s", param="model")
        state_dict = read_safetensors(folder, device=str(device))
        with torch.device("meta"):
            vae = WanVAE(found)
        missing = sorted(set(vae.state_dict()) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(vae.state_dict()))
        if missing or unexpected:
            raise CheckpointKeyError(component_id, missing, unexpected)
        vae.load_state_dict(state_dict, strict=True, assign=True)
    # Drop the unused half: text-to-video never holds encoder weights, decoding never holds the encoder.
    if keep_encoder:
        vae.decoder = None  # type: ignore[assignment]
        vae.post_quant_conv = None  # type: ignore[assignment]
    else:
        vae.encoder = None  # type: ignore[assignment]
        vae.quant_conv = None  # type: ignore[assignment]
    return vae.to(device=device, dtype=dtype).eval().requires_grad_(False)


def _load_encoder(
    card: ModelCard, component_id: str, options: InstanceOptions, encoder_cls: Any, config_cls: type, width_field: str
) -> Any:
    """A transformers-backed encoder: seeded tiny weights for embedded cards, else ``from_pretrained``.

    ``width_field`` (``d_model`` / ``hidden_size``) is the width the card's config may pin; a
    checkpoint encoder of another width is refused here, naming both, not deep in the DiT.
    """
    spec = card.components[component_id]
    config = _component_config(spec, config_cls, config_cls.model_validate)
    dtype = _component_dtype(card, component_id, options)
    source = options.source or card.checkpoint.source
    seed = seed_of(card, component_id, options)
    if seed is not None:  # always so without a source
        tiny = config.tiny.model_dump() if config.tiny is not None else {}
        encoder = encoder_cls.tiny(seed, **tiny)
        return encoder.to(device=options.device, dtype=dtype).eval().requires_grad_(False)
    root = resolve_source(source, local_files_only=options.local_files_only)
    encoder = encoder_cls.from_pretrained(root, dtype=dtype, device=options.device).requires_grad_(False)
    expected, found = getattr(config, width_field), getattr(encoder.model.config, width_field, None)
    if expected is not None and found != expected:
        raise CheckpointNotFound(
            f"checkpoint {source} holds a {component_id} of {width_field} {found}; card {card.model_id!r} "
            f"expects {width_field} {expected}",
            param="model",
        )
    return encoder


def load_text_encoder(card: ModelCard, component_id: str, options: InstanceOptions) -> WanTextEncoder:
    return _load_encoder(card, component_id, options, WanTextEncoder, WanTextEncoderConfig, "d_model")


def load_image_encoder(card: ModelCard, component_id: str, options: InstanceOptions) -> WanImageEncoder:
    return _load_encoder(card, component_id, options, WanImageEncoder, WanImageEncoderConfig, "hidden_size")


_LOADERS = MappingProxyType(
    {"dit": load_transformer, "vae": load_vae, "text_encoder": load_text_encoder, "image_encoder": load_image_encoder}
)


# --------------------------------------------------------------------------- ops


def wan_ops(
    instance: ModelInstance, *, compute: ComputeOptions | None = None, compile_cache: CompileCache | None = None
) -> dict[str, StepOp]:
    """The executable steps of a Wan instance, over whichever components are loaded.

    With ``compute.cuda_graphs`` the DiT ops replay CUDA graphs per batch bucket, kept in
    ``compile_cache`` (which outlives op rebuilds, so nothing is captured twice).
    """
    comps = instance.components
    ops: dict[str, StepOp] = {}

    if "text_encoder" in comps:
        text_encoder: WanTextEncoder = comps["text_encoder"]

        def encode_text(inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
            with rows_adapted(text_encoder, adapter_routing(instance, inputs, "text_encoder")):
                embeds = text_encoder.embed_ids(inputs["ids"], inputs["mask"], int(params["max_len"]), dtype=torch.float32)
            return {"embeds": embeds}

        ops["encode_text"] = StepOp("encode_text", encode_text)

    if "image_encoder" in comps:
        image_encoder: WanImageEncoder = comps["image_encoder"]

        def encode_image(inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
            return {"image_embeds": image_encoder.embed_pixels(inputs["pixel_values"]).float()}

        ops["encode_image"] = StepOp("encode_image", encode_image)

    if "vae_encoder" in comps:
        vae_enc: WanVAE = comps["vae_encoder"]

        def vae_encode(inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
            video = inputs["video"].to(next(vae_enc.parameters()))
            mean = vae_enc.encode_latent(video)
            return {"latent": vae_enc.normalize_latents(mean.float())}

        ops["vae_encode"] = StepOp("vae_encode", vae_encode)

    for expert in ("transformer", "transformer_2"):
        if expert in comps:
            graphs = None
            if compute is not None and compute.cuda_graphs:
                graphs = _graphed_forward(instance, expert, comps[expert], compute, compile_cache or CompileCache())
            ops[f"dit_forward:{expert}"] = _dit_op(expert, comps[expert], graphs, instance=instance)

    if "vae_decoder" in comps:
        vae_dec: WanVAE = comps["vae_decoder"]

        def vae_decode_frame(inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
            cache_tensors = {k[len("cache."):]: v for k, v in inputs.items() if k.startswith("cache.")}
            cache = CausalCache.from_tensors(cache_tensors) if cache_tensors else vae_dec.new_decode_cache()
            ref = next(vae_dec.parameters())
            z = vae_dec.denormalize_latents(inputs["z"].to(device=ref.device, dtype=torch.float32)).to(ref.dtype)
            frames, cache = vae_dec.decode_step(z, cache, tiling=params.get("tiling"))
            video = (frames.float() / 2 + 0.5).clamp(0, 1)
            if video.is_cuda:
                # The frames leave the device as they are decoded, into pinned host memory (tens of GB/s;
                # the Engine waits for a batch's device work before reading its outputs). Copying the
                # whole video at the end, from pageable memory, took 223 ms of a 2 s fastwan request.
                video = video.to("cpu", non_blocking=True)
            out = {"frames": video}
            if not params.get("last", False):  # the stream's last frame needs no history after it
                # In the activations' own (mostly channels-last) layout: the next step reads it as it is.
                out.update({f"cache.{k}": v for k, v in cache.to_tensors(contiguous=False).items()})
            return out

        ops["vae_decode_frame"] = StepOp("vae_decode_frame", vae_decode_frame)

        def vae_decode_lower(inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
            ref = next(vae_dec.parameters())
            z = vae_dec.denormalize_latents(inputs["z"].to(device=ref.device, dtype=torch.float32)).to(ref.dtype)
            return {"lower": vae_dec.decode_lower(z)}

        def vae_decode_halo_tile(inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
            lower = inputs["lower"].to(next(vae_dec.parameters()).device)
            tile = vae_dec.halo_tiles(lower.shape[-2], lower.shape[-1], params["halo"])[int(params["tile"])]
            video = (vae_dec.decode_halo_tile(lower, tile).float() / 2 + 0.5).clamp(0, 1)
            # Off the device as it is decoded, as vae_decode_frame's frames.
            return {"frames": video.to("cpu", non_blocking=True) if video.is_cuda else video}

        ops["vae_decode_lower"] = StepOp("vae_decode_lower", vae_decode_lower)
        ops["vae_decode_halo_tile"] = StepOp("vae_decode_halo_tile", vae_decode_halo_tile)
    return ops


def _graphed_forward(
    instance: ModelInstance, expert: str, model: WanTransformer, compute: ComputeOptions, cache: CompileCache
) -> GraphedStep:
    key = CompileKey(
        model=instance.model_id, component=expert, kind="diffusion_step", precision=instance.precision,
        backend=instance.options.attention_backend, tier=compute.tier,
    )

    def forward(inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"v": model(inputs["x"], inputs["t"], inputs["context"], inputs.get("image_embeds")).float()}

    return GraphedStep(forward, key_base=key, cache=cache, buckets=compute.graph_batch_buckets)


def dit_inputs(
    model: WanTransformer, inputs: Mapping[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A denoise step's ``x``, ``t``, ``context`` and optional ``image_embeds`` on the transformer's
    device, in its dtype (``t`` keeps its own)."""
    ref = model.patch_embedding.weight
    image = inputs.get("image_embeds")
    return (
        inputs["x"].to(device=ref.device, dtype=ref.dtype),
        inputs["t"].to(ref.device),
        inputs["context"].to(device=ref.device, dtype=ref.dtype),
        image.to(device=ref.device, dtype=ref.dtype) if image is not None else None,
    )


def _graph_batch(
    x: torch.Tensor, t: torch.Tensor, context: torch.Tensor, image: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """A forward's inputs as the captured graph takes them (``_graphed_forward``)."""
    batch = {"x": x, "t": t.float(), "context": context}
    if image is not None:
        batch["image_embeds"] = image
    return batch


def adapter_routing(
    instance: ModelInstance | None, inputs: Mapping[str, torch.Tensor], component: str, rows: slice | list[int] | None = None
) -> RowAdapters | None:
    """The per-row adapters of a forward of ``component`` over ``rows`` of the step's inputs (all
    by default): None when the step carries no ``adapter_ids`` or no selected row has an adapter."""
    ids = inputs.get("adapter_ids")
    if ids is None or instance is None:
        return None
    scales = inputs["adapter_scales"]
    if rows is not None:
        ids, scales = ids[rows], scales[rows]
    return instance.row_adapters({"adapter_ids": ids, "adapter_scales": scales}, component)


def _dit_op(
    expert: str, model: WanTransformer, graphs: GraphedStep | None = None, *, instance: ModelInstance | None = None
) -> StepOp:
    def dit_forward(inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """One denoise forward over N rows (guidance branches, and requests when fused).

        ``dispatch="sequential"`` runs one forward per guidance branch (diffusers' two-forward CFG):
        the rows are request-major, ``params["branches"]`` per request, and the requests fused
        into this step share their branch's forward. ``"batched"`` runs all rows as one batch.
        Same math, different kernels. Rows with adapters get them per row (``adapter_ids``); a
        forward with any skips the CUDA graphs, which capture no hooks.
        """
        x, t, context, image = dit_inputs(model, inputs)
        hooks = params.get("block_hooks")
        if hooks is not None:
            # Block hooks keep per-branch state: each row runs alone through them.
            rows = []
            for i in range(x.shape[0]):
                # the adapters reach prepare's embedders and finish's proj_out, not only the blocks
                with rows_adapted(model, adapter_routing(instance, inputs, expert, slice(i, i + 1))):
                    inputs_i = model.prepare(x[i : i + 1], t[i : i + 1], context[i : i + 1], None if image is None else image[i : i + 1])
                    hidden = hooks.run(i, _WanBlocks(model, inputs_i), inputs_i.x)
                    rows.append(model.finish(hidden, inputs_i))
            return {"v": torch.cat(rows).float()}
        runner = None
        branches = int(params.get("branches", x.shape[0]))  # without it: every row is its own branch
        if params.get("dispatch", "batched") == "sequential" and x.shape[0] > 1 and branches > 0:
            if x.shape[0] % branches:
                raise ValueError(f"dit_forward: {x.shape[0]} rows are not whole requests of {branches} branches")
            def branch(j: int) -> torch.Tensor:
                rows = (x[j::branches], t[j::branches], context[j::branches], None if image is None else image[j::branches])
                routing = adapter_routing(instance, inputs, expert, slice(j, None, branches))
                if graphs is not None and routing is None:  # each branch's forward replays its batch size's graph
                    return graphs(_graph_batch(*rows))["v"]
                with rows_adapted(model, routing):
                    return model(*rows, block_runner=runner).float()

            out = torch.stack([branch(j) for j in range(branches)], dim=1).flatten(0, 1)  # back to request-major rows
        else:
            routing = adapter_routing(instance, inputs, expert)
            if graphs is not None and routing is None:
                return graphs(_graph_batch(x, t, context, image))
            with rows_adapted(model, routing):
                out = model(x, t, context, image, block_runner=runner)
        return {"v": out.float()}

    return StepOp(f"dit_forward:{expert}", dit_forward, supports_block_hooks=True)


class _WanBlocks:
    """The Wan block stack of one prepared forward, as block hooks see it."""

    def __init__(self, model: WanTransformer, inputs: Any) -> None:
        self._model, self._inputs = model, inputs

    @property
    def num_blocks(self) -> int:
        return self._model.num_layers

    def run(self, start: int, stop: int, hidden: torch.Tensor) -> torch.Tensor:
        for index in range(start, stop):
            hidden = self._model.run_block(index, hidden, self._inputs)
        return hidden


# --------------------------------------------------------------------------- factory


def build_wan_instance(
    card: ModelCard, options: InstanceOptions, compute: ComputeOptions | None = None
) -> ModelInstance:
    """The card's factory: a resident instance whose components load on first use.

    ``compute`` (fused kernels, per-block compile, CUDA graphs; default ``options.compute``,
    which the deploy config sets per card) is optional; without it the instance runs the
    eager code with ``options.attention_backend``. Each fast tier passes through its parity
    contract (``select_compute_tiers``), per component: ``fused_ops="auto"`` runs the Triton
    kernels on the DiT and on the VAE decoder each only where the fused tier's recorded
    measurement on that component passes; a tier named explicitly runs, warned when it does not.
    The instance's ``compute_selection`` holds what was resolved for each component.
    """
    compute = compute if compute is not None else options.compute
    selection = select_compute_tiers(
        compute, card, device=options.device, precision=options.precision or card.precision.default,
        attention_backend=options.attention_backend,
    )
    compute = selection.compute
    if options.device.startswith("cuda") and not torch.cuda.is_available():
        raise CheckpointNotFound(f"device {options.device!r} was asked for but CUDA is not available", param="device")

    # build_instance resolved it already; a direct call resolves it here (auto, the recipe's path).
    precision_path = options.precision_path if options.precision_path in PRECISION_PATHS else select_precision_path(card, options).path

    def load(component_id: str) -> Any:
        kind = card.components[component_id].kind
        if kind == "dit":
            return load_transformer(card, component_id, options, compute, precision_path=precision_path)
        component = _LOADERS[kind](card, component_id, options)
        if kind == "vae" and component_id == "vae_decoder" and compute is not None:
            # The VAE's own switch (selected apart from the DiT's): the decoder's norm + SiLU passes.
            component.set_fused_ops(select_fused_ops(options.device, compute.fused_ops_for("vae")))
        return component

    source = options.source or card.checkpoint.source
    version = f"seeded:{card.model_id}" if source is None else f"checkpoint:{Path(source).name if Path(source).exists() else source}"
    version += component_sources_version(options)  # another transformer file is other weights
    ops_builder = wan_ops if compute is None else functools.partial(wan_ops, compute=compute, compile_cache=CompileCache())
    return ModelInstance(card=card, options=options, component_loader=load, ops_builder=ops_builder, weights_version=version,
                         compute_selection=selection)
