import os
import sys

# Eight fake CPU devices for the sharding tests; must be set before jax is imported.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import pytest  # noqa: E402

from rl_scaling import sharding  # noqa: E402
from rl_scaling.policy import model as model_lib  # noqa: E402

TINY = model_lib.ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64)


@pytest.fixture(scope="session")
def mesh1():
    """A 1-device mesh: flax needs a mesh in context for annotated params."""
    return sharding.make_mesh({"fsdp": 1}, devices=jax.devices()[:1])


@pytest.fixture(scope="session")
def tiny_params():
    from flax import linen as nn

    return nn.unbox(model_lib.init_params(TINY, jax.random.key(0)))


@pytest.fixture(scope="module")
def code(tmp_path_factory):
    """A copy of the code that subprocess runs execute (rl_scaling, configs, launch), taken once per
    module: every run of a comparison runs the same code even while the checkout changes. Runs put it
    on PYTHONPATH, ahead of the checkout the virtualenv has installed."""
    import shutil

    checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    root = tmp_path_factory.mktemp("code")
    for name in ("rl_scaling", "configs", "launch"):
        shutil.copytree(os.path.join(checkout, name), root / name, ignore=shutil.ignore_patterns("__pycache__"))
    return root
