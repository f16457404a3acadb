import atexit
import os
import shutil
import tempfile

import pytest
import torch

from braze import config

# The suite keeps braze's kernels (kernelcache.py) in a directory of its own, empty at the start,
# as a fresh machine's would be; its subprocesses share it.
_KERNELS = tempfile.mkdtemp(prefix="braze-test-kernels-")
os.environ["BRAZE_KERNEL_CACHE"] = config.kernel_cache = _KERNELS
atexit.register(shutil.rmtree, _KERNELS, ignore_errors=True)


@pytest.fixture(autouse=True)
def _strict():
    # Every pass is verified in tests; random inputs are seeded per test.
    torch.manual_seed(0)
    with config.patch(verify=True):
        yield


@pytest.fixture
def threads():
    """torch.set_num_threads (MKL's count too) for one test; the count is put back after."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def pytest_terminal_summary(terminalreporter):
    """After an OpInfo sweep: how its cases ended, and how many ops ran natively."""
    from . import opinfo
    from .test_opinfo import OUTCOMES

    if OUTCOMES:
        terminalreporter.write_line(opinfo.summary(OUTCOMES))
        if os.environ.get("BRAZE_OPINFO_REPORT"):
            opinfo.write_report(OUTCOMES, os.environ["BRAZE_OPINFO_REPORT"])
