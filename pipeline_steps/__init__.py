"""The pipeline's steps: prepare, sanity, compile, train, validate, embed, export (and tools:
run-local, parity, diagnose).

One package, one CLI: `python -m pipeline_steps <step> --help`. Library modules (config,
distributed, data, model, checkpoint, ...) hold the logic; each step module is a thin `main(argv)`.
Nothing runs at import, and nothing here imports torch_xla except `distributed`.
"""

__version__ = "0.1.0"
