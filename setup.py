"""Installs userrl_megatron (the RL system) and gyms (the environments), and the `userrl` console script."""

from setuptools import find_packages, setup

setup(
    name="userrl_megatron",
    version="0.1.0",
    description="Multi-turn, user-centric RL for LLM agents: Megatron-core actors, SGLang rollout, UserRL gyms.",
    python_requires=">=3.11",
    packages=find_packages(include=["userrl_megatron", "userrl_megatron.*", "gyms", "gyms.*"]),
    include_package_data=True,
    package_data={"userrl_megatron": ["py.typed"], "gyms": ["py.typed"]},
    install_requires=[
        "torch>=2.6",
        "numpy>=2.0",
        "packaging",
        "psutil",
        "transformers>=5.19",
        "safetensors",
        "ray>=2.40",
        "omegaconf>=2.3",
        "openai>=1.40",
        "wandb",
        "tensorboard",
        "rich",
        "pyarrow",
        # megatron-core is installed by tools/install_venv.sh (--no-deps on Python 3.11; see docs/install.md)
    ],
    extras_require={
        # The TE megatron-core 0.19's own lock resolves (git rev 4329ff84 of TE, declared 2.17.1 in its pyproject's
        # [tool.uv.dependency-metadata]), with the CUDA 13 core of its `te` extra; docs/install.md, "On a GPU cluster".
        "gpu": ["transformer-engine[core_cu13,pytorch]==2.17.1"],
        "sglang": ["sglang"],
        "dev": ["pytest", "hypothesis", "ruff"],
    },
    entry_points={"console_scripts": ["userrl=userrl_megatron.cli:main"]},
)
