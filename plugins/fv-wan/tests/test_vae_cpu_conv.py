"""The VAE's 3D convs on the CPU run through oneDNN, not PyTorch's im2col ``slow_conv3d``.

PyTorch's CPU dispatch picks ``slow_conv3d`` for these shapes; fv-wan's ``conv3d`` calls oneDNN's
convolution for fp32 CPU tensors (3-8x faster at the VAE's shapes; the realtime CPU session spent
most of a chunk in that decode). The reference here is ``F.conv3d`` itself: same math, another
summation order, so agreement is to fp32 roundoff, not bitwise.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fv_wan.models.vae import WanVAE
from fv_wan.models.vae_blocks import conv3d

from tiny_vae_configs import CFG21

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")

#: (in, out, frames, size, kernel, stride, padding): the decoder's causal 3x3x3 conv, its time conv,
#: a frame conv (depth-1 kernel), the encoder's strided downsample, a 1x1x1 shortcut.
SHAPES = [
    (6, 6, 4, 18, (3, 3, 3), (1, 1, 1), (0, 1, 1)),
    (8, 16, 3, 8, (3, 1, 1), (1, 1, 1), (0, 0, 0)),
    (8, 4, 2, 16, (1, 3, 3), (1, 1, 1), (0, 1, 1)),
    (4, 4, 2, 17, (1, 3, 3), (1, 2, 2), (0, 0, 0)),
    (4, 8, 3, 8, (1, 1, 1), (1, 1, 1), (0, 0, 0)),
]


def _kernels(fn) -> set[str]:  # type: ignore[no-untyped-def]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {event.name for event in prof.events()}


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}to{s[1]}_k{''.join(map(str, s[4]))}_s{''.join(map(str, s[5]))}")
@pytest.mark.parametrize("channels_last", [False, True])
def test_conv3d_matches_torch_and_runs_onednn(shape: tuple, channels_last: bool) -> None:  # type: ignore[type-arg]
    cin, cout, frames, size, kernel, stride, padding = shape
    g = torch.Generator().manual_seed(3)
    x = torch.randn((1, cin, frames, size, size), generator=g)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last_3d)
    weight, bias = torch.randn((cout, cin, *kernel), generator=g), torch.randn(cout, generator=g)
    expected = F.conv3d(x, weight, bias, stride, padding)
    got = conv3d(x, weight, bias, stride, padding)
    assert got.shape == expected.shape
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()
    kernels = _kernels(lambda: conv3d(x, weight, bias, stride, padding))
    assert "aten::mkldnn_convolution" in kernels and "aten::slow_conv3d_forward" not in kernels


def test_conv3d_gradients_match_torch() -> None:
    g = torch.Generator().manual_seed(4)
    x = torch.randn((2, 4, 3, 6, 6), generator=g, requires_grad=True)
    w = torch.randn((5, 4, 3, 3, 3), generator=g, requires_grad=True)
    b = torch.randn(5, generator=g, requires_grad=True)
    conv3d(x, w, b, (1, 1, 1), (0, 1, 1)).square().sum().backward()
    ours = [t.grad.clone() for t in (x, w, b)]  # type: ignore[union-attr]
    for t in (x, w, b):
        t.grad = None
    F.conv3d(x, w, b, (1, 1, 1), (0, 1, 1)).square().sum().backward()
    for mine, ref in zip(ours, (x.grad, w.grad, b.grad)):
        assert ref is not None and (mine - ref).abs().max() <= 1e-4 * ref.abs().max()


@torch.no_grad()
def test_vae_decode_on_cpu_runs_no_slow_conv3d() -> None:
    # The negative control is PyTorch's own dispatch (oneDNN switched off): slow_conv3d runs, and the
    # decode still agrees with it to fp32 roundoff.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        vae = WanVAE(CFG21).eval()
    z = torch.randn((1, CFG21.z_dim, 3, 4, 4), generator=torch.Generator().manual_seed(1))
    kernels = _kernels(lambda: vae.decode(z))
    assert "aten::mkldnn_convolution" in kernels and "aten::slow_conv3d_forward" not in kernels
    fast = vae.decode(z)
    torch.backends.mkldnn.enabled = False
    try:
        assert "aten::slow_conv3d_forward" in _kernels(lambda: vae.decode(z))
        slow = vae.decode(z)
    finally:
        torch.backends.mkldnn.enabled = True
    assert (fast - slow).abs().max() <= 1e-5
