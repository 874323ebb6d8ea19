"""The native kernels' instruction-set level: portable builds for images, checked
against the CPU before anything runs."""

from __future__ import annotations

import platform

import pytest

from worker import native

HASWELL = "flags : fpu sse sse2 ssse3 sse4_1 sse4_2 popcnt cx16 lahf_lm avx avx2 bmi1 bmi2 "
HASWELL += "f16c fma abm movbe xsave"
NEHALEM = "flags : fpu sse sse2 ssse3 sse4_1 sse4_2 popcnt cx16 lahf_lm"

x86_only = pytest.mark.skipif(
    platform.machine() != "x86_64", reason="x86-64 levels are checked on x86-64 only"
)


@x86_only
def test_a_cpu_meets_the_levels_it_has_every_flag_of() -> None:
    assert native.missing_cpu_flags("x86-64-v3", HASWELL) == []
    assert native.missing_cpu_flags("x86-64-v2", NEHALEM) == []
    assert native.missing_cpu_flags("native", NEHALEM) == []


@x86_only
def test_a_cpu_below_the_level_is_told_what_it_lacks() -> None:
    assert native.missing_cpu_flags("x86-64-v3", NEHALEM) == [
        "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"
    ]  # fmt: skip
    assert native.missing_cpu_flags("x86-64-v4", HASWELL)[:2] == ["avx512f", "avx512bw"]


@x86_only
def test_loading_on_a_cpu_below_the_level_fails_naming_the_flags(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(native, "_cpu_flags", lambda: NEHALEM)
    with pytest.raises(RuntimeError, match=r"built for x86-64-v3.*missing: avx, avx2"):
        native.check_cpu_supports("x86-64-v3")


def test_the_level_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(native.KERNEL_ARCH_ENV, raising=False)
    assert native.kernel_arch() == "native"
    monkeypatch.setenv(native.KERNEL_ARCH_ENV, "x86-64-v3")
    assert native.kernel_arch() == "x86-64-v3"
    assert "-march=x86-64-v3" in native.cflags("x86-64-v3")
    monkeypatch.setenv(native.KERNEL_ARCH_ENV, "pentium9")
    with pytest.raises(ValueError, match="pentium9"):
        native.kernel_arch()


def test_only_a_native_build_is_keyed_to_this_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    portable, mine = native.build_dir("x86-64-v3"), native.build_dir("native")
    monkeypatch.setattr(native, "_cpu_flags", lambda: "flags : another cpu")
    assert native.build_dir("x86-64-v3") == portable  # the image's build, any CPU
    assert native.build_dir("native") != mine  # rebuilt rather than trusted
    assert portable.name.startswith("x86-64-v3-")
