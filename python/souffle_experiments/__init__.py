"""souffle-tvm's experiments: the benchmarks, the GPU check, the latency fit and the one-off
result generators behind ``results/``, as one package with one entry point::

    python -m souffle_experiments --help
    python -m souffle_experiments bench --small --models mmoe

Installed in place with the project (``pip install -e .``: ``python/souffle_experiments``); the
experiments run from that checkout (``paths.ROOT``). Importing the package imports nothing
else: each command's module is imported when it runs (``__main__``), so the GPU check runs
where only TVM's runtime exists.
"""
