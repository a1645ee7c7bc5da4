"""Download (never install) the torch-npu wheels that match the installed torch and unpack what the
tests read: torchair's Python sources, the C++ headers, and the exported symbols of
libtorch_npu.so for x86-64 and aarch64.

    python scripts/fetch_torch_npu.py          # prints the cache directory

Installing torch-npu would replace nothing but would make ``import torch`` load CANN libraries that
are absent on a host without an Ascend NPU, so the wheels are only unpacked. Everything lands in
``.cache/torch_npu/<version>/`` under the repository (ignored by git), or under
``$CUSTOM_OPS_TORCH_NPU_CACHE``; a second call reuses it.
"""

import argparse
import os
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

ARCHES = {"x86_64": "manylinux_2_28_x86_64", "aarch64": "manylinux_2_28_aarch64"}
REPO = Path(__file__).resolve().parent.parent
LIB = "torch_npu/lib/libtorch_npu.so"
KEEP = ("torch_npu/include/", "torch_npu/dynamo/torchair/")


class RegistryUnreachable(RuntimeError):
    """pip could not reach the package index at all (offline host): callers may skip."""


class NoRelease(RuntimeError):
    """The index lists torch-npu, but no release for this torch (torch-npu X.Y.Z requires torch
    X.Y.Z; a newer or patch-level torch may have none): callers may skip."""


def may_skip(error, environ=os.environ):
    """Whether the tests may skip for `error`, raised by ensure(): an unreachable index, or no
    release for this torch unless CUSTOM_OPS_REQUIRE_TORCH_NPU=1 (.ci/run's second run, whose
    torch is chosen for its torch-npu)."""
    if isinstance(error, RegistryUnreachable):
        return True
    return isinstance(error, NoRelease) and environ.get("CUSTOM_OPS_REQUIRE_TORCH_NPU") != "1"


def torch_npu_version():
    """torch-npu releases track torch's: torch 2.13.0 pairs with torch-npu 2.13.0."""
    import torch

    return torch.__version__.split("+")[0]


def cache_dir(version=None):
    root = os.environ.get("CUSTOM_OPS_TORCH_NPU_CACHE") or REPO / ".cache" / "torch_npu"
    return Path(root) / (version or torch_npu_version())


def _pip(*args):
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True,
                          check=False)


def _available(index_versions):
    """The versions of `pip index versions`'s output ("Available versions: 2.14.0, 2.13.0, ...")."""
    for line in index_versions.splitlines():
        if line.startswith("Available versions:"):
            return [v.strip() for v in line.split(":", 1)[1].split(",") if v.strip()]
    return []


def _download(version, arch, dest):
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    res = _pip("download", "--no-deps", "--only-binary=:all:", "--platform", ARCHES[arch],
               "--python-version", py, "-d", str(dest), f"torch-npu=={version}")
    if res.returncode != 0:
        probe = _pip("index", "versions", "torch-npu")
        if probe.returncode != 0:
            last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
            raise RegistryUnreachable(f"pip cannot reach the package index ({last})")
        available = _available(probe.stdout)
        if version not in available:
            raise NoRelease(f"torch-npu has no release {version} (its newest: "
                            f"{', '.join(available[:3])})")
        raise RuntimeError(f"pip could not download torch-npu=={version} for {arch} (Python {py}): "
                           f"{res.stderr.strip()[-800:]}\nAvailable: {probe.stdout.strip()}")
    wheels = sorted(dest.glob(f"torch_npu-{version}-*{arch}.whl"))
    if not wheels:
        raise RuntimeError(f"pip reported success but no {arch} wheel is in {dest}")
    return wheels[-1]


def elf_symbols(data):
    """(defined, undefined) symbol names of an ELF64 little-endian file's .dynsym, or of .symtab
    when there is no .dynsym (an object file)."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not an ELF64 little-endian file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)
                for i in range(shnum)]
    SHT_SYMTAB, SHT_DYNSYM = 2, 11
    tables = ([s for s in sections if s[1] == SHT_DYNSYM]
              or [s for s in sections if s[1] == SHT_SYMTAB])
    defined, undefined = set(), set()
    for _, _, _, _, off, size, link, _, _, entsize in tables:
        strtab = sections[link]
        for pos in range(off + entsize, off + size, entsize):  # entry 0 is the null symbol
            name_off, info, _, shndx = struct.unpack_from("<IBBH", data, pos)
            if info >> 4 not in (1, 2, 10):  # GLOBAL, WEAK, GNU_UNIQUE
                continue
            start = strtab[4] + name_off
            name = data[start:data.index(b"\0", start)].decode()
            (defined if shndx != 0 else undefined).add(name)
    return defined, undefined


def _unpack(wheel, out, with_sources):
    with zipfile.ZipFile(wheel) as z:
        if with_sources:
            for name in z.namelist():
                if name.startswith(KEEP) and not name.endswith(".so"):
                    z.extract(name, out)
        defined, _ = elf_symbols(z.read(LIB))
    (out / "libtorch_npu.exports").write_text("\n".join(sorted(defined)) + "\n")


def ensure(version=None):
    """The unpacked cache (downloading on first use): <dir>/<arch>/libtorch_npu.exports for each
    arch, and <dir>/x86_64/torch_npu/{include,dynamo/torchair} (the sources are the same in both
    wheels). Raises RegistryUnreachable when offline."""
    version = version or torch_npu_version()
    root = cache_dir(version)
    done = root / "complete"
    if done.exists():
        return root
    wheels = root / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    for arch in ARCHES:
        out = root / arch
        out.mkdir(exist_ok=True)
        _unpack(_download(version, arch, wheels), out, with_sources=arch == "x86_64")
    done.write_text(version + "\n")
    return root


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--version", help="torch-npu version (default: the installed torch's)")
    try:
        print(ensure(p.parse_args().version))
    except (RegistryUnreachable, NoRelease) as e:  # expected on some hosts: no traceback
        sys.exit(f"fetch_torch_npu: {e}")


if __name__ == "__main__":
    main()
