"""Host -> device copies that do not wait for the GPU (taste_speech/device_copies.py)."""

import warnings

import pytest
import torch

from cuda_waits import recorded_waits, wait_sites
from taste_speech.device_copies import copy_in, to_device


def test_to_device_gives_the_values_where_asked_and_leaves_them_for_none():
    host = torch.arange(6).view(2, 3)[:, 1:]  # (not contiguous)
    assert to_device(host, None) is host
    moved = to_device(host, "cpu")
    assert moved.device.type == "cpu" and torch.equal(moved, host)


def test_copy_in_takes_lists_in_the_buffer_s_dtype_and_tensors_as_they_are():
    buffer = torch.zeros(4, dtype=torch.long)
    assert copy_in(buffer[:3], [7, 8, 9]) is not None
    assert buffer.tolist() == [7, 8, 9, 0]
    floats = torch.zeros(2, 2)
    copy_in(floats, torch.tensor([[1.5, 2.5], [3.5, 4.5]]))
    assert floats.tolist() == [[1.5, 2.5], [3.5, 4.5]]
    with pytest.raises(RuntimeError):
        copy_in(buffer, [1, 2])  # a size mismatch is still an error


def test_only_torch_s_wait_warnings_count_as_waits_each_with_where_it_waited():
    """The sync debug mode's notice that it is a prototype (once per process) speaks of
    synchronizing operations but is no wait: on the H100 it made the first counting test of a run
    count one wait too many."""
    def recorded(text, line):
        return warnings.WarningMessage(UserWarning(text), UserWarning, "/site/taste_speech/sampler.py", line)

    caught = [recorded("Synchronization debug mode is a prototype feature and does not yet detect all "
                       "synchronizing operations", 1270),
              recorded("called a synchronizing CUDA operation", 42), recorded("some other warning", 7)]
    assert wait_sites(caught) == ["sampler.py:42"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_neither_waits_for_the_gpu_and_the_values_arrive():
    busy = torch.randn(2048, 2048, device="cuda")
    buffer = torch.zeros(3, dtype=torch.long, device="cuda")
    with recorded_waits() as caught:
        for _ in range(8):
            busy = busy @ busy / 2048  # kernels queued before the copies
        moved = to_device(torch.tensor([4, 5, 6]), "cuda")
        copy_in(buffer, [1, 2, 3])
    assert not wait_sites(caught)
    assert moved.tolist() == [4, 5, 6] and buffer.tolist() == [1, 2, 3]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_sliced_host_tensor_is_copied_from_pinned_memory():
    """A slice (as the noise tapes hand over) is made dense in pinned memory first: a strided pinned
    source would be staged through pageable memory by the copy, a copy that may wait for the stream.
    The CUDA profiler names each host-to-device copy's source memory."""
    from torch.profiler import ProfilerActivity, profile

    noise = torch.randn(80, 4096)[:, 100:900].unsqueeze(0)  # (not contiguous)
    buffer = torch.zeros(1, 80, 800, device="cuda")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        moved = to_device(noise, "cuda")
        copy_in(buffer, noise)
        torch.cuda.synchronize()
    copies = [e.name for e in prof.events() if "HtoD" in e.name]
    assert copies and all("Pinned" in name for name in copies), copies
    assert torch.equal(moved.cpu(), noise) and torch.equal(buffer.cpu(), noise)
