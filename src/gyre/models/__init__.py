"""Model code: building/loading Hugging Face checkpoints, the lean forward, LoRA, sampling."""
