"""What a training script uses around the engine: start and end of a distributed job (``distributed``), packed
rows (``collate``) and the attention that keeps their documents apart (``attention``), giant samples split over
ranks (``sequence_parallel``), the global-mean loss under uneven microbatch counts (``loss``), per-step metrics
(``metrics``), a one-step profile (``profiling``), compiled transformer blocks (``compile``) and the choice of a
model's kernels, compiled and Liger's fused ones (``kernels``); around a job, a launch that ends with all its
ranks (``launch``) and ranks on SM partitions of one GPU (``partition``).

Each module is imported on its own (``import ds_odc.training.attention`` registers an attention implementation
with transformers, so nothing here is imported by the package itself).
"""

__all__: list[str] = []  # nothing: each module is imported on its own
