"""What the kernel says about this process's mappings (/proc/self/smaps)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_available() -> bool:
    """Whether a mapping advised MADV_HUGEPAGE gets huge pages here."""
    return THP.exists() and "[never]" not in THP.read_text()


@dataclass(frozen=True)
class Mapping:
    start: int
    end: int
    vm_flags: list[str]
    anon_huge_kib: int  # how much of it huge pages back now


def mapping_of(address: int) -> Mapping:
    """The mapping holding ``address``."""
    found: tuple[int, int] | None = None
    fields: dict[str, str] = {}
    for line in [*Path("/proc/self/smaps").read_text().splitlines(), "0-0 end"]:
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a new mapping's first line
            if found is not None:
                return Mapping(
                    *found, fields["VmFlags"].split(), int(fields["AnonHugePages"].split()[0])
                )
            start, end = (int(x, 16) for x in head.split("-"))
            found = (start, end) if start <= address < end else None
        elif found is not None:
            name, _, value = line.partition(":")
            fields[name] = value
    raise AssertionError(f"no mapping holds {address:#x}")
