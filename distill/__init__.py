"""Building edge drafters aligned to a target by distillation (DistillSpec, arXiv 2310.08461)."""
