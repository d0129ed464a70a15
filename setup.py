from setuptools import find_packages, setup

setup(
    name="souffle-tvm",
    version="0.1.0",
    description="Souffle (ASPLOS 2024) as a TVM extension: whole-model tensor-expression analysis "
                "and resource-aware kernel partitioning with grid-synchronised cooperative kernels",
    # souffle_experiments: the experiments (benchmarks, the GPU check, result generators) under
    # python/, one entry point `python -m souffle_experiments`; they run from this checkout
    packages=find_packages(include=["souffle_tvm", "souffle_tvm.*"]) + ["souffle_experiments"],
    package_dir={"souffle_experiments": "python/souffle_experiments"},
    # the latency model's shipped data (cost/shipped.py): an installed wheel reads nothing in the repo
    package_data={"souffle_tvm.cost": ["data/*.json"]},
    python_requires=">=3.11,<3.12",
    install_requires=[
        "apache-tvm==0.27.0.post1",
        # 0.1.15.post2 segfaults in tvm.ir.save_json, which MetaSchedule's database needs.
        "apache-tvm-ffi==0.1.14.post0",
        "numpy>=1.26,<3",
        "onnx==1.23.2",
        # The xgboost module without the 470 MB NCCL download; MetaSchedule's cost model.
        "xgboost-cpu==3.2.0",
        # MetaSchedule's TuneContext imports psutil but the TVM wheel does not require it.
        "psutil==7.2.2",
        # MetaSchedule's runners send work to their worker processes with cloudpickle.
        "cloudpickle==3.1.2",
        "ml_dtypes==0.6.0",
        # Folds exporters' run-time shape arithmetic (Shape->Gather->Concat->Reshape) before
        # TVM's importer sees it; pure Python, no compiled extension (souffle_tvm/frontend/onnx_fold.py).
        "onnxslim==0.1.98",
        # onnxslim evaluates the constant subgraphs it folds with onnxruntime (without it, it
        # silently folds nothing); also the reference runtime of `souffle-tvm run --check`.
        "onnxruntime==1.32.0",
    ],
    extras_require={
        # pytest-xdist: `make test` runs the suite on two workers, a test file per worker at a time
        "test": ["pytest==9.2.0", "pytest-xdist==3.8.0", "onnxruntime==1.32.0", "pyflakes==3.2.0",
                 # tutorials/ are executed by the test suite (tests/test_tutorials.py); plots inline
                 "nbclient==0.11.0", "nbformat==5.11.1", "ipykernel==7.4.0", "matplotlib==3.11.2",
                 # The exporter matrix (tests/torch_models.py): PyTorch's legacy and dynamo ONNX
                 # exporters; the CPU wheel of torch, never a core dependency.
                 "torch==2.13.0", "onnxscript==0.7.2",
                 # The architecture net (tests/hf_models.py): today's models from small configs with
                 # random weights, nothing downloaded
                 "transformers==4.57.1"],
        "bench": ["onnxruntime==1.32.0", "matplotlib==3.11.2"],
        # Mutation testing of the barrier proof and the race checker (results/mutation-2026-12-03/)
        "dev": ["mutmut==2.5.1"],
    },
    entry_points={"console_scripts": ["souffle-tvm=souffle_tvm.cli:main"]},
)
