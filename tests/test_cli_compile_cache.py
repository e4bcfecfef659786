"""``python -m hcache info`` keeps NVRTC compile results on disk (issue 25, item 7) and
``--help`` prints plain text. Oracles: the number of real NVRTC compiles (counted around the
real compiler, nothing replaced), the files in the cache folder, and the help text itself."""

from __future__ import annotations

import contextlib
import io

import pytest

from hcache.__main__ import main
from hcache.ops import _compile_cache, _loader, _nvrtc

needs_nvrtc = pytest.mark.skipif(_nvrtc.find_libnvrtc() is None,
                                 reason="libnvrtc missing: pip install nvidia-cuda-nvrtc-cu12")


@pytest.fixture
def cache_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HCACHE_CACHE_DIR", str(tmp_path))
    return tmp_path / "nvrtc"


@pytest.fixture
def compiles(monkeypatch):
    """Counts the real NVRTC compiles."""
    calls = []
    real = _nvrtc.compile_family

    def counted(family, arch="sm_80"):
        calls.append((family, arch))
        return real(family, arch)

    monkeypatch.setattr(_nvrtc, "compile_family", counted)
    return calls


def test_the_key_changes_with_everything_a_compile_depends_on(monkeypatch):
    key = _compile_cache.compile_key("lengths", "sm_80")
    assert key == _compile_cache.compile_key("lengths", "sm_80")
    assert key != _compile_cache.compile_key("lengths", "sm_90")
    assert key != _compile_cache.compile_key("compact", "sm_80")
    real_source = _loader.kernel_source
    with monkeypatch.context() as m:      # an edited .cu (or header: its digest is in the text)
        m.setattr(_loader, "kernel_source",
                  lambda f: (real_source(f)[0], real_source(f)[1] + "\n// edited\n"))
        assert _compile_cache.compile_key("lengths", "sm_80") != key
    with monkeypatch.context() as m:      # another toolkit
        m.setattr(_nvrtc, "nvrtc_version", lambda: (99, 1))
        assert _compile_cache.compile_key("lengths", "sm_80") != key
    with monkeypatch.context() as m:      # other compile options
        m.setattr(_loader, "nvrtc_options", lambda: ("-std=c++20",))
        assert _compile_cache.compile_key("lengths", "sm_80") != key


@pytest.mark.nvrtc
@needs_nvrtc
def test_a_compile_is_stored_reused_and_redone_when_its_source_changes(
        cache_folder, compiles, monkeypatch):
    size, cached = _compile_cache.checked_compile("lengths", "sm_80")
    assert (cached, len(compiles)) == (False, 1) and size > 0
    assert len(list(cache_folder.glob("*.json"))) == 1
    assert _compile_cache.checked_compile("lengths", "sm_80") == (size, True)
    assert len(compiles) == 1                                  # no second compile
    assert _compile_cache.checked_compile("lengths", "sm_80", use_cache=False)[1] is False
    assert len(compiles) == 2
    next(cache_folder.glob("*.json")).write_text("{not json")   # a damaged entry: compile
    assert _compile_cache.checked_compile("lengths", "sm_80") == (size, False)
    real_source = _loader.kernel_source
    monkeypatch.setattr(_loader, "kernel_source",
                        lambda f: (real_source(f)[0], real_source(f)[1] + "\n// edited\n"))
    assert _compile_cache.checked_compile("lengths", "sm_80")[1] is False
    assert len(compiles) == 4 and len(list(cache_folder.glob("*.json"))) == 2


def test_a_failed_compile_is_not_stored(cache_folder, monkeypatch):
    def broken(family, arch="sm_80"):
        raise RuntimeError("libnvrtc not found")

    monkeypatch.setattr(_nvrtc, "compile_family", broken)
    with pytest.raises(RuntimeError):
        _compile_cache.checked_compile("lengths", "sm_80")
    assert not cache_folder.exists() or not list(cache_folder.iterdir())


@pytest.mark.parametrize("argv", [["--help"], ["info", "--help"], ["demo", "--help"],
                                  ["bench", "--help"]])
def test_help_is_plain_text(argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        main(argv)
    text = out.getvalue()
    assert exit_.value.code == 0 and text.startswith("usage: python -m hcache")
    for raw in ("``", ":meth:", ":class:", ":func:", "docs/design", "§"):
        assert raw not in text, raw
