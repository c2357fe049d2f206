"""The copy kernel of captured graphs (kernels/copy.py): every byte copied, whole words or
not, across block boundaries, and sizes or layouts it cannot copy refused. Through Triton's
interpreter here; tests/test_graphs.py checks the graphs that use it on CUDA."""

import pytest
import torch

from logitserve.kernels.copy import BLOCK_WORDS, copy_by_kernel


@pytest.mark.parametrize("nbytes", [1, 3, 4, 16, 4 * BLOCK_WORDS - 4, 4 * BLOCK_WORDS, 4 * BLOCK_WORDS + 12, 12345])
def test_every_byte_is_copied_and_nothing_past_the_end(nbytes):
    g = torch.Generator().manual_seed(nbytes)
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    dst = torch.full((nbytes + 8,), 0xAB, dtype=torch.uint8)  # poisoned, with a tail that must stay
    copy_by_kernel(src, dst[:nbytes], backend="interpret")
    assert torch.equal(dst[:nbytes], src)
    assert (dst[nbytes:] == 0xAB).all()


def test_tensors_of_other_dtypes_and_shapes_copy_as_bytes():
    src = torch.arange(24, dtype=torch.int64).reshape(4, 6)
    dst = torch.full((4, 6), -1, dtype=torch.int64)
    copy_by_kernel(src, dst, backend="interpret")
    assert torch.equal(dst, src)
    weights = torch.randn(3, 5)
    as_ints = torch.zeros(15, dtype=torch.int32)
    copy_by_kernel(weights, as_ints, backend="interpret")
    assert torch.equal(as_ints.view(torch.float32).reshape(3, 5), weights)


def test_unequal_sizes_and_strided_tensors_are_refused():
    with pytest.raises(ValueError, match="src has 16 bytes, dst 12"):
        copy_by_kernel(torch.zeros(4, dtype=torch.int32), torch.zeros(3, dtype=torch.int32), backend="interpret")
    with pytest.raises(ValueError, match="must be contiguous"):
        copy_by_kernel(torch.zeros(4, 4)[:, 0], torch.zeros(4), backend="interpret")


def test_a_one_element_column_of_a_wider_tensor_copies():
    # torch calls it contiguous though its stride is the row's (a seeds column of one row).
    rows = torch.tensor([[7, 8, 9]], dtype=torch.int64)
    column = rows[:, 1]
    assert column.is_contiguous() and column.stride() == (3,)
    dst = torch.full((1,), -1, dtype=torch.int64)
    copy_by_kernel(column, dst, backend="interpret")
    assert dst.tolist() == [8]
