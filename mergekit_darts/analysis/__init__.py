"""Looking across runs: statistics (stats, comparison) and ablation sweeps (sweep/)."""
