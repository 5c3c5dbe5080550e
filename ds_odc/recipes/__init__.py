"""Ready-made workloads for the examples and benchmarks: the SFT training loop (``train``) and its command line
(``sft``), model shapes with random weights, sample lengths from a file or a preset and token ids that are the same
in every run (``workloads``), a character tokenizer built in code (``toy_text``), the LoRA adapters of ``--lora``
(``lora``) and the ZeRO-3 config the Trainer examples pass (``trainer_config``)."""

__all__: list[str] = []  # nothing: each module is imported on its own
