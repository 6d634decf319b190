"""kernels/tma.py: which tensors the copy engine may tile (the launchers fall back to pointer loads
for the rest), on the host alone."""

import torch

from sglang_ext.kernels import tma

FP8 = torch.float8_e4m3fn


def test_tma_2d_ok_takes_only_what_the_copy_engine_can_tile(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # descriptors are emulated there: supported
    assert tma.tma_2d_ok(torch.zeros(8, 2880, dtype=FP8))  # gpt-oss rows: 2880 B
    assert tma.tma_2d_ok(torch.zeros(8, 720, dtype=FP8))  # 120b TP4 h rows
    assert not tma.tma_2d_ok(torch.zeros(8, 360, dtype=FP8))  # 120b TP8 h rows: 360 B, not 16-aligned
    assert not tma.tma_2d_ok(torch.zeros(0, 2880, dtype=FP8))  # a rank without local experts
    assert not tma.tma_2d_ok(torch.zeros(8, 2880, dtype=FP8)[:, ::2])  # last stride 2
    assert not tma.tma_2d_ok(torch.zeros(8, 2880, dtype=FP8)[:, 8:])  # base 8 bytes off
    assert not tma.tma_2d_ok(torch.zeros(2, 8, 2880, dtype=FP8))  # 3-D
    assert tma.tma_2d_ok(torch.zeros(8, 2880, dtype=torch.bfloat16)[:, 64:])  # 128 B off: aligned


def test_no_descriptors_on_a_cpu_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not tma.tma_supported(torch.device("cpu"))
    assert not tma.tma_2d_ok(torch.zeros(8, 2880, dtype=FP8))


def test_recording_descriptors_sees_what_launchers_build_and_stops(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = torch.zeros(8, 2880, dtype=FP8)
    with tma.recording_descriptors() as outer:
        tma.descriptor(x, [64, 128])
        with tma.recording_descriptors() as inner:
            tma.descriptor(x, [16, 128])
    tma.descriptor(x, [32, 128])  # after both blocks: not recorded
    assert outer == [[64, 128], [16, 128]] and inner == [[16, 128]]
    assert not tma._recorders
