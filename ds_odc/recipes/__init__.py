"""Ready-made workloads for the examples and benchmarks: model shapes with random weights, sample lengths from a
file or a preset, token ids that are the same in every run (``workloads``), and the SFT command line the examples
share (``sft``)."""

__all__: list[str] = []  # nothing: each module is imported on its own
