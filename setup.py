from setuptools import find_packages, setup

setup(
    name="dstrain",
    version="0.1.0",
    description="DeepSpeed-centric training framework driven by JSON configs",
    python_requires=">=3.10",
    packages=find_packages(include=["dstrain", "dstrain.*", "models", "models.*"]),
    package_data={"models": ["*/recipes/*.json"]},
    install_requires=[
        "torch>=2.1",
        "deepspeed>=0.19,<0.20",
        "fairscale==0.4.13",
        "transformers",
        "accelerate",  # transformers' DeepSpeed ZeRO-3 integration (HfDeepSpeedConfig) needs it
        "datasets",
        "tensorboard",
        "tqdm",
        "safetensors",
        "psutil",
        "numpy",
    ],
    # ray: rollout.backend=ray (RL generation on Ray actors); the tests of that backend need it.
    extras_require={"dev": ["pytest", "hypothesis", "matplotlib", "ray"], "ray": ["ray"]},
    entry_points={"console_scripts": ["dstrain=dstrain.cli:main"]},
)
