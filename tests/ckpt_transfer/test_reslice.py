import pytest
import torch

from ckpt_transfer.reslice import ResliceError, reslice


@pytest.mark.parametrize("a,b", [(1, 2), (2, 1), (2, 4), (4, 2), (4, 4)])
@pytest.mark.parametrize("dim", [0, 1])
def test_reslice_equals_slicing_the_whole_tensor(a, b, dim):
    full = torch.randn(8, 12)
    src = list(full.chunk(a, dim=dim))
    got = reslice(src, dim, b)
    want = list(full.chunk(b, dim=dim))
    assert len(got) == b and all(torch.equal(x, y) for x, y in zip(got, want))


def test_reslice_refuses_indivisible():
    with pytest.raises(ResliceError, match="TP=3"):
        reslice([torch.zeros(4, 2)], 0, 3)
