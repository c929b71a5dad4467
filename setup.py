from setuptools import find_packages, setup

setup(
    name="sut-fairseq",
    version="0.1.0",
    description="Sparse Universal Transformer and Universal Transformer for fairseq",
    packages=find_packages(include=["sut_fairseq", "sut_fairseq.*"]),
    python_requires=">=3.9",
    install_requires=["torch>=2.4"],
)
