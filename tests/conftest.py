import os
import sys
import warnings

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
warnings.filterwarnings("ignore", message=".*Apex.*")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped on CPU machines)")
    config.addinivalue_line("markers", "slow: takes more than ~20 s on 2 CPU cores")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    """Two tiny Qwen3 HF checkpoints: {'untied': dir, 'tied': dir}."""
    from megatron_klear.models.tiny import make_tiny_qwen3

    base = tmp_path_factory.mktemp("tiny_hf")
    return {
        "untied": make_tiny_qwen3(str(base / "untied"), tied=False, seed=1),
        "tied": make_tiny_qwen3(str(base / "tied"), tied=True, seed=2),
    }
