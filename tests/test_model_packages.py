"""Packaged models split over part packages (`ldqa.attention.model_packages`): assembled in order, checked
by size and sha256 (a mismatch is refused, naming the packages, and leaves no file), cached, and a missing
package names the extra to install. Fake part packages on sys.path stand in for the real ones."""

from __future__ import annotations

import hashlib
import sys

import pytest

from ldqa.attention import model_packages as mp


@pytest.fixture
def fake_parts(tmp_path, monkeypatch):
    """factory(parts: list[bytes], sha=None) -> the name of a parted model whose part packages
    (fakeldqapartN, N = 1..len(parts)) are importable from tmp_path; LDQA_CACHE_DIR under tmp_path."""
    monkeypatch.setenv("LDQA_CACHE_DIR", str(tmp_path / "cache"))
    site = tmp_path / "site"
    monkeypatch.syspath_prepend(str(site))

    def make(parts: list[bytes], sha: str | None = None, size: int | None = None) -> str:
        for i, data in enumerate(parts, 1):
            pkg = site / f"fakeldqapart{i}" / "data"
            pkg.mkdir(parents=True, exist_ok=True)
            (pkg.parent / "__init__.py").write_text("raise ImportError('a model part package is never imported')\n")
            (pkg / f"part{i:02d}.bin").write_bytes(data)
        whole = b"".join(parts)
        spec = mp.PartedGGUF("fakeldqapart", len(parts), "1.0", len(whole) if size is None else size,
                             sha or hashlib.sha256(whole).hexdigest(), extra="fake")
        monkeypatch.setitem(mp.PARTED, "fake-model", spec)
        for k in [k for k in sys.modules if k.startswith("fakeldqapart")]:
            monkeypatch.delitem(sys.modules, k)
        return "fake-model"

    return make


def test_parts_are_concatenated_in_numeric_order_and_cached(fake_parts):
    parts = [bytes([i]) * (1000 + i) for i in range(1, 12)]  # 11 parts: part10 sorts after part1 as text
    name = fake_parts(parts)
    mp.check_installed(name)
    path = mp.assemble(name, progress=False)
    assert path.read_bytes() == b"".join(parts)
    assert path.with_name(path.name + ".sha256").read_text().strip() == hashlib.sha256(b"".join(parts)).hexdigest()
    mtime = path.stat().st_mtime_ns
    assert mp.assemble(name, progress=False) == path and path.stat().st_mtime_ns == mtime  # not rebuilt


def test_a_sha256_mismatch_is_refused_and_leaves_no_file(fake_parts):
    name = fake_parts([b"a" * 100, b"b" * 100], sha="0" * 64)
    with pytest.raises(mp.PackageError, match=r"fakeldqapart1 \.\.\. fakeldqapart2 has sha256 .* not the published"):
        mp.assemble(name, progress=False)
    target = mp.assembled_path(name)
    assert not target.exists() and list(target.parent.iterdir()) == []


def test_parts_of_the_wrong_size_are_refused(fake_parts):
    name = fake_parts([b"a" * 100, b"b" * 100], size=300)
    with pytest.raises(mp.PackageError, match="add up to 200 bytes, not 300"):
        mp.assemble(name, progress=False)


def test_a_missing_package_names_it_and_the_extra(fake_parts, tmp_path):
    name = fake_parts([b"a", b"b", b"c"])
    import shutil

    shutil.rmtree(tmp_path / "site" / "fakeldqapart2")
    with pytest.raises(mp.PackageError, match=r"needs packages that are not installed \(fakeldqapart2\).*ldqa\[fake\]"):
        mp.check_installed(name)
    with pytest.raises(mp.PackageError, match="fakeldqapart2"):
        mp.assemble(name, progress=False)


def test_the_loader_refuses_a_missing_packaged_model_by_name(fake_parts, tmp_path):
    from ldqa.attention.loader import ModelLoadError, check_model_name, resolve_gguf

    name = fake_parts([b"a", b"b"])
    import shutil

    shutil.rmtree(tmp_path / "site" / "fakeldqapart1")
    with pytest.raises(ModelLoadError, match=r"model 'fake-model' needs packages .*fakeldqapart1"):
        check_model_name(name)
    with pytest.raises(ModelLoadError, match="fakeldqapart1"):
        resolve_gguf(name)


@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"])
def test_the_packaged_qwen_models_are_listed_with_their_published_sha256(name):
    spec = mp.PARTED[name]
    assert name in mp.PACKAGED_MODELS and len(spec.sha256) == 64
    assert spec.distributions()[0].endswith("part1") and len(spec.distributions()) == spec.count
