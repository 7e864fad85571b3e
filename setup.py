from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="ds_ext",
    version="0.1.0",
    description="Topology-aware DeepSpeed extensions: ZeRO-topo, TED MoE, tiled optimizer, 3D-PMM",
    long_description=Path(__file__).with_name("README.md").read_text(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["ds_ext", "ds_ext.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4,<2.14",
        "deepspeed>=0.19,<0.20",
        "pydantic>=2.6,<3",
        "einops>=0.7",
        "tqdm>=4.60",
        "packaging>=23",
        "hjson>=3",  # ds_configs in hjson, as DeepSpeed reads them
    ],
    # figures (the planner's and benchmarks' PNGs) and the benchmarks' rank statistics
    extras_require={"bench": ["matplotlib>=3.7", "scipy>=1.10"]},
    entry_points={"console_scripts": ["ds-ext=ds_ext.cli:main"]},
)
