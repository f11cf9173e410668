import pytest
import torch

import ist_kernels.functional as F

import reference as ref
from conftest import BAD_INPUT, DEVICES

SHAPES = [(1, 1), (7, 31), (33, 32), (5, 33), (129, 70), (2, 3, 100), (0, 40), (4, 0)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bool, torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_pack_unpack_matches_reference(device, shape, dtype, gen):
    x = torch.randn(shape, generator=gen).to(device)
    mask = (x > 0) if dtype == torch.bool else x.to(dtype)
    words = F.pack_gates(mask)
    assert words.dtype == torch.int32 and words.shape == (*shape[:-1], (shape[-1] + 31) // 32)
    torch.testing.assert_close(words.cpu(), ref.pack_gates(mask.cpu()), rtol=0, atol=0)
    back = F.unpack_gates(words, shape[-1])
    torch.testing.assert_close(back.cpu(), (mask > 0).cpu() if dtype != torch.bool else mask.cpu(), rtol=0, atol=0)
    torch.testing.assert_close(back.cpu(), ref.unpack_gates(words.cpu(), shape[-1]), rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_pack_noncontiguous(device, gen):
    x = torch.randn(40, 70, generator=gen).to(device)
    view = x.t()  # [70, 40], non-contiguous
    assert not view.is_contiguous()
    torch.testing.assert_close(F.pack_gates(view).cpu(), ref.pack_gates(view.cpu()), rtol=0, atol=0)
    words = F.pack_gates(x)
    wide = torch.stack([words, words], -1)[..., 0]  # non-contiguous words
    assert not wide.is_contiguous()
    torch.testing.assert_close(F.unpack_gates(wide, 70).cpu(), (x > 0).cpu(), rtol=0, atol=0)


def test_bit_order():
    mask = torch.zeros(1, 40, dtype=torch.bool)
    mask[0, 0] = mask[0, 31] = mask[0, 33] = True
    words = F.pack_gates(mask)
    assert words[0, 0].item() == (1 | -(2**31)) and words[0, 1].item() == 2


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device, gen):
    mask = torch.randn(9, 45, generator=gen).to(device)
    torch.library.opcheck(torch.ops.ist_kernels.pack_gates.default, (mask,))
    torch.library.opcheck(torch.ops.ist_kernels.pack_gates.default, (mask > 0,))
    words = F.pack_gates(mask)
    torch.library.opcheck(torch.ops.ist_kernels.unpack_gates.default, (words, 45))


def test_compile():
    fn = torch.compile(lambda m: F.unpack_gates(F.pack_gates(m), m.shape[-1]), fullgraph=True)
    m = torch.randn(6, 50) > 0
    torch.testing.assert_close(fn(m), m)


def test_bad_input():
    with pytest.raises(BAD_INPUT, match="mask must be bool or floating"):
        F.pack_gates(torch.ones(3, 4, dtype=torch.int64))
    with pytest.raises(BAD_INPUT, match="at least 1 dimension"):
        F.pack_gates(torch.tensor(1.0))
    with pytest.raises(BAD_INPUT, match="words must be int32"):
        F.unpack_gates(torch.ones(3, 2, dtype=torch.int64), 40)
    with pytest.raises(BAD_INPUT, match="num_features=70 needs 3 words"):
        F.unpack_gates(torch.ones(3, 2, dtype=torch.int32), 70)


def test_unpack_gates_num_features_out_of_range():
    """Issue 10, item 8: unpack_gates(w, 2**63 - 1) reported a negative word count."""
    w = torch.zeros(2, 1, dtype=torch.int32)
    for words in (w, w.to("meta")):  # the C++ kernel and the fake kernel say the same
        with pytest.raises(ValueError, match=r"num_features=9223372036854775807 needs 288230376151711744 words per "
                                             r"row, but words has 1"):
            F.unpack_gates(words, 2**63 - 1)
        with pytest.raises(ValueError, match=r"num_features must be >= 0, got -1"):
            F.unpack_gates(words, -1)
