"""Rewrite a wheel without the data folders a run does not need, so it fits what a lent GPU
machine receives (64 MiB with the working tree). flashinfer-python's wheel is 62 MB, most
of it the CUDA sources of kernels specctl never JIT-compiles (MoE, MLA, fp4/fp8 GEMMs,
Blackwell-only attention); its Python files are all kept (the package imports many of
them at import time), as is every source the attention prefill/decode kernels include.

    python examples/slim_wheel.py IN.whl OUT.whl --drop-subfolders-of flashinfer/data/csrc/ --keep generated

The RECORD lists what is left, so pip installs the slim wheel like the original."""

from __future__ import annotations

import argparse
import zipfile
from pathlib import Path


def is_dropped(name: str, parents: list[str], keep: set[str]) -> bool:
    """True for a non-Python member inside a subfolder of one of ``parents`` not named in ``keep``."""
    if name.endswith(".py"):
        return False
    for parent in parents:
        rest = name.removeprefix(parent)
        if rest != name and "/" in rest and rest.split("/", 1)[0] not in keep:
            return True
    return False


def slim(source: Path, target: Path, parents: list[str], keep: set[str]) -> tuple[int, int]:
    with zipfile.ZipFile(source) as wheel, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as out:
        members = wheel.infolist()
        dropped = {m.filename for m in members if is_dropped(m.filename, parents, keep)}
        for member in members:
            if member.filename in dropped:
                continue
            data = wheel.read(member)
            if member.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines()
                data = ("\n".join(line for line in lines if line.split(",", 1)[0] not in dropped) + "\n").encode()
            out.writestr(member, data, compress_type=zipfile.ZIP_DEFLATED)
    return len(dropped), target.stat().st_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path)
    parser.add_argument("target", type=Path)
    parser.add_argument("--drop-subfolders-of", action="append", default=[], metavar="PREFIX",
                        help="drop every non-.py file in the subfolders of PREFIX (repeatable)")
    parser.add_argument("--keep", action="append", default=[], metavar="NAME",
                        help="a subfolder name to keep under those prefixes (repeatable)")
    args = parser.parse_args()
    count, size = slim(args.source, args.target, args.drop_subfolders_of, set(args.keep))
    print(f"{args.target}: {size / 2**20:.1f} MiB ({count} files dropped from {args.source.stat().st_size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
