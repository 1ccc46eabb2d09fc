"""Package metadata for dcredit_hvd, a Horovod plugin (see README.md)."""
from setuptools import find_packages, setup

setup(
    name="dcredit_hvd",
    version="0.2.0",
    description="D-Credit gradient communication scheduling as a drop-in "
    "replacement for horovod.torch.DistributedOptimizer, on Horovod or torch.distributed",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["dcredit_hvd", "dcredit_hvd.*"]),
    # the replay profiles of the emulated cluster (dcredit_hvd.bench.replay.shipped)
    package_data={"dcredit_hvd.bench": ["profiles/*.json"]},
    python_requires=">=3.9",
    # torch alone gives the torch.distributed transport (torchrun). Horovod is built from
    # source against the installed torch (scripts/install.sh, `make install`); listing it here
    # would make pip try a build of its own without the C++17 fix.
    install_requires=["torch>=2.1", "numpy"],
    # The frameworks' entry points (dcredit_hvd.lightning, dcredit_hvd.hf), pinned to the
    # versions the tests run (scripts/install.sh): pip install dcredit_hvd[lightning] / [hf].
    extras_require={"horovod": ["mpi4py"],
                    "lightning": ["pytorch-lightning~=2.6.6"],
                    "hf": ["transformers~=5.24.0", "accelerate~=1.15.0"],
                    "test": ["pytest", "hypothesis", "transformers", "peft", "pytorch-lightning",
                             "accelerate"]},
    license="Apache-2.0",
)
