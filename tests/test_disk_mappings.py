"""The disk tier's block mappings hold no file descriptor and live as long as their views."""

from __future__ import annotations

import gc
import os
import sys

import numpy as np
import pytest
from tiered.cpu.disk import PageFile
from tiered.cpu.mapping import Mapping

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _mapped(pf: PageFile) -> int:
    """Mappings of ``pf``'s (unlinked) file in this process."""
    target = os.readlink(f"/proc/self/fd/{pf.fd}")
    with open("/proc/self/maps") as f:
        return sum(line.rstrip().endswith(target) for line in f)


@linux
def test_blocks_add_mappings_not_descriptors(tmp_path):
    pf = PageFile(str(tmp_path), "values", (2, 3, 16, 8), np.float16)
    rng = np.random.default_rng(0)
    before = _open_fds()
    blocks = [rng.standard_normal(pf.block_shape).astype(np.float16) for _ in range(300)]
    for b in blocks:
        pf.append(b)
    assert _open_fds() == before  # Python's mmap held one a block: 300 more
    assert _mapped(pf) == 300
    for i in (0, 151, 299):
        np.testing.assert_array_equal(pf.views[i], blocks[i])
        pf.verify(i)
    pf.close()


@linux
def test_a_view_outlives_its_page_file_then_the_mapping_goes(tmp_path):
    pf = PageFile(str(tmp_path), "keys", (1, 2, 8, 4), np.float32)
    block = np.arange(64, dtype=np.float32).reshape(pf.block_shape)
    pf.append(block)
    pf.append(block + 1)
    view = pf.views[1][0, 1]
    target = os.readlink(f"/proc/self/fd/{pf.fd}")
    pf.close()
    gc.collect()
    np.testing.assert_array_equal(view, block[0, 1] + 1)  # still mapped: no dangling address
    with open("/proc/self/maps") as f:
        assert sum(line.rstrip().endswith(target) for line in f) == 1  # block 0 is gone
    del view
    gc.collect()
    with open("/proc/self/maps") as f:
        assert not any(line.rstrip().endswith(target) for line in f)


def test_mapping_is_read_only_and_checks_its_arguments(tmp_path):
    path = tmp_path / "f"
    data = np.arange(4096, dtype=np.int32)
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        m = Mapping(fd, data.nbytes, 0)
        a = m.array(np.int32, (64, 64))
        np.testing.assert_array_equal(a.reshape(-1), data)
        assert not a.flags.writeable
        with pytest.raises(ValueError, match="needs"):
            m.array(np.int64, (4096,))
        with pytest.raises(ValueError, match="Invalid mapping"):
            Mapping(fd, 4096, 1)
    finally:
        os.close(fd)
    with pytest.raises(OSError):
        Mapping(fd, 4096, 0)  # a closed descriptor
