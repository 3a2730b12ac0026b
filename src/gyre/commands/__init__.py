"""CLI commands beyond train/sft/eval: verify-resume and export."""
