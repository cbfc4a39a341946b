"""The pipeline's steps: prepare, sanity, compile, train, validate, embed, export (and tools:
run-local, parity, diagnose).

One package, one CLI: `python -m pipeline_steps <step> --help`. The library modules here (config,
distributed, record_reading, tokenization, model, trainer, checkpoint, ...) hold the logic; each
step is a thin module of steps/ (arguments and a `main(argv)`). Nothing runs at import, and
nothing here imports torch_xla except `distributed`.
"""

__version__ = "0.1.0"
