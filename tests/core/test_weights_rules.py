"""The rules of fetched weights: sources, cache paths, resume decisions, eviction, progress."""

from __future__ import annotations

from pathlib import PurePath

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.core import weights as w
from llmgw.core.catalog import Model, validate_model

SHA = "a" * 64
OTHER = "b" * 64


def test_what_is_fetched() -> None:
    assert w.is_remote("https://h/x.gguf") and w.is_remote("http://h/x.gguf")
    assert w.is_remote("hf://org/repo/x.gguf")
    assert not w.is_remote("/srv/models/x.gguf") and not w.is_remote("org/repo")


def test_hub_references_resolve_against_the_mirror() -> None:
    mirror = "https://mirror.example/hub/"
    assert w.source_url("hf://HuggingFaceTB/SmolLM2/smol.gguf", mirror) == (
        "https://mirror.example/hub/HuggingFaceTB/SmolLM2/resolve/main/smol.gguf"
    )
    assert w.source_url("hf://org/repo@v1.0/sub/dir/m.gguf", mirror) == (
        "https://mirror.example/hub/org/repo/resolve/v1.0/sub/dir/m.gguf"
    )
    assert w.source_url("https://h/m.gguf", None) == "https://h/m.gguf"
    with pytest.raises(w.WeightsError, match="no weights.mirror set"):
        w.source_url("hf://org/repo/m.gguf", None)
    with pytest.raises(w.WeightsError, match="expected hf://<org>/<repo>"):
        w.source_url("hf://just-a-name", mirror)


def test_cache_paths_are_named_by_checksum_so_profiles_share_a_copy() -> None:
    cache = PurePath("/c")
    a = w.cached_path(cache, "https://one/m.gguf", SHA)
    assert a == PurePath(f"/c/{SHA}/m.gguf")
    # Another URL of the same bytes: the same directory.
    assert w.cached_path(cache, "https://two/x/m.gguf?sig=1", SHA).parent == a.parent
    # Without a checksum the key comes from the path, marked so it is never a checksum.
    key = w.cache_key("hf://o/r/m.gguf", None)
    assert key.startswith(w.URL_KEY_PREFIX) and not w.SHA256.fullmatch(key)
    assert w.cache_key("hf://o/r/m.gguf", None) != w.cache_key("hf://o/r2/m.gguf", None)
    partial = w.partial_path(cache, "https://one/m.gguf", SHA)
    assert partial.parent == a.parent and partial.name == ".partial-m.gguf"


@pytest.mark.parametrize("url", ["https://h/", "https://h/dir/..", "https://h/%2e%2e", "https://h/a%2fb"])
def test_a_url_must_end_in_a_plain_file_name(url: str) -> None:
    with pytest.raises(w.WeightsError, match="does not end in a file name"):
        w.file_name(url)


def test_urls_are_shown_without_credentials_or_query() -> None:
    assert (
        w.shown_url("https://user:secret@h.example:8443/m.gguf?token=abc") == "https://h.example:8443/m.gguf"
    )
    assert w.shown_url("http://[::1]:80/m.gguf") == "http://[::1]:80/m.gguf"
    assert "secret" not in (w.path_problem("https://u:secret@h/m.gguf", None) or "")


def test_catalog_rules_for_fetched_models() -> None:
    def problems(**options) -> list[str]:
        return validate_model(Model(name="m", **{"format": "gguf", **options}))

    assert problems(path="https://h/m.gguf", sha256=SHA) == []
    assert problems(path="https://h/m.gguf?sig=x", sha256=SHA) == []  # a signed link's query
    assert problems(path="hf://o/r/m.gguf") == []  # the mirror's metadata may check it
    assert problems(path="https://h/m.gguf") == [
        "models.m.path: a URL (https://h/m.gguf) needs sha256: the node checks what it downloads"
    ]
    assert problems(path="/srv/m.gguf", sha256="ABC") == [
        "models.m.sha256: expected 64 lowercase hex digits (sha256sum's output), got 'ABC'"
    ]
    assert problems(path="hf://o/r/dir", format="safetensors") == [
        "models.m.path: a node fetches one file, a gguf model; a safetensors model is a directory"
    ]


@pytest.mark.parametrize(
    ("status", "have", "content_range", "length", "expected"),
    [
        (200, 0, None, 100, w.Judgement(w.Resume.RESTART, total=100)),
        # The server ignored Range: the body is the whole file, what is on disk goes.
        (200, 40, None, 100, w.Judgement(w.Resume.RESTART, total=100)),
        (206, 40, "bytes 40-99/100", 60, w.Judgement(w.Resume.APPEND, total=100)),
        (206, 40, "bytes 40-99/*", 60, w.Judgement(w.Resume.APPEND, total=None)),
        (
            206,
            40,
            "bytes 0-99/100",
            100,
            w.Judgement(w.Resume.RESTART, reason="asked from 40, got bytes 0-99/100"),
        ),
        (206, 40, None, 60, w.Judgement(w.Resume.FAIL, reason="206 with an unreadable Content-Range None")),
        (416, 100, "bytes */100", 0, w.Judgement(w.Resume.COMPLETE, total=100)),
        (
            416,
            120,
            "bytes */100",
            0,
            w.Judgement(w.Resume.RESTART, total=100, reason="120 bytes kept, the file has 100"),
        ),
        (404, 0, None, None, w.Judgement(w.Resume.FAIL, reason="HTTP 404")),
        (416, 0, "bytes */100", 0, w.Judgement(w.Resume.FAIL, reason="HTTP 416")),
    ],
)
def test_judge_response(status, have, content_range, length, expected) -> None:
    assert w.judge_response(status, have, content_range, length) == expected


def test_range_header() -> None:
    assert w.range_header(0) == {}
    assert w.range_header(5) == {"Range": "bytes=5-"}


entries = st.lists(
    st.builds(w.CacheEntry, key=st.sampled_from("abcdefgh"), last_used=st.floats(0, 1000)),
    unique_by=lambda e: e.key,
)


@given(entries, st.sets(st.sampled_from("abcdefgh")), st.floats(0, 2000), st.floats(1, 500))
def test_eviction_takes_only_unused_and_idle_entries(entries, in_use, now, max_idle) -> None:
    evicted = w.to_evict(entries, in_use, now, max_idle)
    by_key = {e.key: e for e in entries}
    assert len(set(evicted)) == len(evicted)
    for key in evicted:
        assert key not in in_use and now - by_key[key].last_used >= max_idle
    for entry in entries:
        if entry.key not in in_use and now - entry.last_used >= max_idle:
            assert entry.key in evicted  # nothing idle is kept
    assert [by_key[k].last_used for k in evicted] == sorted(by_key[k].last_used for k in evicted)


def test_eviction_example() -> None:
    old, recent, busy = (
        w.CacheEntry(key=k, last_used=t) for k, t in (("old", 0), ("recent", 90), ("busy", 0))
    )
    assert w.to_evict([recent, busy, old], {"busy"}, now=100, max_idle=50) == ["old"]


def test_progress_is_reported_at_most_each_interval_and_percent() -> None:
    assert w.progress_due(None, 0, 0, 100, 0)
    assert not w.progress_due(10, 10.5, 50, 100, 0)  # too soon
    assert w.progress_due(10, 11, 50, 100, 49)
    assert not w.progress_due(10, 11, 1005, 100_000, 1000)  # the same whole percent
    assert w.progress_due(10, 11, 6, None, 5)
    assert w.progress_text(50 * w.MIB, 100 * w.MIB) == "fetching weights: 50.0 of 100.0 MiB (50%)"
    assert w.progress_text(3 * w.MIB, None) == "fetching weights: 3.0 MiB"
