"""lm-eval task YAMLs the evals stage runs (rendered with the dataset path into the run folder)."""
