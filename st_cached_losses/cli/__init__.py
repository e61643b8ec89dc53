"""The main job, ``st-cached-losses train``: an application of the library, never imported by it.

- ``command.py``: argparse and the exit-code contract (``main``, the console script);
- ``options.py``: ``TrainOptions`` (one field per flag), the option rules, the default model;
- ``job.py``: ``prepare`` (every check before anything is written) and ``run`` (evaluate, train, evaluate, write);
- ``data.py``: the built-in standard-library data and user datasets; ``evaluation.py``: retrieval metrics;
- ``training.py``: the loss and the trainer run, ``--compare-stock``; ``memory.py``: peak memory of training;
- ``run_dir.py``: the output directory; ``usage.py``: one-line errors (exit code 2).
"""
