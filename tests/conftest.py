import pytest
import torch

from braze import config


@pytest.fixture(autouse=True)
def _strict():
    # Every pass is verified in tests; random inputs are seeded per test.
    torch.manual_seed(0)
    with config.patch(verify=True):
        yield
