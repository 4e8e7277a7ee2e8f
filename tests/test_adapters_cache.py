"""The adapter registry and cache (disk → CPU → device, LRU, budgets, pins), uploads, the deploy
config's ``adapters:`` section, admission's adapter reservation and adapter-keyed caches."""

from __future__ import annotations

import hashlib

from pathlib import Path

import pytest
import torch

from fv_kernel.cache.adapters import AdapterRegistry, AdapterSettings
from fv_kernel.cache.feature import FeatureCache
from fv_kernel.cache.keys import CacheKey, content_hash
from fv_kernel.card.spec import AdapterRef
from fv_kernel.config import DeployConfig, DeployConfigError, load_deploy_config
from fv_kernel.deploy.engine import adapter_registry
from fv_kernel.errors import AdapterFileError, CapacityError, UnknownAdapter
from fv_kernel.model.adapters import convert_peft
from fv_kernel.model.instance import build_instance
from fv_kernel.model.validate import resolve_for_instance
from fv_kernel.request.request import Request, TextPart
from fv_kernel.request.types import TaskType
from fv_kernel.runtime.admission import AdmissionController, Budgets, Reservation
from fv_kernel.testing.adapters import peft_lora_tensors, write_peft_lora
from fv_kernel.testing.toy import ByteCodec, ToyConfig, build_component, toy_card


def lora(tmp: Path, name: str, *, seed: int = 0, rank: int = 2, component: str = "dit",
         targets: tuple[str, ...] = ("blocks.0.qkv", "proj_out")) -> Path:
    module = build_component(component, 1)
    return write_peft_lora(tmp / f"{name}.safetensors", peft_lora_tensors(module, component, targets, seed=seed, rank=rank))


def size_of(tmp: Path, rank: int = 2) -> int:
    probe = AdapterRegistry(convert_peft)
    (tmp / "probe").mkdir(exist_ok=True)
    return probe.add_file(lora(tmp / "probe", "p", rank=rank)).weight_bytes


# -- names, versions, listing -----------------------------------------------------------------------


def test_registered_adapters_are_listed_with_what_they_change(tmp_path: Path) -> None:
    reg = AdapterRegistry(convert_peft)
    info = reg.add_file(lora(tmp_path, "style", rank=3))
    assert (info.name, info.components, info.rank, info.source) == ("style", ("dit",), 3, "file")
    assert info.size_bytes == (tmp_path / "style.safetensors").stat().st_size and len(info.version) == 16
    assert info.weight_bytes == sum(t.numel() * 4 for t in peft_lora_tensors(build_component("dit", 1), "dit",
                                                                               ["blocks.0.qkv", "proj_out"], rank=3).values())
    assert [i.name for i in reg.list()] == ["style"]
    with pytest.raises(UnknownAdapter, match="did you mean 'style'"):
        reg.get("stlye")


def test_scan_registers_every_safetensors_file_by_stem(tmp_path: Path) -> None:
    lora(tmp_path, "a")
    lora(tmp_path, "b", seed=1)
    (tmp_path / "notes.txt").write_text("not an adapter")
    reg = AdapterRegistry(convert_peft)
    assert [i.name for i in reg.scan(tmp_path)] == ["a", "b"]
    assert {i.source for i in reg.list()} == {"directory"}
    with pytest.raises(AdapterFileError, match="is not a directory"):
        reg.scan(tmp_path / "missing")


def test_a_file_that_maps_to_nothing_is_refused_at_registration(tmp_path: Path) -> None:
    tensors = peft_lora_tensors(build_component("dit", 1), "dit", ["proj_out"])
    tensors["dit.proj_out.lokr_w1"] = torch.ones(2)
    path = write_peft_lora(tmp_path / "odd.safetensors", tensors)
    reg = AdapterRegistry(convert_peft)
    with pytest.raises(Exception, match="dit.proj_out.lokr_w1"):
        reg.add_file(path)
    assert reg.list() == []


# -- uploads ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("filename", ["../evil.safetensors", "a/b.safetensors", "..\\x.safetensors", "/abs.safetensors", ""])
def test_uploads_refuse_paths_in_the_file_name(tmp_path: Path, filename: str) -> None:
    reg = AdapterRegistry(convert_peft, AdapterSettings(upload_directory=tmp_path / "up"))
    with pytest.raises(AdapterFileError, match="bare file name") as caught:
        reg.add_bytes(filename, lora(tmp_path, "x").read_bytes())
    assert caught.value.param == "file"
    assert not (tmp_path / "evil.safetensors").exists()


def test_uploads_are_size_checked_and_stored_by_content(tmp_path: Path) -> None:
    data = lora(tmp_path, "x").read_bytes()
    small = AdapterRegistry(convert_peft, AdapterSettings(max_file_bytes=len(data) - 1))
    with pytest.raises(AdapterFileError, match="over the limit"):
        small.add_bytes("x.safetensors", data)
    with pytest.raises(AdapterFileError, match="must end in .safetensors"):
        small.add_bytes("x.pt", data)
    reg = AdapterRegistry(convert_peft, AdapterSettings(upload_directory=tmp_path / "up"))
    info = reg.add_bytes("mine.safetensors", data, name="my-style")
    assert info.name == "my-style" and info.source == "upload"
    stored = hashlib.sha256(data).hexdigest()[:16]
    assert info.path == str((tmp_path / "up" / f"{stored}.safetensors").resolve())
    with pytest.raises(AdapterFileError, match="adapter name"):
        reg.add_bytes("x.safetensors", data, name="../../etc")
    scratch = AdapterRegistry(convert_peft)
    kept = scratch.add_bytes("x.safetensors", data)
    assert Path(kept.path).read_bytes() == data and "fv-adapter-uploads-" in kept.path  # on disk, not in memory
    del scratch
    import gc

    gc.collect()
    assert not Path(kept.path).exists()  # the temporary directory goes with its registry


# -- tiers --------------------------------------------------------------------------------------------


def test_device_tier_is_lru_within_its_budget_and_never_evicts_a_pinned_adapter(tmp_path: Path) -> None:
    one = size_of(tmp_path)
    reg = AdapterRegistry(convert_peft, AdapterSettings(device_budget_bytes=2 * one))
    a, b, c = (reg.add_file(lora(tmp_path, n, seed=i)).version for i, n in enumerate("abc"))
    reg.load(a, "cpu")
    reg.load(b, "cpu")
    reg.load(a, "cpu")  # a is now the most recently used
    reg.load(c, "cpu")
    assert reg.resident(a, "cpu") and reg.resident(c, "cpu") and not reg.resident(b, "cpu")
    assert reg.stats()["host"].bytes >= 3 * one  # the CPU tier keeps all three
    assert reg.stats()["cpu"].bytes == 2 * one and reg.stats()["cpu"].evictions == 1
    reg.acquire([a, c], "cpu")
    with pytest.raises(CapacityError, match="adapters.device_budget_bytes"):
        reg.load(b, "cpu")
    reg.release([c], "cpu")
    reg.load(b, "cpu")  # c, no longer pinned, makes room
    assert reg.resident(a, "cpu") and reg.resident(b, "cpu") and not reg.resident(c, "cpu")
    assert reg.pinned(a, "cpu") == 1 and reg.pinned(c, "cpu") == 0


def test_cpu_tier_evicts_and_reloads_from_disk_and_refuses_a_changed_file(tmp_path: Path) -> None:
    one = size_of(tmp_path)
    reg = AdapterRegistry(convert_peft, AdapterSettings(cpu_budget_bytes=one))
    a = reg.add_file(lora(tmp_path, "a"))
    reg.add_file(lora(tmp_path, "b", seed=1))  # evicts a from the CPU tier
    assert reg.stats()["host"].entries == 1 and reg.stats()["host"].evictions == 1
    weights = reg.weights(a.version, "dit", "cpu")  # read from disk again
    expected = convert_peft(dict(__import__("safetensors.torch", fromlist=["load_file"]).load_file(a.path)), name="a", metadata={})
    assert torch.equal(weights.low_rank["proj_out"].up, expected["dit"].low_rank["proj_out"].up)
    reg2 = AdapterRegistry(convert_peft, AdapterSettings(cpu_budget_bytes=0))
    info = reg2.add_file(lora(tmp_path, "c", seed=2))
    lora(tmp_path, "c", seed=3)  # the file changes under the registry
    with pytest.raises(AdapterFileError, match="changed since it was registered"):
        reg2.load(info.version, "cpu")


def test_cpu_tier_is_page_locked_on_cuda_hosts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = lora(tmp_path, "a")
    plain = AdapterRegistry(convert_peft)
    weights = plain.weights(plain.add_file(path).version, "dit", "cpu")
    pinned_ids: set[int] = set()

    def fake_pin(self: torch.Tensor) -> torch.Tensor:  # pinning needs a CUDA driver; record the call instead
        copy = self.clone()
        pinned_ids.add(id(copy))
        return copy

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    reg = AdapterRegistry(convert_peft)
    version = reg.add_file(path).version
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the device tier here is the CPU
    held = reg._cpu_weights(version)["dit"]
    tensors = [t for u in held.low_rank.values() for t in (u.down, u.up)]
    assert tensors and all(id(t) in pinned_ids for t in tensors)
    assert all(id(u.down) not in pinned_ids for u in weights.low_rank.values())  # without CUDA: not pinned
    assert held.version == weights.version


# -- config -------------------------------------------------------------------------------------------


def test_the_adapters_section_is_validated_with_clear_errors(tmp_path: Path) -> None:
    config = tmp_path / "deploy.yaml"
    config.write_text(f"adapters:\n  directory: {tmp_path}\n  device_budget_bytes: 512MiB\n  max_stack: 3\n  merge: never\n")
    loaded = load_deploy_config(config)
    assert loaded.adapters is not None and loaded.adapters.device_budget_bytes == 512 * 2**20
    assert (loaded.adapters.max_stack, loaded.adapters.merge) == (3, "never")
    assert DeployConfig().adapters is None  # off unless configured
    for body, needle in [
        (f"adapters:\n  directory: {tmp_path / 'nope'}\n", "adapters.directory: .*is not a directory"),
        ("adapters:\n  merge: always\n", "adapters.merge: .*'never' or 'auto'"),
        ("adapters:\n  max_stack: 0\n", "adapters.max_stack"),
        ("adapters:\n  cpu_budget_bytes: lots\n", "cpu_budget_bytes: 'lots' is not a size"),
        ("adapters:\n  dir: x\n", "adapters.dir: Extra inputs are not permitted"),
    ]:
        config.write_text(body)
        with pytest.raises(DeployConfigError, match=needle):
            load_deploy_config(config)


def test_the_deployment_registry_scans_its_directory_and_needs_one_format(tmp_path: Path) -> None:
    lora(tmp_path, "style")
    config = DeployConfig(adapters=AdapterSettings(directory=tmp_path))
    registry = adapter_registry(config, [toy_card("toy-dit")])
    assert registry is not None and registry.names() == ["style"]
    assert adapter_registry(DeployConfig(), [toy_card("toy-dit")]) is None
    assert adapter_registry(DeployConfig(adapters=AdapterSettings(enabled=False)), [toy_card("toy-dit")]) is None
    other = toy_card("toy-lm").model_copy(update={"adapter_format": "fv_kernel.testing.adapters:peft_lora_tensors"})
    with pytest.raises(DeployConfigError, match="different formats"):
        adapter_registry(config, [toy_card("toy-dit"), other])


# -- admission ----------------------------------------------------------------------------------------


def test_admission_reserves_each_adapter_version_once_per_device() -> None:
    ctl = AdmissionController(Budgets(memory_bytes=10_000))
    ctl.set_adapter_capacity("cpu", 300)
    r = lambda rid, adapters: Reservation(rid, 1000, 100, 0, 0.0, device="cpu", adapters=adapters)  # noqa: E731
    assert ctl.try_admit(r("a", {"v1": 200})) is None
    assert ctl.try_admit(r("b", {"v1": 200})) is None  # shares v1's copy
    assert ctl.adapter_bytes_in_use("cpu") == 200 and ctl.resident_in_use("cpu") == 2200
    assert ctl.try_admit(r("c", {"v2": 200})) == "adapter_memory"  # v1 + v2 exceed 300
    ctl.release("a")
    ctl.release("b")
    assert ctl.try_admit(r("c", {"v2": 200})) is None
    with pytest.raises(CapacityError, match="adapters.device_budget_bytes") as caught:
        ctl.try_admit(r("d", {"v3": 400}))
    assert caught.value.param == "adapters"
    tight = AdmissionController(Budgets(memory_bytes=1250))
    assert tight.try_admit(r("e", {})) is None
    tight.release("e")
    with pytest.raises(CapacityError, match=r"adapters 200"):
        tight.try_admit(r("f", {"v1": 200}))  # 1000 + 100 + 200 > 1250: the adapter counts against memory


# -- adapter-keyed caches -----------------------------------------------------------------------------


def test_a_text_encoder_adapter_never_gets_stale_embeddings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reg = AdapterRegistry(convert_peft)
    reg.add_file(lora(tmp_path, "words", component="lm", targets=("qkv.0", "out.1")))
    inst = build_instance(toy_card("toy-dit"))
    inst.adapters = reg
    lm = inst.component("lm")
    cache = FeatureCache()

    def encode(request: Request) -> torch.Tensor:
        """A text encode with a feature cache keyed the kernel's way (as a family's encode step is)."""
        ids = torch.tensor([ByteCodec().encode(request.text("prompt") or "", ToyConfig.text_len)])
        key = CacheKey(model_id=inst.model_id, component_id="lm", weights_version=inst.weights_version,
                       adapter_versions=inst.adapter_versions(request, "lm"), precision=inst.precision,
                       input_hash=content_hash(ids))
        hit = cache.get(key)
        if hit is not None:
            return hit["hidden"]
        from fv_kernel.compute.lora import rows_adapted

        with rows_adapted(lm, inst.row_adapters(inst.adapter_inputs(request, "lm"), "lm")):
            hidden, _ = lm.forward_with_cache(ids, None)
        cache.put(key, {"hidden": hidden})
        return hidden

    def req(*adapters: AdapterRef) -> Request:
        return resolve_for_instance(inst, Request(model="toy-dit", task=TaskType.TEXT_TO_VIDEO,
                                                  inputs=(TextPart(text="a fox"),), adapters=adapters))

    plain = encode(req())
    styled = encode(req(AdapterRef(name="words")))
    half = encode(req(AdapterRef(name="words", scale=0.5)))
    assert not torch.allclose(plain, styled, atol=1e-5) and not torch.allclose(styled, half, atol=1e-5)
    assert cache.stats.misses == 3
    assert torch.equal(encode(req(AdapterRef(name="words"))), styled) and cache.stats.hits == 1
    # A DiT-only adapter does not split the text encoder's cache.
    reg.add_file(lora(tmp_path, "style"))
    assert torch.equal(encode(req(AdapterRef(name="style"))), plain)
    # Negative control: a key without the adapter serves the base embeddings to the adapted request.
    monkeypatch.setattr(type(inst), "adapter_versions", lambda self, request, component: ())
    cache.clear()
    encode(req())
    assert torch.equal(encode(req(AdapterRef(name="words"))), plain)


def test_two_names_for_the_same_bytes_are_both_registered(tmp_path: Path) -> None:
    reg = AdapterRegistry(convert_peft)
    first = reg.add_file(lora(tmp_path, "a"))
    second = reg.add_bytes("b.safetensors", (tmp_path / "a.safetensors").read_bytes())
    assert first.version == second.version and reg.get("a").name == "a" and reg.get("b").name == "b"
    assert reg.id_of(first.version) == reg.id_of(second.version)  # one copy in the tiers


def test_an_upload_that_does_not_convert_is_not_written(tmp_path: Path) -> None:
    tensors = peft_lora_tensors(build_component("dit", 1), "dit", ["proj_out"])
    tensors["dit.proj_out.hada_w1_a"] = torch.ones(2)
    data = __import__("safetensors.torch", fromlist=["save"]).save(tensors)
    reg = AdapterRegistry(convert_peft, AdapterSettings(upload_directory=tmp_path / "up"))
    with pytest.raises(Exception, match="hada_w1_a"):
        reg.add_bytes("bad.safetensors", data)
    assert not (tmp_path / "up").exists() or not any((tmp_path / "up").iterdir())
