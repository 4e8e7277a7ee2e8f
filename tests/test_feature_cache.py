"""The feature cache (design §7.2) and its keys (§7.1): hits, misses, the byte budget, and key changes.

A cache key holds every field that can change the cached value; a change to any of them
(adapter versions, precision, weights version, input, ...) must miss. The negative
control breaks the key builder (a digest without the precision) and shows that the
precision test then fails. The end-to-end checks through a real encoder loop are in
``plugins/fv-wan/tests/test_feature_cache_wan.py``.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pydantic
import pytest
import torch

from fv_kernel.cache.feature import FeatureCache, apply_cache_writes
from fv_kernel.cache.keys import CacheKey, content_hash


def _key(**change: Any) -> CacheKey:
    fields: dict[str, Any] = dict(
        model_id="m", component_id="text_encoder", weights_version="w1", adapter_versions=(("style", "v1"),),
        precision="fp32", input_hash=content_hash(["a fox", 512]),
    )
    fields.update(change)
    return CacheKey(**fields)


def _value(numel: int = 4, fill: float = 1.0) -> dict[str, torch.Tensor]:
    """A cache value of ``4 * numel`` bytes (fp32)."""
    return {"embeds": torch.full((numel,), fill)}


# --------------------------------------------------------------------------- hits and misses


def test_miss_then_hit_returns_the_stored_tensors() -> None:
    cache = FeatureCache()
    key = _key()
    assert cache.get(key) is None
    value = _value()
    cache.put(key, value)
    first, second = cache.get(key), cache.get(key.digest())  # a key or its digest: the same entry
    assert first is not None and second is not None
    assert first["embeds"] is second["embeds"]  # a hit hands out the one stored tensor, no copy
    assert torch.equal(first["embeds"], value["embeds"])
    assert (cache.stats.hits, cache.stats.misses, cache.stats.evictions) == (2, 1, 0)
    assert len(cache) == 1 and cache.bytes_used == 16


def test_stored_tensors_are_detached() -> None:
    cache = FeatureCache()
    grad = torch.ones(4, requires_grad=True) * 2
    cache.put(_key(), {"embeds": grad})
    hit = cache.get(_key())
    assert hit is not None and not hit["embeds"].requires_grad


# --------------------------------------------------------------------------- key changes


CHANGES: list[tuple[str, Any]] = [
    ("adapter_versions", (("style", "v2"),)),  # a new adapter version
    ("adapter_versions", ()),  # the adapter removed
    ("adapter_versions", (("style", "v1"), ("detail", "v1"))),  # another adapter added
    ("precision", "bf16"),
    ("weights_version", "w2"),
    ("input_hash", content_hash(["a fox ", 512])),  # the text differs by one trailing space
    ("input_hash", content_hash(["a fox", 256])),  # same text, another max length
    ("model_id", "m2"),
    ("component_id", "image_encoder"),
    ("parallel_plan", "tp2"),
    ("loop_id", "text_encode"),
    ("shape_sig", "tokens=256"),
    ("contract_version", "2"),
    ("extra", (("lang", "de"),)),
]


@pytest.mark.parametrize(("field", "value"), CHANGES, ids=[f"{f}={v!r}" for f, v in CHANGES])
def test_a_key_change_misses(field: str, value: Any) -> None:
    cache = FeatureCache()
    cache.put(_key(), _value())
    changed = _key(**{field: value})
    assert changed.digest() != _key().digest()
    assert cache.get(changed) is None, f"a key differing only in {field} was served the old entry"
    assert cache.get(_key()) is not None  # the original entry is still there


def test_every_cache_key_field_is_covered_by_a_change() -> None:
    """A new CacheKey field must get a row in CHANGES (and so a test that changing it misses)."""
    assert set(CacheKey.model_fields) - {field for field, _ in CHANGES} == set()


def test_equal_keys_built_separately_hit() -> None:
    cache = FeatureCache()
    cache.put(_key(), _value())
    assert cache.get(_key(input_hash=content_hash(["a fox", 512]))) is not None


def test_negative_control_a_digest_without_the_precision_fails_the_precision_test(monkeypatch: pytest.MonkeyPatch) -> None:
    """The key-change test is a real check: break the key builder and the precision case fails."""

    def digest_without_precision(self: CacheKey) -> str:
        fields = self.model_dump(mode="json")
        del fields["precision"]
        return content_hash(fields)

    monkeypatch.setattr(CacheKey, "digest", digest_without_precision)
    with pytest.raises(AssertionError):
        test_a_key_change_misses("precision", "bf16")
    test_a_key_change_misses("weights_version", "w2")  # the broken builder still separates the other fields


def test_content_hash_separates_types_shapes_and_dtypes() -> None:
    hashes = {
        content_hash("1"), content_hash(1), content_hash(b"1"), content_hash(["1"]), content_hash({"1": 1}),
        content_hash(torch.zeros(2, 3)), content_hash(torch.zeros(3, 2)), content_hash(torch.zeros(2, 3, dtype=torch.float64)),
        content_hash(["ab", "c"]), content_hash(["a", "bc"]),
    }
    assert len(hashes) == 10
    assert content_hash({"b": 1, "a": 2}) == content_hash({"a": 2, "b": 1})  # dict order is not content
    with pytest.raises(TypeError, match="cannot hash object"):
        content_hash(object())


def test_cache_key_is_strict_and_frozen() -> None:
    with pytest.raises(pydantic.ValidationError, match="dtype"):
        CacheKey(**_key().model_dump(), dtype="fp32")  # type: ignore[arg-type]
    with pytest.raises(pydantic.ValidationError):
        _key().precision = "bf16"  # type: ignore[misc]


# --------------------------------------------------------------------------- the byte budget


def test_least_recently_used_entry_is_evicted_first() -> None:
    cache = FeatureCache(budget_bytes=48)  # three 16-byte entries
    keys = [_key(input_hash=str(i)) for i in range(4)]
    for key in keys[:3]:
        cache.put(key, _value())
    assert cache.get(keys[0]) is not None  # key 0 becomes the most recent; key 1 is now the oldest
    cache.put(keys[3], _value())
    assert cache.get(keys[1]) is None
    assert all(cache.get(k) is not None for k in (keys[0], keys[2], keys[3]))
    assert cache.stats.evictions == 1 and cache.bytes_used == 48 and len(cache) == 3


def test_a_large_entry_evicts_as_many_as_it_needs() -> None:
    cache = FeatureCache(budget_bytes=64)
    for i in range(4):
        cache.put(_key(input_hash=str(i)), _value())  # 4 x 16 bytes: full
    cache.put(_key(input_hash="big"), _value(numel=12))  # 48 bytes: three must go
    assert cache.stats.evictions == 3 and len(cache) == 2 and cache.bytes_used == 64
    assert cache.get(_key(input_hash="3")) is not None and cache.get(_key(input_hash="0")) is None


def test_an_entry_larger_than_the_budget_is_never_cached_and_evicts_nothing() -> None:
    cache = FeatureCache(budget_bytes=32)
    cache.put(_key(input_hash="small"), _value())
    cache.put(_key(input_hash="huge"), _value(numel=9))  # 36 bytes > 32
    assert cache.get(_key(input_hash="huge")) is None
    assert cache.get(_key(input_hash="small")) is not None
    assert cache.stats.evictions == 0 and cache.bytes_used == 16


def test_zero_budget_caches_nothing_and_negative_budget_is_refused() -> None:
    cache = FeatureCache(budget_bytes=0)
    cache.put(_key(), _value())
    assert cache.get(_key()) is None and cache.bytes_used == 0
    with pytest.raises(ValueError, match="budget_bytes must be >= 0, got -1"):
        FeatureCache(budget_bytes=-1)


def test_putting_a_key_again_replaces_its_entry_and_its_bytes() -> None:
    cache = FeatureCache(budget_bytes=1024)
    cache.put(_key(), _value(numel=4, fill=1.0))
    cache.put(_key(), _value(numel=8, fill=2.0))
    hit = cache.get(_key())
    assert hit is not None and hit["embeds"].shape == (8,) and float(hit["embeds"][0]) == 2.0
    assert len(cache) == 1 and cache.bytes_used == 32


def test_clear_drops_every_entry() -> None:
    cache = FeatureCache()
    for i in range(3):
        cache.put(_key(input_hash=str(i)), _value())
    cache.clear()
    assert len(cache) == 0 and cache.bytes_used == 0 and cache.get(_key(input_hash="0")) is None


def test_concurrent_use_keeps_the_byte_count_exact() -> None:
    cache = FeatureCache(budget_bytes=16 * 50)

    def work(worker: int) -> None:
        for i in range(200):
            key = _key(input_hash=f"{worker}-{i % 80}")
            if cache.get(key) is None:
                cache.put(key, _value())

    threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert cache.bytes_used == 16 * len(cache) <= cache.budget_bytes
    assert cache.stats.hits + cache.stats.misses == 4 * 200


# --------------------------------------------------------------------------- writes declared by a plan


def test_apply_cache_writes_stores_each_declared_row_as_a_private_copy() -> None:
    cache = FeatureCache()
    rows = torch.arange(6.0).reshape(3, 2)
    writes = SimpleNamespace(writes=(
        SimpleNamespace(cache="feature_cache", key="k0", output="embeds", index=0),
        SimpleNamespace(cache="feature_cache", key="k2", output="embeds", index=2),
        SimpleNamespace(cache="feature_cache", key="all", output=None, index=None),
        SimpleNamespace(cache="no_such_cache", key="k1", output="embeds", index=1),  # not on this engine: ignored
    ))
    apply_cache_writes(writes, {"embeds": rows}, {"feature_cache": cache})
    k0, k2, everything = cache.get("k0"), cache.get("k2"), cache.get("all")
    assert k0 is not None and k2 is not None and everything is not None
    assert torch.equal(k0["embeds"], rows[0:1]) and torch.equal(k2["embeds"], rows[2:3])
    assert torch.equal(everything["embeds"], rows) and len(cache) == 3
    rows.add_(100)  # the step's output buffer is reused: the cache must not see it
    assert float(k0["embeds"][0, 0]) == 0.0 and float(everything["embeds"][2, 1]) == 5.0
