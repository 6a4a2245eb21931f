"""Which build of the native decode kernel a cache directory serves, and what happens when the
one it holds cannot be used here (issue 17, item 10). No compiler needed: builds are faked."""

import logging

import pytest

from poise.engine import kernels
from poise.engine.kernels import cpu_identity, kernel_key, load_paged_decode_attention

SOURCE = b"int f(void) { return 0; }"


def cpuinfo(*flag_lines: str, field: str = "flags") -> str:
    """A /proc/cpuinfo with one processor per flag line."""
    return "\n".join(
        f"processor\t: {i}\nvendor_id\t: GenuineIntel\nmodel name\t: Some CPU\n"
        f"{field}\t\t: {flags}\n"
        for i, flags in enumerate(flag_lines)
    )


def key(info: str) -> str:
    return kernel_key(SOURCE, cpu_identity(info))


def test_the_cache_key_follows_the_cpus_instruction_set():
    with_avx512 = cpuinfo("fpu sse2 avx2 avx512f", "fpu sse2 avx2 avx512f")
    without = cpuinfo("fpu sse2 avx2", "fpu sse2 avx2")
    assert key(with_avx512) != key(without)
    assert key(with_avx512) == key(cpuinfo("avx512f avx2 fpu sse2"))  # order is no difference
    # A hybrid CPU whose cores differ is a CPU of its own.
    assert key(cpuinfo("fpu avx2", "fpu")) not in {key(cpuinfo("fpu avx2")), key(cpuinfo("fpu"))}
    # Arm names them Features; the other model is another key even with the same features.
    arm = cpuinfo("fp asimd sve", field="Features")
    assert key(arm) != key(cpuinfo("fp asimd", field="Features"))
    assert key(arm) != key(arm.replace("Some CPU", "Other CPU"))
    # The source and the CPU both count; fields that say nothing of the ISA do not.
    assert kernel_key(b"other source", cpu_identity(without)) != key(without)
    assert key(without) == key(without.replace("processor\t: 1", "processor\t: 7"))


def test_off_linux_the_key_is_the_architecture(monkeypatch):
    monkeypatch.setattr(kernels.platform, "machine", lambda: "arm64")
    assert cpu_identity("") == "arm64"
    monkeypatch.setattr(kernels.platform, "machine", lambda: "x86_64")
    assert kernel_key(SOURCE, cpu_identity("")) != kernel_key(SOURCE, "arm64")


def test_a_cache_shared_across_cpus_holds_one_build_per_cpu(tmp_path, monkeypatch):
    monkeypatch.setattr(kernels, "cpu_identity", lambda: "cpu-a")
    built_on_a = kernels.build_path(tmp_path)
    built_on_a.write_bytes(b"a build")
    assert kernels._build(tmp_path) == built_on_a
    # Another CPU looks for its own build and, with no compiler here, finds none to reuse.
    monkeypatch.setattr(kernels, "cpu_identity", lambda: "cpu-b")
    assert kernels.build_path(tmp_path) != built_on_a
    monkeypatch.setattr(kernels.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="no C compiler"):
        kernels._build(tmp_path)


def test_a_build_that_cannot_load_falls_back_with_one_warning(tmp_path, monkeypatch, caplog):
    broken = tmp_path / "paged_attention-broken.so"
    broken.write_bytes(b"\x7fELF but not really")
    monkeypatch.setattr(kernels, "_build", lambda cache_dir: broken)
    with caplog.at_level(logging.WARNING, logger="poise.engine.kernels"):
        assert load_paged_decode_attention(tmp_path) is None
        assert load_paged_decode_attention(tmp_path) is None  # decided once per directory
    warnings = [r for r in caplog.records if r.name == "poise.engine.kernels"]
    assert len(warnings) == 1
    assert "trial run failed" in warnings[0].getMessage()
